"""``diag ring`` and ``diag ulysses``: in-process with click's CliRunner (a
world of one) for the output, the JSON record and the usage errors, and one
launch of each under mpiexec at 2 ranks."""

import json
import sys

import click
import pytest
from click.testing import CliRunner

from commlib.tools.diag import attention as diag_attention

from launch import run

LAUNCH_TIMEOUT_S = 120
SMALL = ["--seq", "256", "--heads", "4", "--head-dim", "16", "--iters", "1"]


def invoke(command, *args):
    return CliRunner().invoke(command, list(args))


def data_rows(output):
    """The table lines (not '#'-prefixed), split into their columns."""
    return [line.split() for line in output.splitlines() if line.strip() and
            not line.startswith("#")]


# -- ring ----------------------------------------------------------------------
def test_ring_prints_one_row_per_step_totals_and_the_planner_pick():
    result = invoke(diag_attention.ring, *SMALL, "--causal")
    assert result.exit_code == 0, result.output
    rows = data_rows(result.output)
    assert len(rows) == 1  # one rank: one step, its own block
    step, source, compute, exposed = rows[0]
    assert (step, source) == ("0", "0") and float(compute) > 0 and float(exposed) >= 0
    assert "# ring: 131072 bytes per hop x 0 hops" in result.output  # K+V: 2*256*4*16*4
    assert "# ring_attention:" in result.output
    assert "# planner: Ulysses 1 x Ring 1" in result.output
    assert "# Picked Ulysses 1 x Ring 1" in result.output


def test_ring_json_holds_config_steps_totals_and_planner(tmp_path):
    path = tmp_path / "ring.json"
    result = invoke(diag_attention.ring, *SMALL, "--kv-heads", "2", "--layout", "contiguous",
                    "--json", str(path))
    assert result.exit_code == 0, result.output
    record = json.loads(path.read_text())
    assert record["config"] == {"world_size": 1, "seq": 256, "heads": 4, "kv_heads": 2,
                                "head_dim": 16, "dtype": "float32", "causal": False,
                                "iters": 1, "layout": "contiguous"}
    assert [set(row) for row in record["steps"]] == [
        {"step", "source", "compute_s", "exposed_comm_s"}]
    assert record["totals"]["hop_bytes"] == 2 * 256 * 2 * 16 * 4
    assert record["totals"]["effective_hop_gbps"] is None  # no hop to measure
    assert record["totals"]["ring_attention_s"] > 0
    assert {"ulysses_size", "ring_size", "predicted_seconds"} <= set(record["planner"])


@pytest.mark.parametrize("args, message", [
    (["--seq", "255", "--heads", "4"], "does not cut into 2 equal chunks"),
    (["--seq", "256", "--heads", "4", "--kv-heads", "3"], "3 kv heads do not divide 4"),
])
def test_ring_usage_errors_exit_2(args, message):
    result = invoke(diag_attention.ring, *args)
    assert result.exit_code == 2
    assert message in result.output


# -- ulysses -------------------------------------------------------------------
def test_ulysses_prints_relayout_rows_attention_time_and_planner_pick():
    result = invoke(diag_attention.ulysses, *SMALL, "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    rows = data_rows(result.output)
    assert [row[0] for row in rows] == ["seq_to_head", "head_to_seq"]
    for _, nbytes, seconds, rate in rows:
        assert nbytes == "0" and float(seconds) > 0 and rate == "n/a"  # nothing leaves
    assert "# q/k/v: seq_to_head_many" in result.output
    assert "# ulysses_attention:" in result.output
    assert "# planner: Ulysses 1 x Ring 1" in result.output


def test_ulysses_json_holds_relayout_numbers_and_planner(tmp_path):
    path = tmp_path / "ulysses.json"
    result = invoke(diag_attention.ulysses, *SMALL, "--causal", "--json", str(path))
    assert result.exit_code == 0, result.output
    record = json.loads(path.read_text())
    assert record["config"]["causal"] is True and record["config"]["world_size"] == 1
    relayout = record["relayout"]
    assert relayout["bytes_per_rank"] == 256 * 4 * 16 * 4
    assert {"seq_to_head_s", "head_to_seq_s", "qkv_many_s", "qkv_three_calls_s",
            "seq_to_head_gbps", "head_to_seq_gbps", "qkv_one_message"} <= set(relayout)
    assert record["totals"]["ulysses_attention_s"] > 0
    assert record["planner"]["ulysses_size"] * record["planner"]["ring_size"] == 1


def test_ulysses_needs_a_head_for_every_rank_and_splits_the_rest_unevenly():
    diag_attention.check_ulysses(diag_attention.Shape(256, 6, 6, 16, "float32", False, 1), 4)
    with pytest.raises(click.UsageError) as caught:
        diag_attention.check_ulysses(diag_attention.Shape(256, 3, 3, 16, "float32", False, 1),
                                     4)
    assert "use --heads 4 or more" in str(caught.value)


def test_ulysses_usage_error_exits_2():
    result = invoke(diag_attention.ulysses, "--heads", "4", "--kv-heads", "8")
    assert result.exit_code == 2
    assert "8 kv heads do not divide 4 query heads" in result.output


# -- two ranks under mpiexec ------------------------------------------------------
@pytest.mark.parametrize("command", ["ring", "ulysses"])
def test_two_ranks_run_and_print_the_planner_pick(command):
    argv = [sys.executable, "-m", "commlib.tools.diag.attention", command, *SMALL, "--causal"]
    result = run(2, argv, LAUNCH_TIMEOUT_S, env={"OPENBLAS_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout
    assert "# commlib diag " + command + ": 2 ranks" in result.stdout
    assert "# planner: Ulysses " in result.stdout
    assert result.stdout.count("# planner:") == 1  # rank 0 alone prints
    if command == "ring":
        assert [row[:2] for row in data_rows(result.stdout)] == [["0", "0"], ["1", "1"]]


def test_two_ranks_reject_fewer_heads_than_ranks_with_exit_2():
    argv = [sys.executable, "-m", "commlib.tools.diag.attention", "ulysses", "--seq", "256",
            "--heads", "1", "--head-dim", "16"]
    result = run(2, argv, LAUNCH_TIMEOUT_S)
    assert result.returncode == 2, result.stdout
    assert "every rank needs at least one head" in result.stdout
