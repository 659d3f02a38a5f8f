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


def _missing_causal_calls():
    """Every public function that takes ``causal``, called without it (and
    with everything else it requires): binding fails before the body."""
    from commlib import inference
    from commlib.hybrid import planner
    from commlib.sequence import common_masks, masks

    x = object()
    calls = {}
    for param in FUNCTIONS:
        function = _resolve(param.values[0])
        if "shard_sequence" not in function.__name__:
            calls[param.id] = (function, lambda f=function: f(
                *[x] * (len(_positional(f)) - 1), None, layout="zigzag"))
    positions = dict(q_positions=[0], k_positions=[0])
    calls.update({
        "decode_attention": (inference.decode_attention,
                             lambda: inference.decode_attention(x, x, x, None, **positions)),
        "chunk_attention": (inference.chunk_attention,
                            lambda: inference.chunk_attention(x, x, x, None, **positions)),
        "from_cu_seqlens": (masks.from_cu_seqlens, lambda: masks.from_cu_seqlens([0, 4])),
        "block_diagonal": (common_masks.block_diagonal,
                           lambda: common_masks.block_diagonal(8, 2)),
        "plan": (hybrid.plan, lambda: hybrid.plan(None, 8, 2, 1, 8, layout="zigzag")),
        "price": (planner.price, lambda: planner.price(2, 1, 8, 2, 1, 8, 2, None,
                                                       layout="zigzag")),
    })
    return calls


MISSING_CAUSAL = _missing_causal_calls()


@pytest.mark.parametrize("name", MISSING_CAUSAL)
def test_causal_is_required_and_keyword_only_everywhere(name):
    """True in some functions and False in others answered silently wrong
    for whoever assumed the other: no function has a default now."""
    function, call = MISSING_CAUSAL[name]
    causal = inspect.signature(function).parameters["causal"]
    assert causal.kind is causal.KEYWORD_ONLY and causal.default is causal.empty
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'causal'"):
        call()


def test_the_planner_requires_a_layout():
    """A contiguous causal ring is priced 1.5x a zigzag one at 2 ranks: the
    planner must be told which it prices."""
    from commlib.hybrid import planner

    with pytest.raises(TypeError, match="'layout'"):
        hybrid.plan(None, 8, 2, 1, 8, causal=True)
    with pytest.raises(TypeError, match="'layout'"):
        planner.price(2, 1, 8, 2, 1, 8, 2, None, causal=True)


def test_the_tiled_kernel_needs_causal_by_position():
    """The Kernel contract calls forward(q, k, v, causal, scale)
    positionally, so the tiled kernel keeps it positional, without default."""
    for function in (ring.attention_forward, ring.attention_backward):
        causal = inspect.signature(function).parameters["causal"]
        assert causal.kind is causal.POSITIONAL_OR_KEYWORD and causal.default is causal.empty
    with pytest.raises(TypeError, match="'causal'"):
        ring.attention_forward(object(), object(), object())
