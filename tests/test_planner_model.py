"""The whole-model plan of a hybrid model (commlib.hybrid.model_plan): the
recurrent layers' bytes as the core moves them (flat in the length, twice
for zigzag's two pieces), and the layout tipping from zigzag (balanced
causal attention) to contiguous (half the states to gather) as recurrent
layers outweigh attention ones."""

import math
from types import SimpleNamespace

import pytest

from commlib.hybrid.model_plan import RecurrentLayers, plan_model, price_recurrent
from commlib.hybrid.planner import Fabric
from commlib.topology import Topology

MIB = 2**20
# Qwen3-Next's Gated DeltaNet: 32 value heads of 128 x 128, q, k and v convolved
DELTANET = RecurrentLayers(count=36, heads=32, rows=128, cols=128, matrix=True,
                           channels=2 * 16 * 128 + 32 * 128)
MAMBA2 = RecurrentLayers(count=28, heads=64, rows=64, cols=128, matrix=False, channels=4352,
                         chunk=256)


# 12 attention layers of 2 heads (so a ring of at least 2: the layout matters to
# attention), a 200 MB/s link and a 1 TFLOP/s kernel, forward and backward
ATTENTION = dict(attention_layers=12, num_heads=2, num_kv_heads=2, head_dim=256, backward=True,
                 fabric=Fabric(1e-5, 2e8, 1e-5, 2e8, 1e12, 1e10))


def one_host(size):
    return SimpleNamespace(size=size, topology=Topology(0, (0,) * size))


@pytest.mark.parametrize("layout, pieces", [("contiguous", 1), ("zigzag", 2)])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_bytes_are_the_core_all_gathers_and_flat_in_the_length(layout, pieces, size):
    fabric = Fabric(0.0, 1e9, 0.0, 1e9, 1e12, math.inf)
    state = transition = 32 * 128 * 128 * 4
    halo = pieces * 3 * DELTANET.channels * 4
    forward = (size - 1) * (pieces * (transition + state) + halo)
    both = forward + (size - 1) * (pieces * (transition + 2 * state) + halo)
    for seq_len in (4096, 262144):
        cost = price_recurrent(size, seq_len, DELTANET, fabric, layout=layout, itemsize=4)
        assert cost.bytes == forward
        trained = price_recurrent(size, seq_len, DELTANET, fabric, layout=layout, itemsize=4,
                                  backward=True)
        assert trained.bytes == both
        assert trained.comm_s == pytest.approx(both / 1e9)  # free latency: bytes / rate


def test_at_two_ranks_zigzag_the_price_is_what_bench_recurrent_measured():
    """tools/bench/recurrent.py bytes, 2 ranks, zigzag, 32 x 128 x 128 and
    8192 channels in float32: 20.38 MiB received per rank a layer."""
    layers = RecurrentLayers(count=1, heads=32, rows=128, cols=128, matrix=True, channels=8192)
    cost = price_recurrent(2, 32768, layers, Fabric(0.0, 1e9, 0.0, 1e9, 1e12, math.inf),
                           layout="zigzag", itemsize=4, backward=True)
    assert round(cost.bytes / MIB, 2) == 20.38


def test_a_scalar_decay_moves_one_number_a_head_as_transition():
    fabric = Fabric(0.0, 1e9, 0.0, 1e9, 1e12, math.inf)
    cost = price_recurrent(2, 8192, MAMBA2, fabric, layout="contiguous", itemsize=2)
    assert cost.bytes == 64 * 4 + 64 * 64 * 128 * 4 + 3 * 4352 * 2


def test_the_layout_tips_to_contiguous_when_recurrent_states_outweigh_attention():
    """Fast compute and a slow link: with no recurrent layers zigzag's
    balanced causal attention wins; with 36 Gated DeltaNet layers, zigzag's
    second piece doubles the states gathered, and contiguous wins."""
    plain = plan_model(one_host(4), 8192, **ATTENTION)
    hybrid = plan_model(one_host(4), 8192, recurrent=DELTANET, **ATTENTION)
    assert plain.layout == "zigzag" and hybrid.layout == "contiguous"
    plain_priced, priced = dict(plain.priced), dict(hybrid.priced)
    assert plain_priced["zigzag"] < plain_priced["contiguous"]
    assert hybrid.predicted_seconds == priced["contiguous"] < priced["zigzag"]
    assert "contiguous" in hybrid.explain() and "36 recurrent layers" in hybrid.explain()


def test_long_sequences_tip_back_to_zigzag():
    """The states do not grow with the length; causal attention's imbalance
    does, quadratically: at 256K tokens zigzag wins again."""
    picked = plan_model(one_host(4), 262144, recurrent=DELTANET, **ATTENTION)
    priced = dict(picked.priced)
    assert picked.layout == "zigzag" and priced["zigzag"] < priced["contiguous"]


def test_layouts_it_cannot_price_are_refused():
    with pytest.raises(ValueError, match="contiguous and zigzag"):
        price_recurrent(2, 64, DELTANET, Fabric(0.0, 1e9, 0.0, 1e9, 1e12, math.inf),
                        layout="balanced")


# DeepSeek-V3's attention: 128 heads of 192 (the planner prices V at K's size), latent 512 + 64
DEEPSEEK = dict(attention_layers=61, num_heads=128, num_kv_heads=128, head_dim=192)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_latent_ring_is_priced_by_the_latent_it_moves(size):
    """Multi-head latent attention: the pure ring moves r + d_rope values a
    token, not 2 h d; its expansion is priced as compute; a split with
    Ulysses moves heads, expanded, as before."""
    fabric = Fabric(1e-5, 2e8, 1e-5, 2e8, 1e12, 1e10)
    from commlib.hybrid.planner import price
    args = (size, 1, 4096 * size, 128, 128, 192, 2, fabric)
    expanded = price(*args, causal=True, layout="zigzag")
    latent = price(*args, causal=True, layout="zigzag", latent_width=576)
    assert expanded.ring_bytes / latent.ring_bytes == pytest.approx(2 * 128 * 192 / 576)
    assert latent.compute_s > expanded.compute_s and latent.ring_s < expanded.ring_s
    if size % 2 == 0:
        split = (size, 2, 4096 * size, 128, 128, 192, 2, fabric)
        assert price(*split, causal=True, layout="zigzag", latent_width=576).ring_bytes == \
            price(*split, causal=True, layout="zigzag").ring_bytes


def test_plan_model_picks_the_latent_ring_over_a_slow_link():
    """On a 200 MB/s link the latent's 71x fewer bytes make the pure ring
    the pick, where expanded heads would take Ulysses."""
    plan = plan_model(one_host(4), 16384, backward=True, latent_width=576,
                      fabric=Fabric(1e-5, 2e8, 1e-5, 2e8, 1e12, 1e10), **DEEPSEEK)
    assert plan.plan.ulysses_size == 1 and plan.plan.ring_size == 4
