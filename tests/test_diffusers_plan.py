"""The diffusers binding's pieces in one process: shards of any length and
their padding, the visibility mask (padding and a whole text's extra
copies hidden), plan keys resolved to submodules, the models that declare
a plan, processors routed per instance, the digests ranks agree on."""

import numpy as np
import pytest

import requires

torch = requires.module("torch")
diffusers = requires.module("diffusers")
cd = requires.module("commlib.bindings.diffusers")
from commlib.bindings.diffusers import _routing  # noqa: E402
from commlib.bindings.diffusers._fingerprints import tensor_digests  # noqa: E402
from commlib.bindings.diffusers._plan import modules_named  # noqa: E402
from commlib.bindings.diffusers._shards import Split  # noqa: E402
from commlib.bindings.diffusers._visibility import Segment, runs, visibility  # noqa: E402


@pytest.mark.parametrize("length,size", [(12, 4), (13, 4), (5, 3), (2, 3)])
def test_split_pads_every_shard_to_one_length(length, size):
    split = Split(length, size)
    x = torch.arange(length).reshape(1, length)
    shards = [split.shard(x, 1, r) for r in range(size)]
    assert all(s.shape[1] == split.padded for s in shards)
    assert sum(split.counts) == length and max(split.counts) - min(split.counts) <= 1
    whole = torch.cat(shards, dim=1).index_select(1, split.kept(x.device))
    assert torch.equal(whole, x)


def test_no_padding_no_mask():
    assert visibility([Segment(3, Split(6, 2)), Segment(4, Split(8, 2))], 2) is None


def test_padding_and_whole_text_copies_are_hidden():
    """2 ranks, [whole text of 2 | image shard of 3 (5 tokens: 3 + 2)]:
    every real query sees rank 0's text and the 5 image tokens, nothing
    else."""
    segments = [Segment(2), Segment(3, Split(5, 2))]
    dense = visibility(segments, 2).dense()
    keys = np.zeros(10, bool)
    keys[[0, 1, 2, 3, 4, 7, 8]] = True
    queries = np.ones(10, bool)
    queries[9] = False  # rank 1's padding
    assert np.array_equal(dense, np.outer(queries, keys))


def test_runs():
    assert runs(np.array([1, 1, 0, 1, 0, 0, 1], bool)) == [(0, 2), (3, 4), (6, 7)]


def test_plan_keys_name_submodules():
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    for block in model.blocks:
        block.attn = torch.nn.Linear(1, 1)
    assert modules_named(model, "") == [model]
    assert modules_named(model, "blocks.*.attn") == [b.attn for b in model.blocks]
    with pytest.raises(ValueError, match="has no submodule 'norm'"):
        modules_named(model, "blocks.0.norm")
    with pytest.raises(ValueError, match="ModuleList"):
        modules_named(model, "blocks.0.*")


def test_the_models_with_a_plan():
    """planned_models() lists what context_parallel takes; refused_models()
    those that declare a plan but are refused, with the reason."""
    planned, refused = cd.planned_models(), cd.refused_models()
    assert {"FluxTransformer2DModel", "QwenImageTransformer2DModel",
            "WanTransformer3DModel"} <= set(planned)
    assert "SD3Transformer2DModel" not in planned
    assert set(refused) == {"LTX2VideoTransformer3DModel", "MiniMaxH3Transformer3DModel"}
    assert not set(refused) & set(planned)
    assert all(getattr(diffusers, name)._cp_plan for name in refused)


def test_digests_see_bytes_not_layout():
    """Equal contents digest alike whatever their strides, offset or
    broadcast; one changed element, or two swapped, digest otherwise."""
    x = torch.randn(6, 5, dtype=torch.float64)
    same = [x, x.t().contiguous().t(), torch.cat([x.new_zeros(1, 5), x])[1:]]
    digests = tensor_digests(same + [torch.tensor(2.0).expand(1), torch.tensor([2.0])])
    assert len(set(digests[:3])) == 1 and digests[3] == digests[4]
    changed, swapped = x.clone(), x.clone()
    changed[3, 2] = changed[3, 2].nextafter(torch.tensor(1.0, dtype=torch.float64))
    swapped[0, 0], swapped[5, 4] = x[5, 4], x[0, 0]
    assert len({digests[0], *tensor_digests([changed, swapped])}) == 3
    half = torch.randn(7, dtype=torch.bfloat16)  # 14 bytes: digested byte by byte
    assert tensor_digests([half[1:]]) == tensor_digests([half[1:].clone()])


def test_a_routed_processor_leaves_its_class_alone():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    routed, other = FluxAttnProcessor(), FluxAttnProcessor()
    assert _routing.routable(routed)
    _routing.route(routed, object(), lambda original: original)
    assert isinstance(routed, FluxAttnProcessor) and _routing.is_routed(routed)
    assert not _routing.is_routed(other) and other._parallel_config is None
    _routing.unroute(routed)
    assert type(routed) is FluxAttnProcessor and routed._parallel_config is None
