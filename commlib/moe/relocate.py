"""Expert weights moved between placements, and a replicated expert's
gradients summed over its replicas (issue 45).

Both take this rank's arrays laid out by slot: ``[slots_per_rank, ...]``,
row j for the logical expert ``placement.slots[rank][j]`` (what a
``Dispatcher(..., placement=)`` gives slot j). One array, or a dict of them
(a layer's weights and biases, and in training its optimizer state: Adam's
``exp_avg`` and ``exp_avg_sq`` are more arrays laid out the same way);
several arrays of any dtypes and trailing shapes travel as one row of bytes
per expert, one message per peer. NumPy, CuPy, torch, or JAX outside ``jit``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import array_api_extra as xpx
import numpy as np

from ..namespace import (
    accumulated,
    as_bytes,
    detached,
    device,
    dtype_name,
    framework,
    from_bytes,
    from_host_ints,
    namespace,
    on_cuda,
    take_rows,
)
from .contract import placement_fingerprint, placement_problem
from .placement import EMPTY, Placement, moves

__all__ = ["move_expert_weights", "start_expert_move", "PendingMove",
           "sum_replica_gradients"]


def move_expert_weights(comm, weights: Any, current: Placement, new: Placement, *,
                        in_place: bool = False) -> Any:
    """``weights`` laid out by slot under ``current`` (one array or a dict of
    arrays, each ``[current.slots_per_rank, ...]``), returned laid out by
    slot under ``new`` (``[new.slots_per_rank, ...]``, the same structure,
    framework and dtypes). Collective: ``start_expert_move(...).wait()``.

    Only what moves travels, in one ``alltoallv`` (none when nothing moves):
    a rank receives each logical expert it gains and holds nowhere now once,
    from the rank ``moves`` names (a holder on its node first), every array
    of it in the same row. A weight this rank holds already, in any slot, is
    copied locally. An empty slot of ``new`` (a drained rank has only those)
    is zeros. Each array of the new layout is written once: one
    concatenation of slices of this rank's rows and of the rows received.
    ``in_place=True``: the slots that change are overwritten in
    ``weights`` itself (NumPy, CuPy or torch; both placements with as many
    slots per rank), and ``weights`` is returned as given, the very objects
    (a torch ``nn.Parameter`` stays that Parameter, gradient flag and all,
    so rebinding the result onto a module keeps it): no second copy of the
    rank's weights, and only the changed slots' rows written.
    Every rank must pass the same placements, array names, dtypes and
    trailing shapes: else, or where a rank's input is wrong (placements for
    another world size or other experts, a leading size other than
    ``current.slots_per_rank``, ``in_place`` with JAX arrays or another
    slot count), ``CollectiveMismatchError`` on every rank.
    """
    return start_expert_move(comm, weights, current, new, in_place=in_place).wait()


def start_expert_move(comm, weights: Any, current: Placement, new: Placement, *,
                      in_place: bool = False) -> "PendingMove":
    """``move_expert_weights`` started: the rows that travel are packed and
    posted, and this returns while they cross, so that a server keeps
    answering with ``weights`` (``current``'s layout) meanwhile; ``wait()``
    waits for them and returns the new layout. Collective, like every
    collective started in the same order on every rank. The rows sent are
    read now, the rows kept at ``wait()``: ``weights`` must not change in
    between."""
    arrays, rebuild = _flatten(weights)
    problem = _placements_problem(comm, current, new) or _arrays_problem(arrays, current) \
        or (_in_place_problem(arrays, current, new) if in_place else None)
    facts = () if problem else (placement_fingerprint(current), placement_fingerprint(new),
                                f"in_place={bool(in_place)}", *_array_facts(arrays))
    comm.agree("move_expert_weights", *facts, problem=problem)
    arrays = list(detached(*arrays.values()))
    rank, holds = comm.rank, current.slots[comm.rank].tolist()
    first_slot = {expert: holds.index(expert) for expert in set(holds) if expert != EMPTY}
    travelling = moves(current, new)
    sent = sorted((t for t in travelling if t[1] == rank), key=lambda t: t[2])
    arriving = sorted((t for t in travelling if t[2] == rank), key=lambda t: t[1])
    pending = None
    if travelling:  # the same list on every rank: all exchange, or none
        payload = _pack(arrays, [first_slot[e] for e, _, _ in sent])
        pending = comm.alltoallv_async(payload, _per_rank([t[2] for t in sent], comm.size),
                                       _per_rank([t[1] for t in arriving], comm.size))
    arrived = {expert: len(holds) + i for i, (expert, _, _) in enumerate(arriving)}
    zero = len(holds) + len(arriving)
    source = [zero if e == EMPTY else first_slot[e] if e in first_slot else arrived[e]
              for e in new.slots[rank].tolist()]
    changed = [j for j, (was, now) in enumerate(zip(holds, new.slots[rank].tolist()))
               if was != now] if in_place else None
    return PendingMove(arrays, rebuild, source, pending, changed, weights if in_place else None)


class PendingMove:
    """A move of expert weights in flight (``start_expert_move``).
    ``wait()`` (once, on every rank, as for every in-flight object) waits for
    the rows on the wire and
    returns the weights laid out by the new placement's slots. Dropped
    unfinished, its exchange is abandoned as any ``Pending``'s is."""

    def __init__(self, arrays: List[Any], rebuild, source: List[int], pending: Any,
                 changed: Optional[List[int]] = None, given: Any = None):
        self._arrays, self._rebuild, self._source = arrays, rebuild, source
        self._pending, self._done = pending, False
        # in place: the slots to overwrite (in ``arrays``, views of the arrays given that
        # autograd does not watch), and what was given, returned as it is
        self._changed, self._given = changed, given

    def wait(self) -> Any:
        if self._done:
            raise RuntimeError("this expert move was already waited for")
        self._done = True
        received = [None] * len(self._arrays) if self._pending is None else \
            _unpack(self._pending.wait(), self._arrays)
        if self._changed is None:
            return self._rebuild([_assemble(a, r, self._source)
                                  for a, r in zip(self._arrays, received)])
        if self._changed:  # the changed slots' rows gathered first: a source may be one
            sources = [self._source[j] for j in self._changed]
            for a, r in zip(self._arrays, received):
                slots = from_host_ints(self._changed, like=a)
                xpx.at(a)[slots].set(_assemble(a, r, sources), copy=False)
        return self._given


def sum_replica_gradients(comm, grads: Any, placement: Placement) -> Any:
    """``grads`` laid out by slot under ``placement`` (one array or a dict,
    each ``[placement.slots_per_rank, ...]``), with every slot's rows
    replaced by the sum of its logical expert's gradients over all of its
    replicas: replicas that start equal stay equal after an optimizer step.
    Call it after the backward pass, before the optimizer step (the dense
    parameters' all-reduce is ``allreduce_gradients``'s). Collective.

    A rank first sums its own replicas of an expert (in slot order), then
    sends that partial sum to each other rank holding the expert, all in
    one ``alltoallv`` (none when no expert has replicas on two ranks); every
    holder adds the partials in rank order. Sums run in float32 for 16-bit
    gradients and partials travel in the gradients' dtype, so every replica
    computes the same bits. An empty slot's gradients come back zero.
    Refused on every rank (``CollectiveMismatchError``) as
    ``move_expert_weights`` refuses.
    """
    arrays, rebuild = _flatten(grads)
    problem = _placements_problem(comm, placement, placement) or _arrays_problem(arrays,
                                                                              placement)
    facts = () if problem else (placement_fingerprint(placement), *_array_facts(arrays))
    comm.agree("sum_replica_gradients", *facts, problem=problem)
    arrays = list(detached(*arrays.values()))
    rank, slots = comm.rank, placement.slots
    held = [sorted(set(row) - {EMPTY}) for row in slots.tolist()]  # each rank's experts
    ranks_of = [[r for r in range(comm.size) if e in held[r]] for e in range(
        placement.num_logical)]
    mine = held[rank]
    at = {e: i for i, e in enumerate(mine)}
    # this rank's partial sum of each expert it holds: its slots of that expert, in order
    local = [[j for j, x in enumerate(slots[rank].tolist()) if x == e] for e in mine]
    partials = [_sums(a, None, local) for a in arrays]
    # to each other rank, the partials of the experts it holds too; from it, the same
    sent = [(q, at[e]) for q in range(comm.size) if q != rank for e in mine if e in held[q]]
    arriving = [(q, e) for q in range(comm.size) if q != rank for e in held[q] if e in at]
    received: Optional[List[Any]] = None
    if any(len(r) > 1 for r in ranks_of):  # a function of the placement: all or none
        payload = _pack(partials, [i for _, i in sent])
        raw, _ = comm.alltoallv(payload, _per_rank([q for q, _ in sent], comm.size),
                                _per_rank([q for q, _ in arriving], comm.size))
        received = _unpack(raw, arrays)
    # the partials, in rank order: this rank's among the partials pool, the others after it
    where = {(rank, e): i for i, e in enumerate(mine)}
    where.update({key: len(mine) + i for i, key in enumerate(arriving)})
    totals = [_sums(p, None if received is None else received[i],
                    [[where[r, e] for r in ranks_of[e]] for e in mine])
              for i, p in enumerate(partials)]
    source = [at.get(e, len(mine)) for e in slots[rank].tolist()]  # EMPTY: the zero row
    return rebuild([_assemble(t, None, source) for t in totals])


def _sums(local: Any, received: Any, terms: List[List[int]]) -> Any:
    """One row per entry of ``terms``: the sum of those rows of the pool
    (``local``, then ``received``), in that order, accumulated in float32
    for 16-bit dtypes and returned in local's dtype."""
    pool = accumulated(_pool(local, received))
    zero = pool.shape[0] - 1
    most = max((len(t) for t in terms), default=0)
    order = np.array([t + [zero] * (most - len(t)) for t in terms], dtype=np.int64)
    total = take_rows(pool, from_host_ints(order[:, 0] if most else [], like=local))
    for k in range(1, most):
        total = total + take_rows(pool, from_host_ints(order[:, k], like=local))
    return namespace(local).astype(total, local.dtype)


def _flatten(tree: Any):
    """(name -> array, a function rebuilding ``tree``'s structure from a list)."""
    if isinstance(tree, dict):
        names = list(tree)
        return dict(tree), lambda values: dict(zip(names, values))
    return {"": tree}, lambda values: values[0]


def _placements_problem(comm, current: Any, new: Any) -> Optional[ValueError]:
    for name, placement in (("current", current), ("new", new)):
        if not isinstance(placement, Placement):
            return ValueError(f"{name} must be a commlib.moe.Placement, got "
                              f"{type(placement).__name__}")
        problem = placement_problem(comm, placement.num_logical, placement)
        if problem is not None:
            return problem
    if (current.num_logical, current.nodes) != (new.num_logical, new.nodes):
        return ValueError(f"current places {current.num_logical} experts in {current.nodes} "
                          f"nodes, new {new.num_logical} in {new.nodes}: a move keeps both")
    return None


def _arrays_problem(arrays: Dict[str, Any], placement: Placement) -> Optional[ValueError]:
    if not arrays:
        return ValueError("no arrays given: pass one array or a dict of them")
    kinds = set()
    for name, a in arrays.items():
        label = f"array {name!r}" if name else "the array"
        try:
            kinds.add((framework(a), on_cuda(a) and str(device(a))))
        except TypeError as error:
            return ValueError(f"{label}: {error}")
        if a.ndim == 0 or a.shape[0] != placement.slots_per_rank:
            return ValueError(f"{label} has shape {tuple(a.shape)}: its leading size must be "
                              f"this rank's {placement.slots_per_rank} slots")
    if len(kinds) > 1:
        return ValueError(f"the arrays must share one framework and device, got {sorted(kinds)}")
    return None


def _in_place_problem(arrays: Dict[str, Any], current: Placement,
                      new: Placement) -> Optional[ValueError]:
    if current.slots_per_rank != new.slots_per_rank:
        return ValueError(f"in_place needs as many slots per rank in both placements: current "
                          f"has {current.slots_per_rank}, new {new.slots_per_rank}")
    for name, a in arrays.items():
        if framework(a) == "jax" or not getattr(getattr(a, "flags", None), "writeable", True):
            return ValueError(f"in_place needs writable arrays; {name or 'the array'} is "
                              f"{'a JAX array' if framework(a) == 'jax' else 'read-only'}: "
                              f"move without in_place")
    return None


def _array_facts(arrays: Dict[str, Any]) -> List[str]:
    side = "CUDA arrays" if on_cuda(next(iter(arrays.values()))) else "host arrays"
    return [side] + [f"{name or 'array'}: {dtype_name(a)} {tuple(a.shape[1:])}"
                     for name, a in arrays.items()]


def _per_rank(ranks: Any, size: int) -> np.ndarray:
    return np.bincount(np.asarray(ranks, dtype=np.int64), minlength=size)


def _pack(arrays: List[Any], rows: List[int]) -> Any:
    """The ``rows`` of every array, as one row of bytes each: uint8 [rows,
    bytes], written once (one concatenation of every row's bytes, views)."""
    xp = namespace(arrays[0])
    width = sum(_row_bytes(a) for a in arrays)
    if not rows:
        return xp.zeros((0, width), dtype=xp.uint8, device=device(arrays[0]))
    parts = [xp.reshape(as_bytes(a[r:r + 1]), (-1,)) for r in rows for a in arrays]
    return xp.reshape(xp.concat(parts, axis=0), (len(rows), width))


def _row_bytes(a: Any) -> int:
    return a.dtype.itemsize * math.prod(a.shape[1:])  # torch's dtypes know theirs too


def _unpack(raw: Any, arrays: List[Any]) -> List[Any]:
    """``_pack`` undone: each array's rows out of the received bytes."""
    parts, offset = [], 0
    for a in arrays:
        width = _row_bytes(a)
        parts.append(from_bytes(raw[:, offset:offset + width], a.dtype, tuple(a.shape[1:])))
        offset += width
    return parts


def _pool(local: Any, received: Any) -> Any:
    """The rows a result takes from: this rank's, then those received (if
    any), then one row of zeros (for empty slots and padding)."""
    xp = namespace(local)
    zero = xp.zeros((1,) + tuple(local.shape[1:]), dtype=local.dtype, device=device(local))
    return xp.concat([local] + ([] if received is None else [received]) + [zero], axis=0)


def _assemble(local: Any, received: Any, source: List[int]) -> Any:
    """The rows at ``source`` of ``_pool(local, received)``, without making
    that pool: each run of consecutive rows of one part (or of zeros) is a
    view, and one concatenation of them writes every byte of the result
    once (a gather from the pool would copy the weights twice)."""
    xp = namespace(local)
    parts = [local] + ([] if received is None else [received])
    bounds = np.cumsum([0] + [p.shape[0] for p in parts]).tolist()
    runs: List[List[int]] = []  # [part, first row in it, rows]
    for s in source:
        part = next((k for k in range(len(parts)) if s < bounds[k + 1]), len(parts))
        row = s - bounds[part] if part < len(parts) else 0
        last = runs[-1] if runs else None
        if last and last[0] == part and (part == len(parts) or last[1] + last[2] == row):
            last[2] += 1
        else:
            runs.append([part, row, 1])
    row_shape = tuple(local.shape[1:])
    zero = xp.zeros((1,) + row_shape, dtype=local.dtype, device=device(local))
    return xp.concat([parts[k][row:row + n] if k < len(parts)
                      else xp.broadcast_to(zero, (n,) + row_shape) for k, row, n in runs],
                     axis=0)
