"""commlib.graph_names: the names compiled graphs carry for communicators,
masks and kernels."""

import gc

import pytest

from commlib import graph_names
from commlib.kernels import TILED, Kernel
from commlib.sequence import masks


def _band(lo, hi):
    return masks.from_band((0, 32), lo, hi)


def test_equal_masks_share_a_name_and_another_mask_has_its_own():
    assert _band(0, 4).handle == _band(0, 4).handle
    assert _band(0, 4).handle != _band(0, 5).handle


def test_a_name_finds_an_equal_mask_while_any_lives():
    """The first of two equal masks freed: the name still finds the other."""
    first, second = _band(-3, 3), _band(-3, 3)
    name = first.handle
    del first
    gc.collect()
    assert graph_names.lookup(name) is second


def test_a_freed_object_is_named_in_the_error():
    kernel = Kernel(TILED.forward, TILED.backward, "mine")
    name = kernel.handle
    assert graph_names.lookup(name) is kernel and name != TILED.handle
    del kernel
    gc.collect()
    with pytest.raises(LookupError, match=f"the kernel named '{name}' no longer exists"):
        graph_names.lookup(name)
