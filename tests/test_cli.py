"""The ``commlib`` command line: in-process with click's CliRunner (a world of
one), the check logic on hand-made corrupted data, and one real launch of
``diag alltoall`` under mpiexec at 2 and 3 ranks."""

import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from commlib.backends import nccl
from commlib.tools import cli
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


# -- diag alltoall in a world of one ------------------------------------------
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

    monkeypatch.setattr(cli, "send_buffer", zeros)
    result = invoke("diag", "alltoall", "-e", "2K", *QUICK)
    assert result.exit_code == 1
    assert all(int(row[-1]) > 0 for row in table(result.stdout))
    assert "element(s) arrived wrong" in result.stderr


def test_bus_bandwidth_is_nccl_tests_formula():
    assert cli.bus_bandwidth(8.0, 1) == 0.0
    assert cli.bus_bandwidth(8.0, 2) == 4.0
    assert cli.bus_bandwidth(8.0, 4) == 6.0


# -- usage errors ----------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["-b", "1X"], "is not a size"),
    (["-e", "12KB"], "is not a size"),
    (["-b", "0"], "is not a size"),
    (["-b", "2M", "-e", "1M"], "larger than --maxbytes"),
    (["--pattern", "zipf"], "zipf"),
    (["--dtype", "float33"], "not a numeric element type"),
    (["--dtype", "U8"], "not a numeric element type"),
    (["-f", "1"], "stepfactor"),
])
def test_alltoall_usage_errors_exit_2_with_a_reason(args, message):
    result = invoke("diag", "alltoall", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.parametrize("text, size", [("100", 100), ("1K", 1024), ("64k", 65536),
                                        ("2M", 2 * 1024 ** 2), ("1G", 1024 ** 3)])
def test_parse_size_takes_powers_of_1024(text, size):
    assert cli.parse_size(text) == size


# -- the check ----------------------------------------------------------------
def exchange(matrix, dtype):
    """What every rank receives from a correct all-to-all, done in NumPy."""
    nranks = len(matrix)
    sends = [np.split(cli.send_buffer(r, matrix[r], dtype), np.cumsum(matrix[r])[:-1])
             for r in range(nranks)]
    return [np.concatenate([sends[s][r] for s in range(nranks)]) for r in range(nranks)]


@pytest.mark.parametrize("pattern", cli.PATTERNS)
@pytest.mark.parametrize("dtype", [np.dtype("float32"), cli.parse_dtype("bfloat16")])
def test_count_wrong_is_zero_on_correct_data(pattern, dtype):
    matrix = cli.count_matrix(pattern, 300, 3, seed=1)
    for rank, received in enumerate(exchange(matrix, dtype)):
        assert cli.count_wrong(received, rank, matrix[:, rank]) == 0


def test_count_wrong_counts_corrupted_elements():
    dtype = np.dtype("float32")
    matrix = cli.count_matrix("uniform", 300, 3, seed=0)
    received = exchange(matrix, dtype)[1]
    recv_counts = matrix[:, 1]

    flipped = received.copy()
    flipped[[3, 150]] += 1
    assert cli.count_wrong(flipped, 1, recv_counts) == 2

    nan = received.copy()
    nan[7] = np.nan
    assert cli.count_wrong(nan, 1, recv_counts) == 1

    swapped = np.concatenate([received[100:200], received[:100], received[200:]])
    assert cli.count_wrong(swapped, 1, recv_counts) > 150  # blocks of ranks 0 and 1 exchanged

    assert cli.count_wrong(received[:-5], 1, recv_counts) == 5  # missing elements
    assert cli.count_wrong(received, 0, recv_counts) > 250  # rank 1's data at rank 0


def test_count_matrix_splits_every_rank_total():
    uniform = cli.count_matrix("uniform", 10, 3, seed=0)
    assert (uniform == 3).all()  # rounded down to a multiple of the world size
    random = cli.count_matrix("random", 1000, 4, seed=7)
    assert (random.sum(axis=1) == 1000).all()
    assert (random == cli.count_matrix("random", 1000, 4, seed=7)).all()
    assert (random != cli.count_matrix("random", 1000, 4, seed=8)).any()


# -- a real launch ------------------------------------------------------------------
@pytest.mark.parametrize("nprocs, ranks_per_node, topology", [
    (2, None, "from shared memory"),
    (3, "1", "3 nodes, 1 rank per node (emulated by COMMLIB_RANKS_PER_NODE)"),
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
