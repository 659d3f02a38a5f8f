"""The ``commlib`` command line: in-process with click's CliRunner (a world of
one), the check logic on hand-made corrupted data, and one real launch of
``diag alltoall`` under mpiexec at 2 and 3 ranks."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from commlib.backends import cuda_aware, nccl
from commlib.moe import route
from commlib.tools import cli, relaunch
from commlib.tools.diag import alltoall
from commlib.tools.diag.alltoall import Progress
from commlib.tools.diag.blame import attribute_slow_links, slow_link_lines
from commlib.tools.diag.sweep import parse_dtype, parse_size
from commlib.tools.diag.table import RankTime, Row, bus_bandwidth
from commlib.tools.diag.traffic import (
    PATTERNS,
    Traffic,
    count_matrix,
    count_wrong,
    router_rows,
    send_buffer,
)
from commlib.tools.relaunch import MPI_ENV_VARS
from commlib.topology import Topology

import requires
from launch import run

LAUNCH_TIMEOUT_S = 60
QUICK = ["-n", "3", "-w", "1"]


def invoke(*args):
    return CliRunner().invoke(cli.main, list(args))


def table(output):
    """The data lines of a ``diag`` table, split into their columns."""
    return [line.split() for line in output.splitlines() if line.strip() and
            not line.startswith("#")]


# -- info ----------------------------------------------------------------------
def test_info_reports_mpi_world_topology_backends_and_frameworks():
    result = invoke("info")
    assert result.exit_code == 0, result.output
    out = result.output
    from mpi4py import MPI
    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    assert f"MPI library {library}" in out
    assert "world size  1" in out
    assert "1 node, 1 rank per node (from shared memory)" in out
    assert "mpi: available" in out
    reason = nccl.unavailable_reason()
    assert ("nccl: available" if reason is None else f"nccl: unavailable ({reason})") in out
    for framework in cli.FRAMEWORKS:
        assert framework in out.splitlines()[-1]


def cuda_aware_line(output):
    (line,) = [line for line in output.splitlines() if line.startswith("cuda-aware")]
    return line


def test_info_says_what_cuda_aware_detection_decided_and_why(monkeypatch):
    monkeypatch.delenv(cuda_aware.ENV, raising=False)
    result = invoke("info")
    assert result.exit_code == 0, result.output
    line = cuda_aware_line(result.output)
    support = cuda_aware.detect()
    decision = {True: "CUDA-aware: CUDA arrays over MPI go to it as device buffers",
                False: "not CUDA-aware: CUDA arrays over MPI are staged through host memory",
                None: "unknown, so not CUDA-aware"}[support.aware]
    assert decision in line and f"({support.reason})" in line, line


def test_info_on_the_mpich_wheel_says_its_query_answered_no(monkeypatch):
    monkeypatch.delenv(cuda_aware.ENV, raising=False)
    from mpi4py import MPI
    if not MPI.Get_library_version().startswith("MPICH"):
        pytest.skip("another MPI than the mpich wheel's answers otherwise (the wheel, built "
                    "without GPU support, answers 0)")
    line = cuda_aware_line(invoke("info").output)
    assert line.startswith("cuda-aware  not CUDA-aware: "), line
    assert "MPIX_Query_cuda_support() in " in line and "returned 0" in line, line


@pytest.mark.parametrize("value, decision", [
    ("1", "CUDA-aware: CUDA arrays over MPI go to it as device buffers"),
    ("0", "not CUDA-aware: CUDA arrays over MPI are staged through host memory"),
])
def test_info_names_the_environment_override_as_the_reason(monkeypatch, value, decision):
    monkeypatch.setenv(cuda_aware.ENV, value)
    line = cuda_aware_line(invoke("info").output)
    assert line == f"cuda-aware  {decision} ({cuda_aware.ENV}={value})"


def test_info_says_unknown_is_treated_as_not_cuda_aware(monkeypatch):
    monkeypatch.delenv(cuda_aware.ENV, raising=False)
    monkeypatch.setattr(cuda_aware, "_library_answer",
                        lambda: cuda_aware.Support(None, "the library said nothing"))
    line = cuda_aware_line(invoke("info").output)
    assert line == ("cuda-aware  unknown, so not CUDA-aware: CUDA arrays over MPI are staged "
                    "through host memory (the library said nothing)")


def test_info_reports_a_bad_override_instead_of_failing(monkeypatch):
    monkeypatch.setenv(cuda_aware.ENV, "maybe")
    result = invoke("info")
    assert result.exit_code == 0, result.output
    line = cuda_aware_line(result.output)
    assert line.startswith(f"cuda-aware  error: {cuda_aware.ENV}='maybe': use 1 "), line


def test_alltoall_prints_a_row_per_size_with_nccl_tests_columns():
    result = invoke("diag", "alltoall", "-b", "1K", "-e", "8K", *QUICK)
    assert result.exit_code == 0, result.output
    rows = table(result.output)
    assert [int(row[0]) for row in rows] == [1024, 2048, 4096, 8192]
    for size, count, dtype, avg, low, high, algbw, busbw, wrong in rows:
        assert int(count) == int(size) // 4 and dtype == "float32"
        assert float(low) <= float(avg) <= float(high)
        assert float(algbw) == pytest.approx(int(size) / float(avg) / 1e3, rel=0.02, abs=2e-3)
        assert float(busbw) == 0.0  # one rank sends nothing over any link
        assert wrong == "0"
    assert "# Avg bus bandwidth : 0.000" in result.output
    assert "1 rank, 1 node" in result.output


def test_alltoall_steps_by_the_factor_and_skips_the_check_when_asked():
    result = invoke("diag", "alltoall", "-b", "1K", "-e", "64K", "-f", "4", "-c", "0", *QUICK)
    assert result.exit_code == 0, result.output
    rows = table(result.output)
    assert [int(row[0]) for row in rows] == [1024, 4096, 16384, 65536]
    assert {row[-1] for row in rows} == {"N/A"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "int8", "uint16",
                                   "bool", "complex64", "float64"])
def test_alltoall_random_pattern_checks_clean_for_every_dtype(dtype):
    result = invoke("diag", "alltoall", "-e", "2K", "--dtype", dtype, "--pattern", "random",
                    *QUICK)
    assert result.exit_code == 0, result.output
    rows = table(result.output)
    assert [row[2] for row in rows] == [dtype, dtype]
    assert [row[-1] for row in rows] == ["0", "0"]


def test_alltoall_exits_nonzero_and_reports_wrong_elements(monkeypatch):
    def zeros(rank, send_counts, dtype):
        return np.zeros(int(np.sum(send_counts)), dtype=dtype)

    monkeypatch.setattr(alltoall, "send_buffer", zeros)
    result = invoke("diag", "alltoall", "-e", "2K", *QUICK)
    assert result.exit_code == 1
    assert all(int(row[-1]) > 0 for row in table(result.stdout))
    assert "element(s) arrived wrong" in result.stderr


def test_bus_bandwidth_is_nccl_tests_formula():
    assert bus_bandwidth(8.0, 1) == 0.0
    assert bus_bandwidth(8.0, 2) == 4.0
    assert bus_bandwidth(8.0, 4) == 6.0


# -- usage errors ----------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["-b", "1X"], "is not a size"),
    (["-e", "12KB"], "is not a size"),
    (["-b", "0"], "is not a size"),
    (["-b", "2M", "-e", "1M"], "larger than --maxbytes"),
    (["--pattern", "pareto"], "pareto"),
    (["--pattern", "router", "--experts", "4", "--topk", "5"], "at most --experts"),
    (["--plot", "out.png"], "pip install matplotlib"),
    (["--dtype", "float33"], "not a numeric element type"),
    (["--dtype", "U8"], "not a numeric element type"),
    (["-f", "1"], "stepfactor"),
])
def test_alltoall_usage_errors_exit_2_with_a_reason(args, message):
    if "--plot" in args and importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed, so --plot is no usage error")
    result = invoke("diag", "alltoall", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_router_experts_must_divide_over_the_world(monkeypatch):
    monkeypatch.setattr(alltoall, "_world_size", lambda: 4)
    result = invoke("diag", "alltoall", "--pattern", "router", "--experts", "6")
    assert result.exit_code == 2, result.output
    assert "6 experts do not divide over 4 ranks" in result.output


@pytest.mark.parametrize("text, size", [("100", 100), ("1K", 1024), ("64k", 65536),
                                        ("2M", 2 * 1024 ** 2), ("1G", 1024 ** 3)])
def test_parse_size_takes_powers_of_1024(text, size):
    assert parse_size(text) == size


# -- the check ----------------------------------------------------------------
def exchange(matrix, dtype):
    """What every rank receives from a correct all-to-all, done in NumPy."""
    nranks = len(matrix)
    sends = [np.split(send_buffer(r, matrix[r], dtype), np.cumsum(matrix[r])[:-1])
             for r in range(nranks)]
    return [np.concatenate([sends[s][r] for s in range(nranks)]) for r in range(nranks)]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", [np.dtype("float32"), parse_dtype("bfloat16")])
def test_count_wrong_is_zero_on_correct_data(pattern, dtype):
    traffic = Traffic(pattern, seed=1, experts=6, topk=2)  # 6 experts over 3 ranks
    matrix = count_matrix(pattern, 300, 3, seed=1, traffic=traffic)
    for rank, received in enumerate(exchange(matrix, dtype)):
        assert count_wrong(received, rank, matrix[:, rank]) == 0


def test_count_wrong_counts_corrupted_elements():
    dtype = np.dtype("float32")
    matrix = count_matrix("uniform", 300, 3, seed=0)
    received = exchange(matrix, dtype)[1]
    recv_counts = matrix[:, 1]

    flipped = received.copy()
    flipped[[3, 150]] += 1
    assert count_wrong(flipped, 1, recv_counts) == 2

    nan = received.copy()
    nan[7] = np.nan
    assert count_wrong(nan, 1, recv_counts) == 1

    swapped = np.concatenate([received[100:200], received[:100], received[200:]])
    assert count_wrong(swapped, 1, recv_counts) > 150  # blocks of ranks 0 and 1 exchanged

    assert count_wrong(received[:-5], 1, recv_counts) == 5  # missing elements
    assert count_wrong(received, 0, recv_counts) > 250  # rank 1's data at rank 0


def test_count_matrix_splits_every_rank_total():
    uniform = count_matrix("uniform", 10, 3, seed=0)
    assert (uniform == 3).all()  # rounded down to a multiple of the world size
    random = count_matrix("random", 1000, 4, seed=7)
    assert (random.sum(axis=1) == 1000).all()
    assert (random == count_matrix("random", 1000, 4, seed=7)).all()
    assert (random != count_matrix("random", 1000, 4, seed=8)).any()


def test_zipf_shares_fall_with_the_rank_offset():
    matrix = count_matrix("zipf", 100_000, 4, seed=3, traffic=Traffic("zipf", 3, skew=1.0))
    assert (matrix.sum(axis=1) == 100_000).all()
    for rank in range(4):
        by_offset = [matrix[rank, (rank + offset) % 4] for offset in range(4)]
        assert by_offset == sorted(by_offset, reverse=True)  # 1, 1/2, 1/3, 1/4 of the weight
    assert (matrix == count_matrix("zipf", 100_000, 4, seed=3,
                                       traffic=Traffic("zipf", 3, skew=1.0))).all()


@pytest.mark.parametrize("size", [1, 2, 5])
def test_hotspot_sends_half_to_rank_0_and_splits_the_rest(size):
    matrix = count_matrix("hotspot", 1001, size, seed=0)
    assert (matrix.sum(axis=1) == 1001).all()
    assert (matrix[:, 0] >= 1001 // 2).all()
    assert len(set(matrix[:, 1:].ravel())) <= 1  # the others evenly


@pytest.mark.parametrize("size, skew", [(2, 0.0), (4, 0.0), (4, 2.0)])
def test_router_counts_distinct_tokens_per_destination(size, skew):
    traffic = Traffic("router", seed=5, experts=16, topk=4, skew=skew)
    count = 4096
    matrix = count_matrix("router", count, size, seed=5, traffic=traffic)
    row = router_rows(count, size, traffic)
    for sender in range(size):
        experts, _ = route(sender_logits(sender, count, traffic), traffic.topk)
        expected = np.zeros(size, dtype=np.int64)
        for token_experts in np.asarray(experts):  # independent per-token loop
            for dest in {int(e) // (traffic.experts // size) for e in token_experts}:
                expected[dest] += row
        assert (matrix[sender] == expected).all()
        assert matrix[sender].sum() <= count
    assert (matrix == count_matrix("router", count, size, seed=5, traffic=traffic)).all()


def sender_logits(sender, count, traffic):
    """The router pattern's logits, rebuilt from its documented recipe."""
    ranking = np.random.default_rng([traffic.seed, count]).permutation(traffic.experts)
    rng = np.random.default_rng([traffic.seed, count, sender])
    bias = -traffic.skew * np.log1p(ranking)
    logits = rng.standard_normal((traffic.tokens, traffic.experts)) + bias
    return logits.astype(np.float32)


def test_router_skew_concentrates_traffic():
    flat = count_matrix("router", 1 << 16, 8, 0, Traffic("router", experts=64, topk=2))
    skewed = count_matrix("router", 1 << 16, 8, 0,
                              Traffic("router", experts=64, topk=2, skew=3.0))
    assert skewed.sum(axis=0).std() > flat.sum(axis=0).std()


# -- new outputs: JSON, patterns end to end, slow links, relaunch -------------------
def test_alltoall_json_has_a_row_per_size_with_busbw_and_wrong(tmp_path):
    path = tmp_path / "rows.json"
    result = invoke("diag", "alltoall", "-e", "4K", "--json", str(path), *QUICK)
    assert result.exit_code == 0, result.output
    rows = json.loads(path.read_text())
    assert [row["size_bytes"] for row in rows] == [1024, 2048, 4096]
    for row in rows:
        assert {"size_bytes", "count", "dtype", "time_us_avg", "time_us_min", "time_us_max",
                "time_us_p50", "time_us_p99", "algbw_gbps", "busbw_gbps", "wrong",
                "busiest_rank", "ranks"} <= set(row)
        assert row["time_us_min"] <= row["time_us_avg"] <= row["time_us_max"]
        assert row["time_us_min"] <= row["time_us_p50"] <= row["time_us_p99"] <= row["time_us_max"]
        assert row["busbw_gbps"] == bus_bandwidth(row["algbw_gbps"], 1)
        assert row["wrong"] == 0 and row["dtype"] == "float32"


def test_row_as_json_busbw_is_algbw_times_n_minus_1_over_n():
    row = Row(4096, 1024, "float32", 1e-5, 9e-6, 2e-5, 9.5e-6, 1.9e-5, 8.0,
                  bus_bandwidth(8.0, 4), None, 0, (RankTime(0, 4096, 2048, 8e-6),))
    record = row.as_json()
    assert record["busbw_gbps"] == pytest.approx(8.0 * 3 / 4)
    assert record["time_us_avg"] == pytest.approx(10.0) and record["wrong"] is None
    assert record["time_us_p50"] == pytest.approx(9.5)
    assert record["time_us_p99"] == pytest.approx(19.0)
    assert record["ranks"] == [{"rank": 0, "send_bytes": 4096, "recv_bytes": 2048,
                                "time_us_p50": pytest.approx(8.0),
                                "algbw_gbps": pytest.approx(4096 / 8e-6 / 1e9)}]


@pytest.mark.parametrize("pattern", ["zipf", "hotspot", "router"])
def test_new_patterns_check_clean_in_a_world_of_one(pattern):
    result = invoke("diag", "alltoall", "-e", "2K", "--pattern", pattern, *QUICK)
    assert result.exit_code == 0, result.output
    assert [row[-1] for row in table(result.output)] == ["0", "0"]
    assert f"pattern: {pattern}" in result.output


def test_slow_link_lines_star_the_slow_pair():
    times = np.array([[0, 1e-4, 2e-4], [1e-4, 0, 5e-4], [2e-4, 5e-4, 0]])
    lines = slow_link_lines(attribute_slow_links(times, Topology(0, (0, 0, 0))))
    body = [line.split() for line in lines if not line.startswith("#")]
    assert len(body) == 3 and all(len(cells) == 4 for cells in body)
    assert body[1][3] == "500.0*" and body[2][2] == "500.0*" and body[0][3] == "200.0"
    assert lines[-1] == ("# slow link: 1 <-> 2, 500.0 us, 3.3x slower than the median "
                         "healthy link inside a host")


def test_progress_line_appears_after_a_while_and_is_cleared(monkeypatch, capsys):
    quiet = Progress(3, enabled=True)
    quiet.show(1024)
    assert capsys.readouterr().err == ""  # a short sweep shows nothing
    monkeypatch.setattr(alltoall, "_PROGRESS_AFTER_S", 0.0)
    progress = Progress(3, enabled=True)
    progress.show(1024)
    progress.clear()
    assert capsys.readouterr().err == "\r[1/3] 1024 B ...\r\033[K"
    off = Progress(3, enabled=False)
    off.show(2048)
    off.clear()
    assert capsys.readouterr().err == ""


MPI_COMMANDS = [["info"], ["diag", "alltoall", "-e", "2K"], ["diag", "moe", "--tokens", "8"],
                ["diag", "ring", "--seq", "64"], ["diag", "ulysses", "--seq", "64"]]


def test_every_command_that_runs_under_mpi_has_np_and_simulate_has_none():
    def commands(group, path=()):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                yield from commands(command, (*path, name))
            else:
                yield (*path, name), command

    having = {path for path, command in commands(cli.main)
              if any(param.name == "nprocs" for param in command.params)}
    assert having == {tuple(argv[:2] if argv[0] == "diag" else argv[:1])
                      for argv in MPI_COMMANDS}
    assert "--np" not in invoke("simulate", "--help").output


@pytest.mark.parametrize("argv", MPI_COMMANDS, ids=lambda argv: " ".join(argv[:2]))
def test_np_relaunches_under_mpiexec_without_the_option(monkeypatch, argv):
    for name in MPI_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    given = [*argv[:2], "--np", "3", *argv[2:], "--np=3"]
    monkeypatch.setattr(sys, "argv", ["commlib", *given])
    launched = []
    monkeypatch.setattr(relaunch.subprocess, "run",
                        lambda command: launched.append(command) or
                        subprocess.CompletedProcess(command, 7))
    result = invoke(*given)
    assert result.exit_code == 7, result.output
    (command,) = launched
    assert command[1:3] == ["-n", "3"]
    assert command[3:] == [sys.executable, "-m", "commlib.tools.cli", *argv]


def test_np_is_ignored_under_mpi(monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "1")
    monkeypatch.setattr(relaunch.subprocess, "run",
                        lambda command: pytest.fail(f"relaunched {command}"))
    result = invoke("info", "--np", "3")
    assert result.exit_code == 0, result.output
    assert "world size  1" in result.output


# -- a real launch ------------------------------------------------------------------
@pytest.mark.parametrize("nprocs, ranks_per_node, topology", [
    (2, None, "from shared memory"),
    (3, "1", "3 nodes, 1 rank per node (emulated by COMMLIB_RANKS_PER_NODE)"),
    (4, "2", "2 nodes, 2 ranks per node (emulated by COMMLIB_RANKS_PER_NODE)"),
])
def test_alltoall_under_mpiexec(nprocs, ranks_per_node, topology):
    argv = [sys.executable, "-m", "commlib.tools.cli", "diag", "alltoall", "-e", "64K"]
    env = {"COMMLIB_RANKS_PER_NODE": ranks_per_node} if ranks_per_node else None
    try:
        result = run(nprocs, argv, timeout=LAUNCH_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"diag alltoall at {nprocs} ranks hung:\n{error.output}")
    assert result.returncode == 0, result.stdout
    assert f"# commlib diag alltoall: {nprocs} ranks" in result.stdout
    assert topology in result.stdout
    rows = table(result.stdout)
    elements = [(1024 << i) // 4 // nprocs * nprocs for i in range(7)]  # as nccl-tests rounds
    assert [int(row[1]) for row in rows] == elements
    assert [int(row[0]) for row in rows] == [4 * count for count in elements]
    assert [row[-1] for row in rows] == ["0"] * 7


def test_router_pattern_and_slow_links_under_mpiexec():
    argv = [sys.executable, "-m", "commlib.tools.cli", "diag", "alltoall", "-e", "8K",
            "--pattern", "router", "--experts", "8", "--topk", "2", "--slow-links", *QUICK]
    try:
        result = run(2, argv, timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"--slow-links at 2 ranks hung:\n{error.output}")
    assert result.returncode == 0, result.stdout
    rows = table(result.stdout)
    sizes, matrix = rows[:4], rows[4:]
    assert [row[-1] for row in sizes] == ["0"] * 4
    assert [cells[0] for cells in matrix] == ["0", "1"]
    assert matrix[0][1] == "-" and matrix[1][2] == "-"
    # one link is its own reference: never slow
    assert not matrix[0][2].endswith("*") and not matrix[1][1].endswith("*")
    assert "# no slow links: none takes over 2x the fastest link of its kind" in result.stdout


def test_plot_draws_busbw_against_size(tmp_path):
    requires.module("matplotlib")
    target = tmp_path / "busbw.png"
    result = CliRunner().invoke(cli.main, ["diag", "alltoall", "-e", "4K", "--plot", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moe_plot_draws_the_traffic_heatmap(tmp_path):
    requires.module("matplotlib")
    target = tmp_path / "traffic.png"
    result = CliRunner().invoke(cli.main, ["diag", "moe", "--tokens", "64", "--hidden", "16",
                                       "--experts", "8", "--topk", "2", "--iters", "1",
                                       "--plot", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(nccl.unavailable_reason() is None, reason="this machine can run NCCL")
def test_nccl_backend_without_a_gpu_is_a_usage_error():
    result = CliRunner().invoke(cli.main, ["diag", "alltoall", "-e", "4K", "--backend", "nccl"])
    assert result.exit_code == 2 and "backend='nccl' cannot run here" in result.output
