"""The slot layout's rule (``commlib.moe.lowlatency.places``), which the
low-latency path and the JAX Dispatcher share, against a per-choice loop:
in every framework, JAX under ``jit`` too, ids outside [0, E) included (their
places are masked by the callers, so only the counts must ignore them)."""

import numpy as np
import pytest

from commlib.moe.lowlatency import places
from commlib.namespace import sort_permutation

import arrayimpl
import requires


def _expected(ids: np.ndarray, experts: int):
    place = np.array([np.sum(ids[:i] == ids[i]) for i in range(ids.size)], np.int64)
    return place, np.array([np.sum(ids == e) for e in range(experts)], np.int64)


@pytest.mark.parametrize("impl", arrayimpl.params())
@pytest.mark.parametrize("choices,experts", [(0, 4), (1, 1), (7, 3), (64, 8)])
def test_places_are_each_choices_rank_among_its_experts_earlier_choices(impl, choices,
                                                                        experts):
    rng = np.random.default_rng([choices, experts])
    for _ in range(8):  # one shape: JAX compiles once
        ids = rng.integers(-3, experts + 3, choices)
        place, wanted = places(impl.asarray(ids, "int32"),
                               impl.asarray(np.arange(experts), "int32"))
        expected_place, expected_wanted = _expected(ids, experts)
        named = (ids >= 0) & (ids < experts)
        assert np.array_equal(impl.to_numpy(place)[named], expected_place[named])
        assert np.array_equal(impl.to_numpy(wanted), expected_wanted)


@pytest.mark.parametrize("bound", [8, 2 ** 30])  # a packed key, and one too large to pack
def test_places_trace_under_jax_jit(bound):
    jax = requires.module("jax")
    jnp = jax.numpy
    ids = np.random.default_rng(5).integers(-2, 10, 40)
    order, inverse = jax.jit(lambda a: sort_permutation(a, bound))(jnp.asarray(ids, jnp.int32))
    clipped = np.clip(ids, -1, 8)  # the values outside [-1, bound) need no place of their own
    assert np.array_equal(clipped[np.asarray(order)], np.sort(clipped))
    assert np.array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(ids.size))
    place, wanted = jax.jit(places)(jnp.asarray(ids, jnp.int32), jnp.arange(8, dtype=jnp.int32))
    expected_place, expected_wanted = _expected(ids, 8)
    named = (ids >= 0) & (ids < 8)
    assert np.array_equal(np.asarray(place)[named], expected_place[named])
    assert np.array_equal(np.asarray(wanted), expected_wanted)
