"""The attention API's call contract (issue 25): ``layout`` has no default
and is keyword-only on shard_sequence/unshard_sequence and on every
attention function, core and bindings, forward and backward; everything
after ``comm`` (after ``ulysses_size`` for the hybrid) is keyword-only. A
shard in one layout read as another is silently wrong attention, so the
layout must be named at every call. The calls below fail while binding
their arguments, before any collective: no communicator is needed."""

import importlib
import inspect

import pytest

from commlib import hybrid, ring, ulysses

import requires

requires.module("torch")
requires.module("jax")

CORE = [ring.shard_sequence, ring.unshard_sequence,
        ring.ring_attention, ring.ring_attention_backward,
        ulysses.ulysses_attention, ulysses.ulysses_attention_backward,
        hybrid.hybrid_attention, hybrid.hybrid_attention_backward]
BOUND = [(binding, name) for binding in ("torch", "jax")
         for name in ("ring_attention", "ulysses_attention", "hybrid_attention")]
FUNCTIONS = [pytest.param(f, id=f"{f.__module__}.{f.__name__}") for f in CORE] + \
    [pytest.param((binding, name), id=f"bindings.{binding}.{name}") for binding, name in BOUND]


def _resolve(function):
    if isinstance(function, tuple):
        binding, name = function
        return getattr(importlib.import_module(f"commlib.bindings.{binding}"), name)
    return function


def _positional(function):
    """The names that may be passed by position: the arrays, ``comm`` and,
    for the hybrid, ``ulysses_size``."""
    return [p.name for p in inspect.signature(function).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


@pytest.mark.parametrize("function", FUNCTIONS)
def test_everything_after_comm_is_keyword_only_and_layout_has_no_default(function):
    function = _resolve(function)
    positional = _positional(function)
    last = "ulysses_size" if "hybrid" in function.__name__ else "comm"
    layout = inspect.signature(function).parameters["layout"]
    assert positional[-1] == last, positional
    assert layout.kind is layout.KEYWORD_ONLY and layout.default is layout.empty


@pytest.mark.parametrize("function", FUNCTIONS)
def test_a_missing_or_positional_layout_raises_type_error(function):
    function = _resolve(function)
    arrays = [object()] * (len(_positional(function)) - 1)  # never read: binding fails first
    with pytest.raises(TypeError, match="layout"):
        function(*arrays, None)
    with pytest.raises(TypeError, match="positional"):
        function(*arrays, None, "zigzag")
    with pytest.raises(TypeError, match="positional"):  # causal by position, the old form
        function(*arrays, None, True, layout="zigzag")
