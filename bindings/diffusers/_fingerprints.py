"""Fingerprints of what a rank's answer depends on, agreed by every rank.

Each rank computes the shards of the output it owns from the weights and
from the inputs it holds whole; a rank whose weights or unsplit inputs
differ from the others' (another seed, another timestep) would return its
share of a silently wrong image. So they are agreed: each thing as an
``Item`` (its name, its form, a digest of its contents), all of them in one
exchange (``agree``): the forms in the agreement's facts, one digest of
every content carried with them. Only where the digests differ do more
exchanges follow, every rank alike (each saw the same digests): one of every
item's digest, which names the items that differ, and one of the parts'
digests of a differing item that has parts (the weights: which tensors).

A tensor's digest is integer arithmetic on its bytes, on its own device
(no host copy): its 32-bit words, weighted by column within rows of
``COLUMNS`` words and by row, summed modulo a prime. Every sum is of
integers, exact in any order, so equal bytes give equal digests whatever
the reduction's split across threads; one host transfer per device brings
the digests back.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from commlib import CollectiveMismatchError

COLUMNS = 1024
# a row's sum is exact in float64: a word below 2^31 in size, a column's weight below 2^12,
# COLUMNS = 2^10 of them (below 2^53); modulo a prime below 2^31, times a row's weight (below
# 2^31), the rows' terms stay exact in int64
PRIME = 2**31 - 1
# the rows of a chunk: 2 MiB of float64 on the CPU (in cache), 512 MiB on a GPU
CPU_CHUNK_ROWS, DEVICE_CHUNK_ROWS = 256, 65536
NAMED = 8  # differing items named in an error, the rest counted
_PLAIN = (str, int, float, bool, complex, type(None), torch.dtype, torch.device)

_column_weights: Dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class Item:
    """One thing every rank must hold alike: ``form`` must match exactly
    (shape and dtype, a value's type), ``digest`` is its contents'.
    ``parts`` lists its own items, to name which of them differ."""

    name: str
    form: str
    digest: int
    parts: Optional[Callable[[], Sequence["Item"]]] = None


def agree(comm, op: str, subject: str, items: Sequence[Item], advice: str) -> None:
    """Raise ``CollectiveMismatchError`` on every rank unless every rank
    holds ``items`` alike, naming those that differ. One exchange where
    they agree."""
    mine = combined(item.digest for item in items)
    carried = np.full((comm.size, 1), mine, np.int64)
    received = comm.agree(op, subject, *(f"{item.name}: {item.form}" for item in items),
                          carry=carried)
    if (received == mine).all():
        return
    differing = _differing(comm, op, subject, items)
    named = ", ".join(differing[:NAMED]) + (f" and {len(differing) - NAMED} more"
                                            if len(differing) > NAMED else "")
    raise CollectiveMismatchError(f"{subject} differ between ranks: {named} (the same shapes "
                                  f"and types, other contents). {advice}")


def _differing(comm, op: str, subject: str, items: Sequence[Item]) -> List[str]:
    """The names of the items (or of their parts) whose digests differ
    between ranks; collective, every rank alike."""
    digests = np.array([item.digest for item in items], np.int64)
    rows = comm.agree(f"{op} (which differ)", subject, len(items),
                      carry=np.tile(digests, (comm.size, 1)))
    names = []
    for item, column in zip(items, rows.T):
        if (column == column[0]).all():
            continue
        if item.parts is None:
            names.append(item.name)
        else:
            names += _differing(comm, f"{op} {item.name}", f"{subject}: {item.name}",
                                item.parts())
    return names


def combined(digests) -> int:
    """One int64 digest of several."""
    data = np.fromiter(digests, np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def tensor_items(named: Sequence[Tuple[str, torch.Tensor]]) -> List[Item]:
    """An item per tensor: its shape and dtype, its contents' digest."""
    digests = tensor_digests([tensor for _, tensor in named])
    return [Item(name, tensor_form(tensor), digest)
            for (name, tensor), digest in zip(named, digests)]


def version_of(tensor: torch.Tensor) -> Optional[int]:
    """Its version counter, which in-place writes bump (an inference
    tensor has none)."""
    return None if tensor.is_inference() else tensor._version


def tensor_form(tensor: torch.Tensor) -> str:
    return f"tensor {tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"


def tensor_digests(tensors: Sequence[torch.Tensor]) -> List[int]:
    """Each tensor's digest, computed on its device; one host transfer per
    device. A tensor on the meta device (no contents yet) digests to 0."""
    found: List[Optional[torch.Tensor]] = [None if t.is_meta else _digest(t) for t in tensors]
    by_device: Dict[torch.device, List[int]] = {}
    for i, digest in enumerate(found):
        if digest is not None:
            by_device.setdefault(digest.device, []).append(i)
    values = [0] * len(tensors)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([found[i] for i in indices]).cpu().tolist()):
            values[i] = value
    return values


def _digest(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 digest of the tensor's bytes, on its device: each row of
    ``COLUMNS`` words weighted by column (a float64 matrix-vector product,
    exact: every partial sum is an integer below 2^53), a chunk of rows at
    a time through one buffer (cache-sized on the CPU); the rows' sums
    weighted by row, modulo ``PRIME``."""
    words = _words(tensor)
    device, count = words.device, words.numel()
    if count == 0:
        return torch.zeros((), dtype=torch.int64, device=device)
    weights = _columns(device)
    full = count // COLUMNS
    sums = []
    if full:
        body = words[:full * COLUMNS].view(full, COLUMNS)
        chunk = CPU_CHUNK_ROWS if device.type == "cpu" else DEVICE_CHUNK_ROWS
        buffer = torch.empty(min(full, chunk), COLUMNS, dtype=torch.float64, device=device)
        for start in range(0, full, chunk):
            rows = buffer[:min(chunk, full - start)]
            rows.copy_(body[start:start + chunk])
            sums.append(rows @ weights)
    if count % COLUMNS:
        tail = words[full * COLUMNS:].to(torch.float64)
        sums.append((tail @ weights[:tail.numel()]).reshape(1))
    per_row = torch.cat(sums).to(torch.int64) % PRIME
    row_weights = torch.arange(1, per_row.numel() + 1, dtype=torch.int64, device=device) * 48271
    return (per_row * (row_weights % PRIME) % PRIME).sum()


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 32-bit words (bytes where their count is not a
    multiple of 4), one dimension, contents alone deciding them."""
    flat = tensor.detach().reshape(-1)
    if flat.stride(0) != 1 or flat.storage_offset() * flat.element_size() % 4:
        # a broadcast element (stride 0), a view at an offset its words cannot start at
        flat = flat.clone(memory_format=torch.contiguous_format)
    raw = flat.view(torch.uint8)
    return raw.view(torch.int32) if raw.numel() % 4 == 0 else raw


def _columns(device: torch.device) -> torch.Tensor:
    """The column weights, the same on every rank (in [1, 2^12))."""
    if device not in _column_weights:
        _column_weights[device] = (torch.arange(COLUMNS, dtype=torch.float64) * 40503 % 4093
                                   + 1).to(device)
    return _column_weights[device]


def value_items(name: str, value: Any) -> List[Item]:
    """The items of a model input: a tensor; a list, tuple or dict holding
    tensors, item by item; any other value, one item by its printed form
    (plain values: numbers, strings, None, their containers) or by its type
    alone (an object whose print may hold its address)."""
    tensors: List[Tuple[str, torch.Tensor]] = []
    plain: List[Item] = []

    def walk(path: str, x: Any) -> None:
        if isinstance(x, torch.Tensor):
            tensors.append((path, x))
        elif isinstance(x, (list, tuple)) and _holds_tensor(x):
            for i, element in enumerate(x):
                walk(f"{path}[{i}]", element)
        elif isinstance(x, dict) and _holds_tensor(x):
            for key in x:
                walk(f"{path}[{key!r}]", x[key])
        elif _is_plain(x):
            plain.append(Item(path, type(x).__name__, _text_digest(repr(x))))
        else:
            plain.append(Item(path, f"{type(x).__qualname__} (compared by type)", 0))
    walk(name, value)
    return tensor_items(tensors) + plain


def _holds_tensor(x: Any) -> bool:
    values = x.values() if isinstance(x, dict) else x
    return any(isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple, dict))
                                               and _holds_tensor(v)) for v in values)


def _is_plain(x: Any) -> bool:
    if isinstance(x, (list, tuple)):
        return all(_is_plain(v) for v in x)
    if isinstance(x, dict):
        return all(_is_plain(k) and _is_plain(v) for k, v in x.items())
    return isinstance(x, _PLAIN)


def _text_digest(text: str) -> int:
    return zlib.crc32(text.encode())
