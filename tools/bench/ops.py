"""How many framework operations one call runs, counted the way issue 46
counts them: the top-level ``aten::`` events of torch's profiler, an
operation inside a custom op (commlib's ``commlib::moe_dispatch``, say)
counted as the operations it runs, one inside another aten op not at all.
On a GPU each compute op is a kernel launch: the count is what a decode
step pays per call beside its transfers."""

from __future__ import annotations

from typing import Any, Callable


def torch_ops(call: Callable[[], Any]) -> int:
    """The top-level aten operations of one ``call()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as trace:
        call()
    return sum(1 for event in trace.events()
               if event.name.startswith("aten::") and not _inside_aten(event))


def warm_torch_ops(call: Callable[[], Any]) -> int:
    """``torch_ops`` of a call after a first one: what is made once per
    shape (tables, buffers) is not counted."""
    call()
    return torch_ops(call)


def _inside_aten(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False
