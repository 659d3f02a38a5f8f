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

While a routed processor runs, ``called_with()`` gives its arguments by
name: the attention reads from them whether its keys are the processor's
``encoder_hidden_states`` (a cross-attention) or its own tokens, which the
shapes alone cannot tell where a text shard is as long as an image shard.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import types
from typing import Any, Dict, Mapping

DISPATCH = "dispatch_attention_fn"

_routed: Dict[type, type] = {}
_arguments: contextvars.ContextVar = contextvars.ContextVar("commlib_processor_arguments",
                                                           default=None)


def called_with() -> Mapping[str, Any]:
    """The arguments, by name, of the routed processor call now running
    (empty outside one)."""
    return _arguments.get() or {}


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
        signature = inspect.signature(call)

        def routed_call(self, *args, **kwargs):
            token = _arguments.set(signature.bind(self, *args, **kwargs).arguments)
            try:
                return rebound(self, *args, **kwargs)
            finally:
                _arguments.reset(token)
        functools.update_wrapper(routed_call, call, updated=())
        _routed[cls] = type(cls.__name__, (cls,), {"__call__": routed_call,
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
