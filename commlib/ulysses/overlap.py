"""Ulysses overlapped with the Q/K/V projection ("async Ulysses", as in
DeepSpeed-Ulysses' and vLLM-Omni's): the heads are cut into ``groups``
groups, and the caller's ``project`` makes each group's sequence shards
while the previous group's seq->head all-to-all is in flight:

    project 0 | send 0
              | project 1 | send 1 | wait 0, attend 0, send out 0 back
                                   | project 2 | send 2 | wait 1, attend 1, ...

so a group's exchange hides behind the next group's projection, and its
output's head->seq behind the next group's attention. Every group is
Ulysses over its own heads (split over the ranks as ``relayout`` splits any
head count), so the result is ``ulysses_attention``'s over all the heads:
attention is computed head by head.

A group holds ``num_heads / groups`` query heads, at least one per rank,
and whole GQA groups: its kv heads are those its query heads read (several
whole kv heads, or one kv head read by several groups, which each project
it).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from ..kernels import Kernel
from ..namespace import detached, namespace
from ..sequence.attention_call import prepare
from ..sequence.options import AttentionOptions
from .attention import ulysses_forward
from .relayout import check_heads, head_to_seq_async, lse_to_seq, seq_to_head_async
from .wire import check_wire

Project = Callable[[slice, slice], Tuple[Any, Any, Any]]


def head_groups(num_heads: int, num_kv_heads: int, groups: int,
                size: int) -> List[Tuple[slice, slice]]:
    """Each group's (query heads, kv heads) as slices, in head order; a
    ValueError that says what to change where the heads cannot be grouped."""
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("groups", groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}) for GQA/MQA")
    readers = num_heads // num_kv_heads  # query heads per kv head
    fits = [n for n in range(1, num_heads // size + 1)
            if num_heads % n == 0 and ((num_heads // n) % readers == 0
                                       or readers % (num_heads // n) == 0)]
    per_group = num_heads // groups
    if num_heads % groups:
        raise ValueError(f"groups={groups} does not divide num_heads={num_heads}; use one of "
                         f"{fits}")
    if per_group < size:
        check_heads(num_heads, size)  # fewer heads than ranks: that message
        raise ValueError(f"groups={groups} leaves {per_group} heads a group, fewer than the "
                         f"{size} ranks, so a rank would own no head of a group; use one of "
                         f"{fits}")
    if per_group % readers and readers % per_group:
        raise ValueError(f"a group of {per_group} query heads would split the {readers} query "
                         f"heads of a kv head between groups; use one of {fits}")
    return [(slice(g * per_group, (g + 1) * per_group),
             slice(g * per_group // readers, -(-(g + 1) * per_group // readers)))
            for g in range(groups)]


def ulysses_attention_overlapped(project: Project, comm, *, num_heads: int,
                                 num_kv_heads: Optional[int] = None, groups: int, layout: str,
                                 causal: bool, softmax_scale: Optional[float] = None,
                                 return_lse: bool = False, cu_seqlens: Any = None,
                                 window: Any = None, mask: Any = None,
                                 kernel: Optional[Kernel] = None, wire: Optional[str] = None,
                                 softcap: Optional[float] = None):
    """``ulysses_attention`` of the q, k, v that ``project(heads, kv_heads)``
    makes group by group: given two slices of head indices (the group's
    query heads and kv heads, ``head_groups``), it returns this rank's
    sequence shards of those heads, q [b, s/P, len(heads), d] and k, v
    [b, s/P, len(kv_heads), d]. Each group's exchange overlaps the next
    group's projection (module docstring). Returns out [b, s/P, num_heads, d]
    and, with ``return_lse``, lse [b, num_heads, s/P]; the other keywords
    as ``ulysses_attention``'s. ``num_kv_heads`` defaults to ``num_heads``.

    The first group is projected before every rank agrees on the call, so
    that its shapes are checked: an exception in that projection is refused
    on every rank; one in a later projection fails the communicator (the
    exchange in flight is dropped) and the peers hear of it."""
    try:
        spans = head_groups(num_heads, num_heads if num_kv_heads is None else num_kv_heads,
                            groups, comm.size)
        first = _projected(project, *spans[0])
        _check_group(first, spans[0], wire)
    except Exception as error:  # the caller's projection too: refused on every rank
        comm.agree("ulysses_attention_overlapped", problem=error)
        raise  # not reached: agree raised on every rank
    q, k, v = first
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               wire=wire)
    call = prepare(comm, "ulysses_attention_overlapped", q, k, v, options, layout=layout,
                   num_heads=num_heads, num_kv_heads=num_kv_heads, groups=groups)
    per_group = spans[0][0].stop - spans[0][0].start
    arriving = [seq_to_head_async(first, comm, per_group, wire)]
    leaving, lses = [], []
    for g in range(len(spans)):
        if g + 1 < len(spans):
            group = _projected(project, *spans[g + 1])
            _check_group(group, spans[g + 1], wire, like=first)
            arriving.append(seq_to_head_async(group, comm, per_group, wire))
        out, lse = ulysses_forward(call, *arriving[g]())
        arriving[g] = None  # the gathered heads go as soon as they are attended
        leaving.append(head_to_seq_async(out, comm, per_group, wire=wire))
        if return_lse:
            lses.append(lse_to_seq(lse, comm, per_group))
    xp = namespace(q)
    result = xp.concat([wait() for wait in leaving], axis=2)
    return (result, xp.concat(lses, axis=1)) if return_lse else result


def _projected(project: Project, heads: slice, kv_heads: slice) -> Tuple[Any, Any, Any]:
    q, k, v = project(heads, kv_heads)
    return detached(q, k, v)


def _check_group(qkv: Tuple[Any, Any, Any], spans: Tuple[slice, slice], wire: Optional[str],
                 like: Any = None) -> None:
    """A group's projection: q with the group's query heads, k and v with
    its kv heads, and (``like``: the first group's) the first group's
    batch, length, head_dim and dtype."""
    for name, x, heads in zip("qkv", qkv, (spans[0], spans[1], spans[1])):
        want = heads.stop - heads.start
        if len(getattr(x, "shape", ())) != 4 or x.shape[2] != want:
            raise ValueError(f"project(heads={heads.start}:{heads.stop}, kv_heads="
                             f"{spans[1].start}:{spans[1].stop}) must return {name} of shape "
                             f"[batch, seq/P, {want}, head_dim], got "
                             f"{tuple(getattr(x, 'shape', ()))}")
    if like is not None:
        for x, first in zip(qkv, like):
            if (x.shape[0], x.shape[1], x.shape[3], x.dtype) != \
                    (first.shape[0], first.shape[1], first.shape[3], first.dtype):
                raise ValueError(f"project returned {tuple(x.shape)} {x.dtype} for heads "
                                 f"{spans[0].start}:{spans[0].stop} but {tuple(first.shape)} "
                                 f"{first.dtype} for the first group; every group must share "
                                 f"batch, length, head_dim and dtype")
    check_wire(wire, qkv[0])
