"""``simulate`` in-process (CliRunner), ``diag moe`` in a world of one and
under mpiexec at 2 and 4 ranks on emulated nodes, and the requirement that
ties them: simulate predicts the inter-node bytes diag moe measures; diag
moe's skewed routings (--zipf, --load-matrix) and --placement rebalance."""

import json
import math
import sys

import click
import numpy as np
import pytest
from click.testing import CliRunner

from commlib.moe import quantize
from commlib.tools import simulate
from commlib.tools.diag import moe as diag_moe
from commlib.topology import Topology

from launch import run

LAUNCH_TIMEOUT_S = 120
SMALL = ["--experts", "16", "--topk", "4", "--tokens", "256", "--hidden", "64",
         "--dtype", "float32", "--seed", "3"]
SCHEMES = ("flat", "node_limited", "two_hop")


def invoke(command, *args):
    return CliRunner().invoke(command, list(args))


def simulate_json(tmp_path, *args):
    path = tmp_path / "simulate.json"
    result = invoke(simulate.simulate, *args, "--json", str(path))
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text())


# -- simulate ----------------------------------------------------------------
def test_simulate_json_has_the_chosen_scheme_and_all_three(tmp_path):
    doc = simulate_json(tmp_path, "--nodes", "2", "--gpus-per-node", "2", *SMALL)
    assert doc["scheme"] == "flat"
    for scheme in (doc, *(doc[name] for name in SCHEMES)):
        assert set(scheme) >= {"inter_node_bytes", "intra_node_bytes", "per_gpu",
                               "predicted_seconds"}
        assert len(scheme["per_gpu"]["inter_node_bytes"]) == 4
        assert sum(scheme["per_gpu"]["inter_node_bytes"]) == scheme["inter_node_bytes"]
    assert doc["inter_node_bytes"] == doc["flat"]["inter_node_bytes"]
    assert doc["config"]["node_limited_topk_groups"] == 1  # 4 experts fit in one node of 8


def test_node_limits_and_two_hops_each_cut_inter_node_bytes(tmp_path):
    doc = simulate_json(tmp_path, "--nodes", "4", "--gpus-per-node", "2", "--experts", "32",
                        "--topk", "8", "--topk-groups", "2", "--hierarchical", "--tokens", "256",
                        "--hidden", "64")
    flat, limited, two_hop = (doc[name]["inter_node_bytes"] for name in SCHEMES)
    assert flat > limited > two_hop > 0
    assert doc["scheme"] == "two_hop" and doc["inter_node_bytes"] == two_hop
    # node-limited two-hop: a token crosses to at most 2 nodes, one row each
    assert two_hop <= 256 * 8 * 2 * 64 * 2
    assert doc["two_hop"]["predicted_seconds"] < doc["flat"]["predicted_seconds"]


def test_time_model_is_the_slowest_gpu_over_both_links(tmp_path):
    doc = simulate_json(tmp_path, "--nodes", "2", "--gpus-per-node", "2", *SMALL,
                        "--intra-bw", "100", "--inter-bw", "10")
    per_gpu = doc["per_gpu"]
    expected = max(inter / 10e9 + intra / 100e9 for inter, intra in
                   zip(per_gpu["inter_node_bytes"], per_gpu["intra_node_bytes"]))
    assert doc["predicted_seconds"] == pytest.approx(expected)


def test_one_node_sends_nothing_between_nodes(tmp_path):
    doc = simulate_json(tmp_path, "--nodes", "1", "--gpus-per-node", "4", *SMALL)
    assert all(doc[name]["inter_node_bytes"] == 0 for name in SCHEMES)
    assert doc["intra_node_bytes"] > 0


def test_skew_concentrates_load_on_low_experts():
    experts, _ = simulate.synthetic_routing(0, 512, 16, 2, 2.0, 0)
    load = np.bincount(experts.ravel(), minlength=16)
    assert load[:4].sum() > load[-4:].sum() * 4


@pytest.mark.parametrize("args, hint", [
    (["--nodes", "2", "--gpus-per-node", "3", "--experts", "16"], "--experts"),
    (["--nodes", "2", "--gpus-per-node", "2", "--experts", "16", "--topk", "17"], "--topk"),
    (["--nodes", "2", "--gpus-per-node", "2", "--experts", "16", "--topk-groups", "3"],
     "--topk-groups"),
    (["--nodes", "2", "--gpus-per-node", "2", "--experts", "16", "--topk", "12",
      "--topk-groups", "1"], "--topk-groups"),
])
def test_simulate_usage_errors_exit_2(args, hint):
    result = invoke(simulate.simulate, *args)
    assert result.exit_code == 2
    assert hint in result.output


# -- diag moe in a world of one ---------------------------------------------------
def test_diag_moe_in_one_rank_reports_and_writes_json(tmp_path):
    path = tmp_path / "moe.json"
    result = invoke(diag_moe.moe, *SMALL, "--iters", "2", "--capacity-factor", "1.0",
                    "--skew", "1", "--json", str(path))
    assert result.exit_code == 0, result.output
    doc = json.loads(path.read_text())
    assert doc["inter_node_bytes"] == doc["intra_node_bytes"] == 0  # nothing leaves the rank
    assert doc["dropped"] > 0 and doc["imbalance"] > 1
    assert doc["tokens_per_s"] > 0
    assert "tokens/s" in result.output and "dropped" in result.output
    assert doc["quantize"] is None and doc["fixed_capacity"] is False
    assert doc["slots_per_expert"] is None and doc["payload_bytes_per_row"] == 4 * 64
    assert 0 < doc["time_us_p50"] <= doc["time_us_p99"]
    assert doc["time_us_p50"] == pytest.approx(doc["seconds_per_iter"] * 1e6)


def fp8_row_bytes(hidden):
    """An e4m3 byte per channel and a float32 scale per 128 channels."""
    return hidden + 4 * math.ceil(hidden / 128)


def diag_json(tmp_path, *args):
    path = tmp_path / "moe.json"
    result = invoke(diag_moe.moe, *SMALL, "--hidden", "200", "--iters", "2", *args,
                    "--json", str(path))
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text()), result.output


def low_latency(ranks: int, cap: list, row: int) -> bool:
    """Whether ``SMALL``'s fixed capacity takes the low-latency layout (no
    capacity factor, a block to each peer of at most 1 MiB: a row per
    (token, expert)) rather than the per-destination one (a row per
    (token, rank))."""
    from commlib.moe import lowlatency
    block = 16 // ranks * 256 * (row + lowlatency.FLAG)
    return not cap and block <= lowlatency.LOW_LATENCY_MOST_BYTES


@pytest.mark.parametrize("cap, slots", [([], 256), (["--capacity-factor", "1.0"], 64)])
@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_diag_moe_fp8_and_fixed_capacity_in_one_rank(tmp_path, fp8, cap, slots):
    """Against the counted, unquantized run of the same routing: the same
    load and drops per dispatch (a fixed capacity of --tokens overflows
    nothing; its stats, summed over the loop, come back per dispatch) and
    every routed token's row on the diagonal, at FP8's row size: once, or
    once per expert in the low-latency layout (FP8 without a capacity
    factor: the float32 rows are too large for it)."""
    counted, _ = diag_json(tmp_path, *cap)
    flags = ["--fixed-capacity"] + (["--fp8"] if fp8 else [])
    doc, out = diag_json(tmp_path, *flags, *cap)
    assert doc["fixed_capacity"] is True and doc["quantize"] == ("fp8" if fp8 else None)
    # P * per-source cap: --tokens without a capacity factor, else ceil(T*k/E*cf)
    assert doc["slots_per_expert"] == slots
    row = fp8_row_bytes(200) if fp8 else 4 * 200
    assert doc["payload_bytes_per_row"] == row
    rows = sum(counted["tokens_per_expert"]) if low_latency(1, cap, row) else \
        counted["traffic"][0][0] // (4 * 200)
    assert low_latency(1, cap, row) == (fp8 and not cap)
    assert doc["traffic"] == [[rows * row]]
    assert doc["tokens_per_expert"] == counted["tokens_per_expert"]
    assert doc["dropped"] == counted["dropped"] and doc["imbalance"] == counted["imbalance"]
    assert f"{slots} slots per local expert" in out and f"{row} B/row" in out
    assert ("fp8 (e4m3" in out) == fp8


def test_diag_moe_fp8_rows_are_the_formula_times_the_tokens(tmp_path):
    doc, out = diag_json(tmp_path, "--fp8")
    assert doc["quantize"] == "fp8" and doc["fixed_capacity"] is False
    assert doc["slots_per_expert"] is None
    # top-4 without a cap: every token travels once, to the one rank
    assert doc["traffic"] == [[256 * (200 + 4 * 2)]]
    assert doc["payload_bytes_per_row"] == 208 and "208 B/row" in out
    assert "dequantized to float32 for the experts" in out and "counted" in out


def test_every_dtype_choice_quantizes_to_fp8():
    """--fp8 refuses no --dtype: each choice is one FP8 quantizes from (were
    an integer type added, --fp8 would need a usage error for it)."""
    assert set(simulate.DTYPES) <= set(quantize.INPUT_DTYPES)


@pytest.mark.parametrize("args, hint", [
    (["--topk", "65"], "--topk"),
    (["--topk-groups", "2"], "--topk-groups"),
    (["--fixed-capacity", "--tokens", "0"], "--fixed-capacity"),
    (["--plot", "traffic.png"], "matplotlib"),
    (["--zipf", "1", "--skew", "1"], "--skew and --zipf are each a routing"),
    (["--zipf", "1", "--load-matrix", __file__], "--zipf and --load-matrix"),
    (["--redundant", "2"], "give --placement rebalance too"),
    (["--placement", "eplb"], "'eplb' is not one of 'none', 'rebalance'"),
    (["--load-matrix", "no-such-load.npy"], "'no-such-load.npy' does not exist"),
])
def test_diag_moe_usage_errors_exit_2(args, hint, monkeypatch):
    if hint == "matplotlib":
        monkeypatch.setattr(diag_moe.importlib.util, "find_spec", lambda name: None)
    result = invoke(diag_moe.moe, "--tokens", "16", "--hidden", "8", *args)
    assert result.exit_code == 2, result.output
    assert hint in result.output


# -- skewed routing and a placement, in a world of one --------------------------------
def test_popularity_routing_follows_the_popularity_and_never_draws_a_zero():
    popularity = simulate.zipf_popularity(16, 1.2, seed=0)
    assert sorted(popularity) == sorted(1 / np.arange(1, 17) ** 1.2)  # shuffled, not changed
    assert (popularity == simulate.zipf_popularity(16, 1.2, seed=0)).all()
    experts, weights = simulate.popularity_routing(0, 2048, popularity, 2, seed=0)
    load = np.bincount(experts.ravel(), minlength=16)
    assert load.argmax() == popularity.argmax() and load.argmin() == popularity.argmin()
    assert (experts[:, 0] != experts[:, 1]).all()
    np.testing.assert_allclose(weights.sum(1), 1, rtol=1e-6)
    popularity[:12] = 0
    experts, _ = simulate.popularity_routing(1, 2048, popularity, 4, seed=0)
    assert (np.bincount(experts.ravel(), minlength=16)[:12] == 0).all()


def test_diag_moe_rebalances_a_zipf_routing_in_one_rank(tmp_path):
    doc, out = diag_json(tmp_path, "--zipf", "1.2", "--placement", "rebalance")
    placed = doc["placement"]
    assert doc["config"]["zipf"] == 1.2 and "zipf 1.2 (shuffled by the seed)" in out
    assert doc["tokens_per_rank"] == [256 * 4] and doc["rank_imbalance"] == 1.0
    # one rank: one redundant expert by default, every slot on it
    assert placed["policy"] == "rebalance" and placed["packing"] == "global"
    assert placed["redundant"] == 1 and placed["slots_per_rank"] == 17
    assert sorted(set(placed["physical_to_logical"])) == list(range(16))
    assert placed["tokens_per_rank"] == [256 * 4] and sum(placed["tokens_per_slot"]) == 256 * 4
    assert placed["dropped"] == doc["dropped"] == 0 and placed["seconds_per_iter"] > 0
    assert "identity   rebalanced" in out and "tokens on rank 0" in out
    plain, out = diag_json(tmp_path, "--zipf", "1.2")
    assert plain["placement"] is None and "rebalanced" not in out
    assert plain["tokens_per_expert"] == doc["tokens_per_expert"]


def test_diag_moe_routes_by_a_saved_load(tmp_path):
    load = np.zeros(16)
    load[[2, 5, 11]] = [5.0, 1.0, 3.0]
    np.save(tmp_path / "load.npy", load)
    np.savetxt(tmp_path / "load.txt", load)
    docs = [diag_json(tmp_path, "--topk", "2", "--load-matrix", str(tmp_path / name))
            for name in ("load.npy", "load.txt")]
    assert docs[0][0]["tokens_per_expert"] == docs[1][0]["tokens_per_expert"]
    routed = np.asarray(docs[0][0]["tokens_per_expert"])
    assert np.flatnonzero(routed).tolist() == [2, 5, 11] and routed.sum() == 256 * 2
    assert f"load from {tmp_path / 'load.txt'}" in docs[1][1]


@pytest.mark.parametrize("content, message", [
    (np.ones(15), "it has shape (15,)"),
    (np.ones((2, 16)), "it has shape (2, 16)"),
    (-np.ones(16), "non-negative and not all 0"),
    (np.zeros(16), "non-negative and not all 0"),
    ("one two", "cannot read"),
])
def test_diag_moe_refuses_a_bad_load_file(tmp_path, content, message):
    path = tmp_path / "load.txt"
    if isinstance(content, str):
        path.write_text(content)
    else:
        np.savetxt(path, content)
    result = invoke(diag_moe.moe, *SMALL, "--load-matrix", str(path))
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--load-matrix'" in result.output and message in result.output


def test_a_placement_needs_equal_nodes():
    """3 ranks as nodes of 2 and 1 (63 experts, so the count is no objection)."""
    options = diag_moe.moe.make_context("moe", ["--experts", "63", "--placement",
                                                "rebalance"]).params
    settings = diag_moe.Settings(**{name: options[name] for name in
                                    diag_moe.Settings.__dataclass_fields__})
    with pytest.raises(click.BadParameter, match=r"these nodes have \[1, 2\]"):
        diag_moe.check_usage(settings, 3, Topology(0, (0, 0, 1), emulated=True))


# -- under mpiexec: measured against predicted ------------------------------------
def launch_diag(tmp_path, nprocs, ranks_per_node, *args):
    path = tmp_path / "moe.json"
    proc = run(nprocs, [sys.executable, "-m", "commlib.tools.diag.moe", *SMALL, "--iters", "2",
                        "--json", str(path), *args], LAUNCH_TIMEOUT_S,
               env={"COMMLIB_RANKS_PER_NODE": str(ranks_per_node)})
    assert proc.returncode == 0, proc.stdout
    return json.loads(path.read_text()), proc.stdout


@pytest.mark.quick_sample(2)  # flat at 2 ranks, two hops on 2 nodes x 2
@pytest.mark.parametrize("nprocs, ranks_per_node, args, scheme", [
    (2, 1, [], "flat"),
    (2, 1, ["--hierarchical"], "flat_two_hop"),
    (4, 2, ["--skew", "0.5"], "flat"),
    (4, 2, ["--topk-groups", "1", "--hierarchical"], "two_hop"),
])
def test_simulate_predicts_the_measured_bytes(tmp_path, nprocs, ranks_per_node, args, scheme):
    measured, out = launch_diag(tmp_path, nprocs, ranks_per_node, *args)
    assert {"tokens_per_s", "inter_node_bytes", "intra_node_bytes", "imbalance", "dropped",
            "config"} <= set(measured)
    assert measured["config"]["nodes"] == nprocs // ranks_per_node
    assert out.count("inter_node_bytes") == 1  # rank 0 alone prints
    predicted = simulate_json(tmp_path, "--nodes", str(nprocs // ranks_per_node),
                              "--gpus-per-node", str(ranks_per_node), *SMALL, *args)
    assert predicted["scheme"] == scheme
    assert measured["inter_node_bytes"] > 0
    assert predicted["inter_node_bytes"] == pytest.approx(measured["inter_node_bytes"], rel=0.1)
    # counting exactly as the Dispatcher sends, the match is exact
    assert predicted["inter_node_bytes"] == measured["inter_node_bytes"]
    assert predicted["intra_node_bytes"] == measured["intra_node_bytes"]


def test_diag_moe_usage_error_exits_2_on_every_rank(tmp_path):
    proc = run(2, [sys.executable, "-m", "commlib.tools.diag.moe", "--experts", "15",
                   "--tokens", "16", "--hidden", "8"], LAUNCH_TIMEOUT_S,
               env={"COMMLIB_RANKS_PER_NODE": "1"})
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.count("Invalid value for '--experts'") == 2


@pytest.mark.parametrize("layout", ["low-latency", "per-destination"])
def test_fp8_fixed_capacity_sends_the_counted_tokens_at_fp8_row_size(tmp_path, layout):
    """Two emulated nodes: the same seed's counted, unquantized run sends
    each (token, rank) copy as itemsize * H bytes; --fp8 --fixed-capacity
    sends each copy as H + 4 * ceil(H / 128) bytes: the same copies in the
    per-destination layout (H = 2000, rows too large for the other), one per
    (token, expert) in the low-latency layout (H = 200), each rank receiving
    a row per assignment of its experts."""
    width = 200 if layout == "low-latency" else 2000
    hidden = ["--hidden", str(width)]
    assert low_latency(2, [], fp8_row_bytes(width)) == (layout == "low-latency")
    counted, _ = launch_diag(tmp_path, 2, 1, *hidden)
    doc, out = launch_diag(tmp_path, 2, 1, *hidden, "--fp8", "--fixed-capacity")
    assert out.count("inter_node_bytes") == 1
    assert doc["quantize"] == "fp8" and doc["fixed_capacity"] is True
    assert doc["slots_per_expert"] == 2 * 256
    assert counted["inter_node_bytes"] > 0
    traffic = np.asarray(doc["traffic"])
    if layout == "per-destination":
        for key in ("inter_node_bytes", "intra_node_bytes"):
            assert doc[key] == counted[key] // (4 * width) * fp8_row_bytes(width)
        assert (traffic * 4 * width
                == np.asarray(counted["traffic"]) * fp8_row_bytes(width)).all()
    else:
        per_rank = np.asarray(counted["tokens_per_expert"]).reshape(2, -1).sum(axis=1)
        assert (traffic.sum(axis=0) == per_rank * fp8_row_bytes(width)).all()
        assert doc["inter_node_bytes"] == traffic.sum() - np.trace(traffic) > 0
    assert doc["tokens_per_expert"] == counted["tokens_per_expert"]
    assert doc["dropped"] == counted["dropped"] == 0


def test_rebalance_evens_out_a_zipf_routing_over_two_nodes(tmp_path):
    """Two emulated nodes, Zipf s=1.2, two redundant experts: the
    rebalanced placement carries every token the identity one did, its
    busiest rank lighter, as the rebalancer predicted from the measured
    load; rank 0 prints both columns."""
    doc, out = launch_diag(tmp_path, 2, 1, "--topk", "2", "--zipf", "1.2",
                           "--placement", "rebalance")
    placed = doc["placement"]
    assert placed["redundant"] == 2 and placed["slots_per_rank"] == 9
    assert sum(placed["tokens_per_rank"]) == sum(doc["tokens_per_rank"]) == 2 * 256 * 2
    assert doc["rank_imbalance"] > 1.1 and placed["rank_imbalance"] < doc["rank_imbalance"]
    assert placed["predicted_rank_imbalance"] < 1.05
    assert np.asarray(placed["tokens_per_slot"]).reshape(2, 9).sum(1).tolist() == \
        placed["tokens_per_rank"]
    assert out.count("identity   rebalanced") == 1 and "tokens on rank 1" in out
