"""The emulated cluster (``commlib.tools.cluster``): real hosts that MPI
sees as nodes, traffic between them counted on the shaped links (and none
of the traffic inside a host), a clear refusal where it cannot run, and
nothing left behind."""

import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from commlib.tools import cluster as emulated
from commlib.tools.cli import main

import requires

SCRIPT = textwrap.dedent("""
    import socket, sys, time
    import numpy as np
    import commlib
    comm = commlib.init()
    size, out = int(sys.argv[1]), sys.argv[2]
    report = open(f"{out}/rank{comm.rank}.txt", "w")  # ranks' stdout lines can interleave
    print("node", comm.rank, socket.gethostname(), comm.topology.num_nodes,
          comm.topology.local_size, file=report, flush=True)
    same_host = [r for r in range(comm.size) if r != comm.rank
                 and comm.topology.node_of(r) == comm.topology.node_of(comm.rank)]
    comm.barrier()
    start = time.perf_counter()
    # each rank sends `size` bytes to every other rank: to the ones on its host
    # over shared memory, to the others over the link
    comm.alltoall(np.full((comm.size, size), comm.rank, np.uint8))
    comm.barrier()
    print("seconds", time.perf_counter() - start, file=report, flush=True)
""")


def needs_a_cluster():
    reason = emulated.problem()
    if reason:
        pytest.skip(requires.skip_reason(reason))


@pytest.mark.parametrize("text, bits", [("300mbit", 300e6), ("1gbit", 1e9), ("60 Mbit/s", 60e6),
                                        ("64kbit", 64e3), ("2.5mbit", 2.5e6)])
def test_rates_are_read_as_tc_writes_them(text, bits):
    assert emulated.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "300", "300mbps", "-1mbit", "1kbit", ""])
def test_a_bad_rate_is_refused_with_what_to_give(text):
    with pytest.raises(Exception, match="rate"):
        emulated.parse_rate(text)


def test_without_root_it_refuses_saying_why(monkeypatch):
    monkeypatch.setattr(emulated.os, "geteuid", lambda: 1000)
    assert "needs root" in emulated.problem()
    with pytest.raises(emulated.ClusterError, match="needs root"):
        emulated.Cluster(2).up()
    result = CliRunner().invoke(main, ["cluster", "run", "-n", "2", "true"])
    assert result.exit_code != 0 and "needs root" in result.output
    result = CliRunner().invoke(main, ["cluster", "check"])
    assert result.exit_code == 1 and "needs root" in result.output


@pytest.mark.parametrize("argv, message", [
    (["cluster", "run", "--hosts", "2", "-n", "3", "true"], "do not spread evenly"),
    (["cluster", "run", "-n", "2", "--host-rate", "fast", "true"], "HOST=RATE"),
    (["cluster", "run", "-n", "2", "--rate", "300", "true"], "not a link rate")])
def test_bad_arguments_are_refused_before_anything_is_made(argv, message):
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2 and message in result.output


def test_a_host_rate_for_a_host_that_does_not_exist_is_refused():
    with pytest.raises(emulated.ClusterError, match=r"hosts \[3\].*0\.\.1"):
        emulated.Cluster(2, host_rates={3: "60mbit"})


def test_two_hosts_are_two_nodes_and_their_traffic_crosses_the_links(tmp_path):
    """2 hosts x 2 ranks, links at 50 Mbit/s: MPI sees 2 nodes of 2 ranks
    with their own host names; every byte sent to the other host is counted
    on both links (and the bytes to the rank on the same host are not);
    the token bucket holds the transfer to its rate; nothing is left."""
    needs_a_cluster()
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    size = 2_000_000
    with emulated.Cluster(2, rate="50mbit") as hosts:
        names = list(hosts.names)
        before = hosts.link_bytes()
        done = hosts.run(2, [sys.executable, str(script), str(size), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
        after = hosts.link_bytes()
        assert done.returncode == 0, done.stdout + done.stderr
        shaped = subprocess.run(["ip", "netns", "exec", names[0], "tc", "qdisc", "show", "dev",
                                 emulated.INTERFACE], capture_output=True, text=True).stdout
    lines = [line.split() for rank in range(4)
             for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
    nodes = sorted(tuple(words[1:]) for words in lines if words[0] == "node")
    assert nodes == [("0", names[0], "2", "2"), ("1", names[0], "2", "2"),
                     ("2", names[1], "2", "2"), ("3", names[1], "2", "2")]
    # each host's 2 ranks send `size` bytes to each of the other host's 2 ranks
    crossing = 4 * size
    for (sent_before, received_before), (sent, received) in zip(before, after):
        assert crossing <= sent - sent_before < 1.2 * crossing
        assert crossing <= received - received_before < 1.2 * crossing
    # a lower bound only: 50 Mbit/s cannot carry 8 MB in less than 1.28 s
    # (less the bucket's burst), however fast the machine
    seconds = max(float(words[1]) for words in lines if words[0] == "seconds")
    assert seconds > 0.9 * crossing * 8 / 50e6
    assert "tbf" in shaped and "50Mbit" in shaped
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)


def test_the_command_line_runs_a_program_across_hosts_and_counts_the_links():
    needs_a_cluster()
    done = subprocess.run(
        [sys.executable, "-m", "commlib.tools.cluster", "run", "--hosts", "3", "-n", "3",
         "--host-rate", "2=20mbit", sys.executable, "-c",
         "import os, socket; os.write(1, socket.gethostname().encode() + b'\\n')"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(set(done.stdout.split())) == 3  # one write of one line each: whole, distinct
    assert "link bytes (sent/received): host 0" in done.stderr and "host 2" in done.stderr
    failed = subprocess.run([sys.executable, "-m", "commlib.tools.cluster", "run", "--hosts",
                             "2", "-n", "2", "--quiet", sys.executable, "-c",
                             "import sys; sys.exit(3)"], capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode != 0


def test_what_a_killed_launch_left_is_removed_by_the_next_one():
    """A cluster whose process died without ``down`` (killed outright) is
    swept; one whose process lives (this one's) is not."""
    needs_a_cluster()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale, live = f"cl{dead}h0", f"cl{emulated.os.getpid()}h9"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        emulated.sweep_stale()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in listed and live in listed
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
