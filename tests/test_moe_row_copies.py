"""How many times a counted dispatch and its combine copy the rows, in
torch on the CPU at world size 1 (issue 37: the torch Dispatcher's pair
took 110 ms where it had taken 69, at 2 ranks, 4096 tokens x 1024 float32,
8 experts, top-2).

What a flat dispatch + combine needs, as fresh arrays at least half the
size of expert_x: dispatch packs the message (ids, weights and row), gathers
the copies each rank gets, and gathers expert_x from the arrivals (3);
combine makes the per-arrival sums and the per-token sums (2). The slower
code also expanded through a scatter (an empty expert_x, then the gathered
rows copied into it: 2 more) and gathered every expert row again for
combine's sums, then scaled all of them at once (2 more): the weighted
terms of ``namespace.sum_rows`` are made a slice at a time on the CPU.
A torch ``TorchFunctionMode`` sees every call and counts the results that
share no memory with an argument."""

import numpy as np

import commlib
from commlib.moe import route

import requires

TOKENS, HIDDEN, EXPERTS, K = 1024, 1024, 8, 2
DISPATCH_COPIES, COMBINE_COPIES = 3, 2


def test_a_flat_dispatch_and_combine_copy_the_rows_only_where_needed():
    torch = requires.module("torch")
    from torch.overrides import TorchFunctionMode

    from commlib.bindings.torch import Dispatcher

    class FreshRows(TorchFunctionMode):
        """The calls whose tensor result is new memory of ``least`` bytes
        or more (not a view, nor an argument updated in place)."""

        def __init__(self, least):
            super().__init__()
            self.least, self.calls = least, []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() * out.element_size() >= self.least:
                given = {a.untyped_storage().data_ptr() for a in
                         list(args) + list((kwargs or {}).values())
                         if isinstance(a, torch.Tensor)}
                if out.untyped_storage().data_ptr() not in given:
                    self.calls.append((getattr(func, "__name__", str(func)), tuple(out.shape)))
            return out

    comm = commlib.init()
    try:
        rng = np.random.default_rng(3)
        x = torch.from_numpy(rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32))
        experts, weights = route(torch.from_numpy(
            rng.standard_normal((TOKENS, EXPERTS)).astype(np.float32)), K)
        d = Dispatcher(comm, EXPERTS)
        least = TOKENS * K * HIDDEN * 4 // 2
        with FreshRows(least) as dispatched:
            expert_x, handle = d.dispatch(x, experts, weights)
        with FreshRows(least) as combined:
            y = d.combine(expert_x, handle)
        expected = (weights.sum(dim=1, keepdim=True) * x).numpy()  # identity experts
        assert np.allclose(y.numpy(), expected, atol=1e-5)
        assert len(dispatched.calls) <= DISPATCH_COPIES, dispatched.calls
        assert len(combined.calls) <= COMBINE_COPIES, combined.calls
    finally:
        comm.free()
