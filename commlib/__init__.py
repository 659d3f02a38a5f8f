"""commlib: collectives for context and expert parallelism, over MPI and NCCL.

    import commlib
    comm = commlib.init()
    y, recv_counts = comm.alltoallv(x, send_counts)
"""

import sys as _sys

from . import _moved
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

# where earlier releases had them (the same module objects)
_moved.alias(_sys.modules[__name__], {
    "documents": "commlib.sequence.documents", "balanced": "commlib.sequence.balanced",
    "masks": "commlib.sequence.masks", "common_masks": "commlib.sequence.common_masks",
    "visibility": "commlib.sequence.visibility",
    "attention_inputs": "commlib.sequence.attention_call",
    "handles": "commlib.graph_names", "arrays": "commlib.dlpack"})

__all__ = [
    "init", "abort_on_exception", "Communicator", "Topology", "SupportsDLPack",
    "CommlibError", "CollectiveMismatchError", "CommTimeoutError", "PeerFailedError",
    "AllocationRefusedError", "BackendUnavailableError", "LaunchError",
    "__version__",
]
