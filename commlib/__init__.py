"""commlib: collectives for context and expert parallelism, over MPI and NCCL.

    import commlib
    comm = commlib.init()
    y, recv_counts = comm.alltoallv(x, send_counts)
"""

from .arrays import SupportsDLPack
from .bootstrap import init
from .communicator import Communicator
from .errors import (BackendUnavailableError, CollectiveMismatchError, CommlibError,
                     CommTimeoutError)
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "init", "Communicator", "Topology", "SupportsDLPack",
    "CommlibError", "CollectiveMismatchError", "CommTimeoutError", "BackendUnavailableError",
    "__version__",
]
