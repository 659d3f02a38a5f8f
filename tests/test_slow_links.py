"""``diag alltoall --slow-links`` names the culprit: the attribution of slow
links to a host, a rank or a single link, on synthetic link-time matrices
(no MPI); the matrix and the verdict in --json; the parts inside and between
hosts; and one real slow host on the emulated cluster."""

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from commlib.tools import cli
from commlib.tools import cluster as emulated
from commlib.tools.diag.blame import (
    _MAX_LINKS_NAMED,
    LINK_BYTES,
    LINK_ITERS,
    SLOW_FACTOR,
    attribute_slow_links,
    slow_link_lines,
)
from commlib.topology import Topology

import requires
from launch import run

FAST, SLOW, SHM = 20e-3, 100e-3, 1e-3  # seconds: a link between hosts, a slow one, shared memory
LAUNCH_TIMEOUT_S = 60


def link_times(node_of_rank, slow_ranks=(), slow_nodes=(), slow_pairs=()):
    """Link times where shared memory takes SHM and the network FAST, but
    SLOW for every link of ``slow_ranks``, every link between hosts of
    ``slow_nodes``, and each pair of ``slow_pairs``."""
    size = len(node_of_rank)
    times = np.zeros((size, size))
    for i in range(size):
        for j in range(size):
            if i == j:
                continue
            inside = node_of_rank[i] == node_of_rank[j]
            slow = (i in slow_ranks or j in slow_ranks or (i, j) in slow_pairs
                    or (j, i) in slow_pairs
                    or (not inside and {node_of_rank[i], node_of_rank[j]} & set(slow_nodes)))
            times[i, j] = SLOW if slow else (SHM if inside else FAST)
    return times


def verdict(node_of_rank, **slow):
    topology = Topology(0, tuple(node_of_rank))
    return attribute_slow_links(link_times(node_of_rank, **slow), topology)


def named(links):
    return [(culprit.kind, culprit.ranks, culprit.node) for culprit in links.culprits]


# -- attribution --------------------------------------------------------------------
def test_a_slow_host_of_three_is_named_not_its_links():
    """Hosts 0, 1, 2 of one rank, host 1's link slow: 2 of the 3 links are
    slow, so a median reference would call them normal."""
    links = verdict([0, 1, 2], slow_nodes=[1])
    assert named(links) == [("host", (1,), 1)]
    assert links.culprits[0].ratio == pytest.approx(SLOW / FAST)
    assert links.slow.tolist() == [[False, True, False], [True, False, True],
                                   [False, True, False]]
    lines = slow_link_lines(links)
    assert lines[-1] == ("# slow host node1 (rank 1): its links to other hosts 5.0x slower "
                         "than the median healthy link between hosts")


def test_a_slow_host_of_two_ranks_is_named_with_both_and_not_as_ranks():
    links = verdict([0, 0, 1, 1, 2, 2], slow_nodes=[1])
    assert named(links) == [("host", (2, 3), 1)]  # its shared memory is fine: no slow rank
    assert "# slow host node1 (ranks 2, 3): its links" in slow_link_lines(links)[-1]


def test_two_slow_hosts_of_four_are_both_named():
    assert named(verdict([0, 1, 2, 3], slow_nodes=[1, 2])) == [("host", (1,), 1),
                                                               ("host", (2,), 2)]


def test_two_hosts_alone_cannot_tell_a_slow_host_from_a_slow_network():
    """Every link between two hosts touches both: all are equally slow, and
    the fastest of them is the reference."""
    links = verdict([0, 0, 1, 1], slow_nodes=[1])
    assert named(links) == [] and not links.slow.any()


def test_a_single_slow_pair_is_named_as_a_link():
    links = verdict([0, 1, 2], slow_pairs=[(0, 2)])
    assert named(links) == [("link", (0, 2), None)]
    assert slow_link_lines(links)[-1] == (
        "# slow link: 0 <-> 2, 100000.0 us, 5.0x slower than the median healthy link "
        "between hosts")


def test_a_slow_pair_inside_a_host_is_judged_against_shared_memory():
    links = verdict([0, 0, 0, 1, 1, 1], slow_pairs=[(0, 1)])
    assert named(links) == [("link", (0, 1), None)]
    assert slow_link_lines(links)[-1].endswith("inside a host")


@pytest.mark.parametrize("node_of_rank, rank", [([0, 0, 1, 1], 3), ([0, 0, 0], 2)])
def test_a_rank_whose_every_link_is_slow_is_named_not_its_host(node_of_rank, rank):
    links = verdict(node_of_rank, slow_ranks=[rank])
    node = node_of_rank[rank]
    assert named(links) == [("rank", (rank,), node)]
    assert slow_link_lines(links)[-1].startswith(
        f"# slow rank {rank} (on node{node}): its links ")


@pytest.mark.parametrize("node_of_rank", [[0, 1], [0, 1, 2], [0, 0, 1, 1], [0, 0, 0, 0]])
def test_nothing_slow_says_so(node_of_rank):
    links = verdict(node_of_rank)
    assert named(links) == [] and not links.slow.any()
    assert slow_link_lines(links)[-1] == (
        "# no slow links: none takes over 2x the fastest link of its kind")


def test_many_slow_links_are_named_up_to_a_few_and_counted():
    pairs = [(0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (1, 3), (4, 6)]
    links = verdict([0] * 8, slow_pairs=pairs)
    assert len(named(links)) == len(pairs)
    lines = slow_link_lines(links)
    assert sum(line.startswith("# slow link: ") for line in lines) == _MAX_LINKS_NAMED
    assert lines[-1] == "# ... and 2 more slow links (starred above)"


def test_noise_under_the_factor_is_not_slow():
    times = link_times([0, 1, 2])
    times[0, 2] = times[2, 0] = 1.9 * FAST
    assert named(attribute_slow_links(times, Topology(0, (0, 1, 2)))) == []


# -- JSON -----------------------------------------------------------------------------
def test_the_links_json_has_the_matrix_and_the_verdict():
    links = verdict([0, 1, 2], slow_nodes=[1])
    record = json.loads(json.dumps(links.as_json()))
    assert record["bytes"] == LINK_BYTES and record["iters"] == LINK_ITERS
    assert record["factor"] == SLOW_FACTOR and record["node_of_rank"] == [0, 1, 2]
    assert np.allclose(record["time_us"], link_times([0, 1, 2], slow_nodes=[1]) * 1e6)
    assert record["slow"] == links.slow.tolist()
    assert record["typical_us"] == {"inside": None, "between": pytest.approx(FAST * 1e6)}
    assert record["culprits"] == [{"kind": "host", "ranks": [1], "node": 1,
                                   "ratio": pytest.approx(SLOW / FAST)}]


def test_slow_links_json_is_an_object_of_rows_and_links(tmp_path):
    """In a world of one there are no links to judge, but the shape is the same."""
    path = tmp_path / "report.json"
    result = CliRunner().invoke(cli.main, ["diag", "alltoall", "-e", "2K", "-n", "2", "-w", "0",
                                           "--slow-links", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "# no links in a world of one" in result.output
    report = json.loads(path.read_text())
    assert [row["size_bytes"] for row in report["rows"]] == [1024, 2048]
    assert all(row["inside_hosts"] is None and row["between_hosts"] is None
               for row in report["rows"])  # one node: nothing sent apart
    assert report["links"]["time_us"] == [[0.0]] and report["links"]["culprits"] == []


# -- inside and between hosts -----------------------------------------------------------
def test_two_emulated_nodes_report_inside_and_between_hosts_apart(tmp_path):
    """Uniform at 4 ranks: each rank sends a quarter to each rank, so a
    quarter to its host's other rank and half to the other host."""
    path = tmp_path / "rows.json"
    argv = [sys.executable, "-m", "commlib.tools.cli", "diag", "alltoall", "-b", "4K", "-e", "8K",
            "-n", "2", "-w", "1", "--json", str(path)]
    try:
        result = run(4, argv, timeout=LAUNCH_TIMEOUT_S, env={"COMMLIB_RANKS_PER_NODE": "2"})
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"diag alltoall on 2 emulated nodes hung:\n{error.output}")
    assert result.returncode == 0, result.stdout
    assert "# inside hosts (each host's ranks among themselves) and between hosts" in \
        result.stdout
    parts = [line.split()[1:] for line in result.stdout.splitlines()
             if line.startswith("#") and line.split()[1:2] in (["4096"], ["8192"])]
    assert [[int(part[0]), int(part[1]), int(part[4])] for part in parts] == \
        [[4096, 1024, 2048], [8192, 2048, 4096]]
    for row in json.loads(path.read_text()):
        inside, between = row["inside_hosts"], row["between_hosts"]
        assert (inside["size_bytes"], between["size_bytes"]) == \
            (row["size_bytes"] // 4, row["size_bytes"] // 2)
        assert inside["wrong"] == 0 and between["wrong"] == 0
        assert [rank["send_bytes"] for rank in between["ranks"]] == [row["size_bytes"] // 2] * 4


# -- the emulated cluster ----------------------------------------------------------------
def test_a_slow_host_on_the_emulated_cluster_is_named(tmp_path):
    """3 hosts of one rank at 300 Mbit/s, host 1's link at 60: --slow-links
    names host 1 (node1), in the text and in the JSON."""
    reason = emulated.problem()
    if reason is not None:
        pytest.skip(requires.skip_reason(reason))
    path = tmp_path / "slow.json"
    argv = [sys.executable, "-m", "commlib.tools.cli", "diag", "alltoall", "-e", "2K", "-n", "2",
            "-w", "1", "--slow-links", "--json", str(path)]
    with emulated.Cluster(3, rate="300mbit", host_rates={1: "60mbit"}) as hosts:
        done = hosts.run(1, argv, env={"PYTHONWARNINGS": "ignore", "OPENBLAS_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# slow host node1 (rank 1): its links to other hosts" in done.stdout, done.stdout
    links = json.loads(path.read_text())["links"]
    assert [(c["kind"], c["node"]) for c in links["culprits"]] == [("host", 1)]
    assert links["culprits"][0]["ratio"] > 3  # 5x the rate, less the token bucket's burst
    assert links["slow"] == [[False, True, False], [True, False, True], [False, True, False]]


# -- simulate at the testbed's rates ------------------------------------------------------
def test_simulate_takes_the_testbed_rate_and_says_what_its_times_assume(tmp_path):
    """300 Mbit/s is 0.0375 GB/s; with one GPU per node every byte crosses."""
    from commlib.tools import simulate

    path = tmp_path / "prediction.json"
    result = CliRunner().invoke(simulate.simulate, [
        "--nodes", "3", "--gpus-per-node", "1", "--experts", "6", "--topk", "2", "--tokens",
        "256", "--hidden", "256", "--dtype", "float32", "--inter-bw", "0.0375", "--json",
        str(path)])
    assert result.exit_code == 0, result.output
    assert ("# time: the slowest GPU's inter-node bytes at 0.0375 GB/s plus its intra-node "
            "bytes at 160 GB/s") in result.output
    prediction = json.loads(path.read_text())
    assert prediction["config"]["inter_bw"] == 0.0375
    seconds = max(prediction["per_gpu"]["inter_node_bytes"]) / 0.0375e9
    assert prediction["predicted_seconds"] == pytest.approx(seconds)
    flat = [line.split() for line in result.output.splitlines() if line.startswith("  flat")]
    assert float(flat[0][-2]) == pytest.approx(seconds * 1e3, abs=1e-3)  # ms, then the mark
