"""Route one model's attention to commlib, leaving every other model alone.

diffusers' attention processors compute attention through
``dispatch_attention_fn(..., parallel_config=self._parallel_config)``,
reading the function from their module and the config from the processor
instance: the instance attribute is diffusers' own per-model switch for
context parallelism, and a processor passes None where its keys are not
split (Wan's cross-attention over the whole text), which must stay a local
attention with no communication.

A routed processor is the same object with its class swapped for a
subclass whose ``__call__`` is the original's own code with
``dispatch_attention_fn`` bound to ``_attention.dispatch`` (the original
function for any other config), and its ``_parallel_config`` set to the
model's ``ContextParallel``. Nothing global changes: another model, or
this one unrouted, runs diffusers' code as before. A processor that would
reach diffusers' own attention with commlib's config anyway (through a
helper this does not rebind) fails there, loudly
(``ContextParallel.context_parallel_config``).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Dict

DISPATCH = "dispatch_attention_fn"

_routed: Dict[type, type] = {}


def routable(processor: Any) -> bool:
    """Whether this processor's ``__call__`` calls ``dispatch_attention_fn``
    itself and reads ``_parallel_config``."""
    call = next((vars(c)["__call__"] for c in type(processor).__mro__ if "__call__" in vars(c)),
                None)
    code = getattr(call, "__code__", None)
    return code is not None and DISPATCH in code.co_names and hasattr(processor, "_parallel_config")


def routed_class(cls: type, dispatch: Any) -> type:
    """``cls`` with its ``__call__``'s ``dispatch_attention_fn`` bound to
    ``dispatch(original)`` (made once per class)."""
    if cls not in _routed:
        call = cls.__call__
        names = dict(call.__globals__)
        names[DISPATCH] = dispatch(call.__globals__[DISPATCH])
        rebound = types.FunctionType(call.__code__, names, call.__name__, call.__defaults__,
                                     call.__closure__)
        rebound.__kwdefaults__ = call.__kwdefaults__
        functools.update_wrapper(rebound, call, updated=())
        _routed[cls] = type(cls.__name__, (cls,), {"__call__": rebound,
                                                   "__module__": cls.__module__,
                                                   "_commlib_unrouted": cls})
    return _routed[cls]


def route(processor: Any, config: Any, dispatch: Any) -> None:
    processor.__class__ = routed_class(type(processor), dispatch)
    processor._parallel_config = config


def unroute(processor: Any) -> None:
    processor.__class__ = processor._commlib_unrouted
    # the class attribute (None) shows again
    processor.__dict__.pop("_parallel_config", None)


def is_routed(processor: Any) -> bool:
    return "_commlib_unrouted" in vars(type(processor))
