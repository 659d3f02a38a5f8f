"""commlib: collectives for context and expert parallelism, over MPI and NCCL.

    import commlib
    comm = commlib.init()
    y, recv_counts = comm.alltoallv(x, send_counts)
"""

from .abort import abort_on_exception
from .bootstrap import init
from .communicator import Communicator
from .dlpack import SupportsDLPack
from .errors import (
                     AllocationRefusedError,
                     BackendUnavailableError,
                     CollectiveMismatchError,
                     CommlibError,
                     CommTimeoutError,
                     LaunchError,
                     PeerFailedError,
)
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "init", "abort_on_exception", "Communicator", "Topology", "SupportsDLPack",
    "CommlibError", "CollectiveMismatchError", "CommTimeoutError", "PeerFailedError",
    "AllocationRefusedError", "BackendUnavailableError", "LaunchError",
    "__version__",
]
