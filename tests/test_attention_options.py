"""An attention call's options as one value (commlib.sequence.options):
frozen and hashable (JAX takes it as a static argument), carried by a torch
op as the schema its fields derive and restored equal, refused by the op
where a value cannot travel so (the core then refuses it on every rank),
and its own check of the cap."""

import dataclasses
import math

import pytest

from commlib.kernels import TILED
from commlib.sequence import common_masks
from commlib.sequence.options import AttentionOptions, graph_schema


def test_the_options_are_frozen_and_hashable():
    options = AttentionOptions(causal=True, window=(3, 0), cu_seqlens=(0, 5, 9), softcap=30.0,
                               kernel=TILED, mask=None, method="ring")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.softcap = 50.0
    assert hash(options) == hash(dataclasses.replace(options))
    assert options != dataclasses.replace(options, softcap=50.0)


def test_a_graph_carries_every_field_and_gives_back_equal_options():
    """One schema argument per field, in field order; names for the mask
    and the kernel, [left, right] for the window (-1: unbounded)."""
    mask = common_masks.prefix_lm(16, 4)
    options = AttentionOptions(causal=False, window=(3, None), cu_seqlens=[0, 5, 16],
                               mask=mask, softmax_scale=0.25, softcap=30, kernel=TILED,
                               method="sparse", wire="float8")
    values = options.graph_values()
    names = [f.name for f in dataclasses.fields(AttentionOptions)]
    assert [part.split()[1] for part in graph_schema().split(", ")] == names
    assert values == (False, [3, -1], [0, 5, 16], mask.handle, 0.25, 30.0, TILED.handle,
                      "sparse", "float8")
    restored = AttentionOptions.from_graph_values(*values)
    assert restored == dataclasses.replace(options, window=(3, -1), cu_seqlens=(0, 5, 16),
                                           softcap=30.0)
    assert restored.mask is mask and restored.kernel is TILED


@pytest.mark.parametrize("change", [dict(window=(1.5, 0)), dict(window=3), dict(softcap="50"),
                                    dict(cu_seqlens=[0, 2.5, 8]), dict(mask=[[True]]),
                                    dict(causal=1)])
def test_a_value_no_graph_can_carry_goes_to_the_core(change):
    assert AttentionOptions(**change).graph_values() is None


@pytest.mark.parametrize("cap", [0, -1.0, math.nan, math.inf, True, "50", [50.0]])
def test_a_cap_that_is_not_a_positive_finite_number_is_refused(cap):
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        AttentionOptions(softcap=cap).check()


@pytest.mark.parametrize("cap", [None, 50, 30.0, 1e-3])
def test_a_positive_finite_cap_or_none_passes(cap):
    AttentionOptions(softcap=cap).check()
