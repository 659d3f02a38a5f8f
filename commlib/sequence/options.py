"""The options of one attention call as one value: ``AttentionOptions``.

Every attention entry point (ring, all-gather and sparse, Ulysses, the
hybrid, decode and chunk attention) takes the same options: which
(query, key) pairs are visible (``causal``, ``window``, the documents
``cu_seqlens`` or any ``mask``), how the kernel scores them
(``softmax_scale``, ``softcap``, ``kernel``), and how the call moves its
data (``method``, ``wire``). The public functions keep their keywords and
build this value once; it then travels unchanged through the bindings (a
torch op carries it as a schema derived from its fields, JAX as a static
argument: frozen, so hashable where its values are), the relayouts and the
schedules to ``attention_call.prepare``, which checks it, agrees it across
the ranks and binds it to the kernel. Adding an option is a field here (with
how a graph carries it), its kernel, its facts in ``attention_call``, and
the docs: no layer in between changes.

It lives in ``commlib.sequence`` because most of it is the sequence
geometry this package owns (documents, windows, masks), and because this
package sits above the kernels and below every algorithm and binding that
passes it on. Constructing it checks nothing: its values are checked in
``prepare`` (``check``), where a problem is refused on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from numbers import Integral, Real
from typing import Any, Iterable, Optional, Tuple

from .. import graph_names

# how a compiled graph carries a field (bindings.torch's op schema): a
# torch.library type; "name" fields travel as their graph name
# (commlib.graph_names), "reach" ones as [left, right] with -1 unbounded
GRAPH = "graph"


@dataclass(frozen=True)
class AttentionOptions:
    """One attention call's options (see the module docstring); each
    field's meaning is the public keyword's of the same name."""

    causal: bool = field(default=False, metadata={GRAPH: "bool"})
    window: Any = field(default=None, metadata={GRAPH: "reach"})
    cu_seqlens: Any = field(default=None, metadata={GRAPH: "int[]?"})
    mask: Any = field(default=None, metadata={GRAPH: "name"})
    softmax_scale: Optional[float] = field(default=None, metadata={GRAPH: "float?"})
    softcap: Optional[float] = field(default=None, metadata={GRAPH: "float?"})
    kernel: Any = field(default=None, metadata={GRAPH: "name"})
    method: str = field(default="auto", metadata={GRAPH: "str"})
    wire: Optional[str] = field(default=None, metadata={GRAPH: "str?"})

    def check(self) -> None:
        """A ValueError for an option malformed whatever the call: the
        ``softcap`` a positive finite number or None. (What depends on the
        call, a window against its length, a method against its algorithm,
        is checked there.)"""
        cap = self.softcap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, Real)
                                or not math.isfinite(cap) or cap <= 0):
            raise ValueError(f"softcap must be a positive finite number (Gemma2's 50.0, say: "
                             f"scores s become softcap * tanh(s / softcap)) or None, got "
                             f"{cap!r}")

    def facts(self, digest: bool = True) -> dict:
        """What every rank must agree on besides the documents and the
        scale (``attention_call`` reads those from the arrays): the flags,
        the window, the mask's digest (only where ``digest``: a mask the
        checks refused is not read), the cap, the method and the wire."""
        return dict(causal=self.causal, window=self.window,
                    mask=None if self.mask is None or not digest else self.mask.digest(),
                    softcap=self.softcap, method=self.method, wire=self.wire)

    def graph_values(self) -> Optional[Tuple[Any, ...]]:
        """The fields as a compiled graph carries them (``graph_schema()``'s
        order and types), or None where one cannot travel so (a window that
        is not a pair of token counts, a cap that is not a number, a
        cu_seqlens that is an array: the caller passes that one beside)."""
        values = []
        for option in fields(self):
            value = _carried(option.metadata[GRAPH], getattr(self, option.name))
            if value is _UNCARRIED:
                return None
            values.append(value)
        return tuple(values)

    @classmethod
    def from_graph_values(cls, *values: Any) -> "AttentionOptions":
        """The options ``graph_values`` gave (named objects looked up)."""
        return cls(**{option.name: _restored(option.metadata[GRAPH], value)
                      for option, value in zip(fields(cls), values)})

    def without(self, name: str) -> "AttentionOptions":
        """These options with ``name`` None (a value that travels beside them)."""
        return replace(self, **{name: None})


def graph_schema() -> str:
    """The options' part of a torch op schema: ``type name`` per field."""
    types = {"reach": "int[]?", "name": "str?"}
    return ", ".join(f"{types.get(option.metadata[GRAPH], option.metadata[GRAPH])} "
                     f"{option.name}" for option in fields(AttentionOptions))


_UNCARRIED = object()


def _carried(kind: str, value: Any) -> Any:
    """``value`` of a field of ``kind`` as a graph carries it, or _UNCARRIED."""
    if value is None:
        return None
    if kind == "name":
        return getattr(value, "handle", _UNCARRIED)
    if kind == "reach":
        return _reach(value)
    if kind == "int[]?":
        if not isinstance(value, Iterable):
            return _UNCARRIED
        items = list(value)
        return [int(x) for x in items] if all(_is_int(x) for x in items) else _UNCARRIED
    if kind == "float?":
        return float(value) if isinstance(value, Real) and not isinstance(value, bool) \
            else _UNCARRIED
    if kind in ("str", "str?"):
        return value if isinstance(value, str) else _UNCARRIED
    return value if isinstance(value, bool) else _UNCARRIED


def _restored(kind: str, value: Any) -> Any:
    if value is None:
        return None
    if kind == "name":
        return graph_names.lookup(value)
    if kind in ("reach", "int[]?"):
        return tuple(value)
    return value


def _reach(window: Any) -> Any:
    """(left, right) as [left, right] (-1: unbounded), or _UNCARRIED where
    it is not a pair of ints (or None) the core would accept."""
    try:
        left, right = window
    except (TypeError, ValueError):
        return _UNCARRIED
    if not all(r is None or _is_int(r) for r in (left, right)):
        return _UNCARRIED
    return [-1 if r is None else r for r in (left, right)]


def _is_int(x: Any) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)
