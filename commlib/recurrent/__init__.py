"""Context parallelism for recurrent mixers (Gated DeltaNet, Mamba2): what
the ranks exchange so that each shard's recurrence starts from the right
state and its causal convolution sees the right tokens.

- ``pieces``: the stretches of consecutive global positions a shard holds (padding a
  piece of its own);
- ``incoming_state``: the state entering each piece, from every piece's
  (transition, offset) composed in global order, and its backward;
- ``halo``: the ``width`` tokens before each piece, and its backward.

Framework-agnostic (NumPy, CuPy, torch, JAX outside jit), in the inputs'
dtype; each call is one collective moving O(pieces x state) bytes, or
O(pieces x width) tokens, independent of the sequence length.
"""

from .halo import halo, halo_backward
from .pieces import pieces
from .state import incoming_state, incoming_state_backward

__all__ = ["pieces", "incoming_state", "incoming_state_backward", "halo", "halo_backward"]
