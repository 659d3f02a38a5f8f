"""``diag alltoall`` as nccl-tests' alltoallv_perf: --matrix files good and
bad, --spread, --per-rank, and rates from the busiest rank and the slowest
time; in-process (a world of one) and under mpiexec at 2 and 3 ranks."""

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from commlib.tools import cli
from commlib.tools.diag import alltoall
from commlib.tools.diag.sweep import parse_dtype
from commlib.tools.diag.traffic import Traffic, count_matrix, read_matrix

from launch import run

LAUNCH_TIMEOUT_S = 60
QUICK = ["-n", "3", "-w", "1"]
FLOAT32 = np.dtype("float32")


def invoke(*args):
    return CliRunner().invoke(cli.main, ["diag", "alltoall", *args])


def launch(nprocs, *args):
    """``mpiexec -n nprocs commlib diag alltoall args``; a hang fails the test."""
    argv = [sys.executable, "-m", "commlib.tools.cli", "diag", "alltoall", *args]
    try:
        return run(nprocs, argv, timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"diag alltoall {' '.join(args)} at {nprocs} ranks hung:\n{error.output}")


def write(tmp_path, text):
    path = tmp_path / "matrix.txt"
    path.write_text(text)
    return str(path)


def lines_of(output, width):
    """The output's data lines (not '#') of ``width`` columns: 9 for the
    size table, 5 for the per-rank one."""
    rows = [line.split() for line in output.splitlines()
            if line.strip() and not line.startswith("#")]
    return [row for row in rows if len(row) == width]


# -- reading the matrix ------------------------------------------------------------
def test_read_matrix_takes_commas_whitespace_blank_lines_and_comments(tmp_path):
    path = write(tmp_path, "# bytes rank i sends to rank j\n"
                           "0, 4096,  8\n"
                           "\n"
                           "  16\t0 ,32   # rank 1 sends nothing to itself\n"
                           "4,4,0,\n")
    matrix = read_matrix(path, 3, FLOAT32)
    assert matrix.dtype == np.int64
    assert matrix.tolist() == [[0, 4096, 8], [16, 0, 32], [4, 4, 0]]


@pytest.mark.parametrize("text, world, extra, message", [
    ("4 4\n4\n", 2, [], "not square: line 2 has 1 value and there are 2 rows"),
    ("4 4 4\n4 4 4\n", 2, [], "not square: line 1 has 3 values"),
    ("4 4\n4 4\n", 3, [], "2 rows for 3 ranks"),
    ("4 4 4\n4 4 4\n4 4 4\n", 2, [], "3 rows for 2 ranks"),
    ("4 -8\n4 4\n", 2, [], "line 1: -8 bytes is negative"),
    ("4 4\n4 four\n", 2, [], "line 2: 'four' is not a number"),
    ("4 4\n4 4.5\n", 2, [], "'4.5' is not a number"),
    ("# nothing but a comment\n\n", 2, [], "empty"),
    ("", 1, [], "empty"),
    ("4 6\n4 4\n", 2, [], "6 bytes is not a whole number of float32 elements (4 bytes each)"),
    ("2 3\n2 2\n", 2, ["--dtype", "bfloat16"], "3 bytes is not a whole number of bfloat16"),
    ("0 0\n0 0\n", 2, [], "sends no bytes"),
    ("4096\n", 1, ["-b", "1K", "-e", "2K"], "-b (1024 bytes) differs from -e (2048 bytes)"),
    ("4096\n", 1, ["-e", "4K"], "differs from -e"),
    ("4096\n", 1, ["-b", "1K", "-e", "1K"], "1024 bytes is less than the 4096"),
    ("4096\n", 1, ["--pattern", "random"], "drop --pattern and --spread"),
    ("4096\n", 1, ["--spread", "0.5"], "drop --pattern and --spread"),
])
def test_bad_matrix_runs_exit_2_with_the_reason(tmp_path, monkeypatch, text, world, extra,
                                                message):
    monkeypatch.setattr(alltoall, "_world_size", lambda: world)
    result = invoke("--matrix", write(tmp_path, text), *extra)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_missing_matrix_file_is_a_usage_error(tmp_path):
    result = invoke("--matrix", str(tmp_path / "absent.txt"))
    assert result.exit_code == 2 and "does not exist" in result.output


def test_a_bad_matrix_fails_on_every_rank_without_a_hang(tmp_path):
    result = launch(2, "--matrix", write(tmp_path, "0 4\n4 -4\n"))
    assert result.returncode == 2, result.stdout
    assert result.stdout.count("line 2: -4 bytes is negative") == 2  # once per rank


def test_matrix_in_a_world_of_one_is_one_row_of_its_bytes(tmp_path):
    result = invoke("--matrix", write(tmp_path, "# to myself\n1024,\n"), "--per-rank", *QUICK)
    assert result.exit_code == 0, result.output
    assert "minBytes 1024 maxBytes 1024" in result.output
    assert "pattern: matrix" in result.output
    (row,) = lines_of(result.output, 9)
    assert row[:3] == ["1024", "256", "float32"] and row[-1] == "0"
    (rank,) = lines_of(result.output, 5)
    assert rank[:3] == ["0", "1024", "1024"]
    assert float(rank[4]) == pytest.approx(1024 / float(rank[3]) / 1e3, rel=0.02, abs=2e-3)
    assert "# busiest rank: 0 (1024 B)" in result.output


def test_equal_b_and_e_at_or_above_the_busiest_rank_are_accepted(tmp_path):
    result = invoke("--matrix", write(tmp_path, "1024\n"), "-b", "4K", "-e", "4K", *QUICK)
    assert result.exit_code == 0, result.output
    assert "minBytes 4096 maxBytes 4096" in result.output
    assert [row[0] for row in lines_of(result.output, 9)] == ["1024"]  # the matrix's bytes


# -- spread --------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [10, 300, 1001])
def test_spread_0_is_the_uniform_split(size, count):
    matrix = count_matrix("uniform", count, size, 0, Traffic(spread=0.0))
    assert (matrix == count // size).all()


def test_spread_1_weights_each_peer_by_its_ring_distance():
    matrix = count_matrix("uniform", 6000, 4, 0, Traffic(spread=1.0))
    for rank in range(4):
        by_distance = [matrix[rank, (rank + d) % 4] for d in range(4)]
        assert by_distance == [0, 1000, 2000, 3000]  # 6000 * d / (1 + 2 + 3)
    assert (matrix.sum(axis=1) == 6000).all() and (matrix.sum(axis=0) == 6000).all()


def test_spread_between_blends_uniform_and_distance_linearly():
    matrix = count_matrix("uniform", 6000, 4, 0, Traffic(spread=0.5))
    assert [int(matrix[0, d]) for d in range(4)] == [750, 1250, 1750, 2250]
    assert (matrix.sum(axis=1) == 6000).all() and (matrix.sum(axis=0) == 6000).all()


def test_spread_0_on_the_command_line_changes_nothing():
    plain = invoke("-e", "4K", *QUICK)
    spread = invoke("-e", "4K", "--spread", "0", *QUICK)
    assert plain.exit_code == spread.exit_code == 0, spread.output
    assert ([row[:3] for row in lines_of(plain.output, 9)]
            == [row[:3] for row in lines_of(spread.output, 9)])
    assert "pattern: uniform\n" in spread.output


@pytest.mark.parametrize("pattern", ["random", "zipf", "hotspot", "router"])
def test_spread_with_another_pattern_is_a_usage_error(pattern):
    result = invoke("--pattern", pattern, "--spread", "0.5")
    assert result.exit_code == 2, result.output
    assert f"{pattern} splits the bytes its own way" in result.output


def test_spread_outside_0_to_1_is_a_usage_error():
    result = invoke("--spread", "1.5")
    assert result.exit_code == 2 and "0<=x<=1" in result.output


def test_spread_1_under_mpiexec_moves_the_distance_weighted_bytes_and_checks_clean():
    result = launch(3, "-b", "1K", "-e", "4K", "--spread", "1", "--per-rank", *QUICK)
    assert result.returncode == 0, result.stdout
    assert "pattern: uniform spread: 1" in result.stdout
    rows = lines_of(result.stdout, 9)
    counts = [(1024 << i) // 4 for i in range(3)]
    # each rank: nothing to itself, count/3 to the next, 2 count/3 to the one after
    busiest = [4 * ((count // 3) + (2 * count // 3)) for count in counts]
    assert [int(row[0]) for row in rows] == busiest
    assert [row[-1] for row in rows] == ["0"] * 3
    ranks = lines_of(result.stdout, 5)
    assert [[int(cell) for cell in rank[1:3]] for rank in ranks] == \
        [[size, size] for size in busiest for _ in range(3)]  # every rank the same


# -- a matrix under mpiexec ------------------------------------------------------------
MATRICES = {
    # rank 0 sends only to rank 1; rank 1 receives the most
    2: ("float32", "# 2 ranks\n0, 4096\n1024 2048  # rank 1 keeps 2 KiB\n"),
    # bfloat16 (2-byte) entries, zero blocks, rank 2 receives the most
    3: ("bfloat16", "0 2 4000\n6 0 0\n100, 200, 300\n"),
}


@pytest.mark.parametrize("nprocs", sorted(MATRICES))
def test_matrix_under_mpiexec_checks_clean_and_rates_the_busiest_rank(tmp_path, nprocs):
    dtype, text = MATRICES[nprocs]
    matrix = np.array([[int(cell) for cell in line.split("#")[0].replace(",", " ").split()]
                       for line in text.splitlines() if line.split("#")[0].strip()])
    send, recv = matrix.sum(axis=1), matrix.sum(axis=0)
    busiest = int(np.argmax(np.maximum(send, recv)))
    size = int(max(send[busiest], recv[busiest]))
    itemsize = parse_dtype(dtype).itemsize
    out = tmp_path / "rows.json"
    result = launch(nprocs, "--matrix", write(tmp_path, text), "--dtype", dtype, "--per-rank",
                    "--json", str(out), *QUICK)
    assert result.returncode == 0, result.stdout
    assert f"{nprocs} ranks" in result.stdout and "pattern: matrix" in result.stdout

    (row,) = lines_of(result.stdout, 9)
    assert row[:3] == [str(size), str(size // itemsize), dtype]
    assert row[-1] == "0"  # every element arrived where the matrix sent it
    ranks = lines_of(result.stdout, 5)
    assert [[int(cell) for cell in rank[:3]] for rank in ranks] == \
        [[r, int(send[r]), int(recv[r])] for r in range(nprocs)]
    assert f"# busiest rank: {busiest} ({size} B)" in result.stdout

    (record,) = json.loads(out.read_text())
    assert record["size_bytes"] == size and record["busiest_rank"] == busiest
    assert record["wrong"] == 0
    assert record["algbw_gbps"] == pytest.approx(size / record["time_us_avg"] / 1e3)
    assert record["busbw_gbps"] == pytest.approx(record["algbw_gbps"] * (nprocs - 1) / nprocs)
    assert (record["time_us_min"] <= record["time_us_p50"] <= record["time_us_p99"]
            <= record["time_us_max"])
    assert [(r["rank"], r["send_bytes"], r["recv_bytes"]) for r in record["ranks"]] == \
        [(r, int(send[r]), int(recv[r])) for r in range(nprocs)]
    for rank in record["ranks"]:
        # the row's times are each iteration's slowest rank: never below a rank's own
        assert record["time_us_p50"] >= rank["time_us_p50"] * (1 - 1e-9)
        assert rank["algbw_gbps"] == pytest.approx(
            max(rank["send_bytes"], rank["recv_bytes"]) / rank["time_us_p50"] / 1e3)
