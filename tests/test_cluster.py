"""The emulated cluster (``commlib.tools.cluster``): real hosts that MPI
sees as nodes, traffic between them counted on the shaped links (and none
of the traffic inside a host), a clear refusal where it cannot run, and
nothing left behind."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

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
    """A cluster or a probe (``problem()``'s namespace) whose process died
    without removing it (killed outright) is swept; one whose process lives
    (this one's) is not."""
    needs_a_cluster()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    me = os.getpid()
    stale = [f"cl{dead}h0", f"cl{dead}c3h0", f"cl{dead}c3br", f"commlib-probe-{dead}"]
    live = [f"cl{me}c99h9", f"commlib-probe-{me}"]
    for name in stale + live:
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        emulated.sweep_stale()
        listed = namespaces()
        assert not set(stale) & listed and set(live) <= listed
    finally:
        for name in stale + live:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def namespaces():
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def links():
    """The machine's own network interfaces, by name."""
    shown = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in shown.splitlines()}


def state_dirs():
    return {d for d in os.listdir(tempfile.gettempdir())
            if d.startswith(f"commlib-cluster-{os.getpid()}-")}


def test_two_clusters_in_one_process_have_names_of_their_own():
    """Each Cluster's names are its own: a second one in this process comes
    up beside the first, and its removal leaves the first as it was."""
    needs_a_cluster()
    with emulated.Cluster(1) as first:
        with emulated.Cluster(1) as second:
            assert not set(first.names) & set(second.names)
            assert set(first.names + second.names) <= namespaces()
        assert set(first.names) <= namespaces() and not set(second.names) & namespaces()
        first.link_bytes()  # its link is still there
    assert not set(first.names) & namespaces()


def test_a_bring_up_that_fails_at_any_step_removes_what_it_made_and_nothing_else(monkeypatch):
    """Each of ``up``'s steps failing in turn (an ``ip``/``tc`` command that
    fails makes nothing): afterwards no namespace, no interface on the
    machine's own network and no state directory is left, and a live
    cluster of this process is untouched."""
    needs_a_cluster()
    steps = []
    real = emulated._run
    monkeypatch.setattr(emulated, "_run", lambda argv: steps.append(argv) or real(argv))
    with emulated.Cluster(1, rate="50mbit"):
        pass
    assert any("veth" in argv for argv in steps) and any("tbf" in argv for argv in steps)
    monkeypatch.setattr(emulated, "_run", real)
    with emulated.Cluster(1) as live:
        before = (namespaces(), links(), state_dirs())
        for failing in range(len(steps)):
            done = []

            def fail_at_step(argv, failing=failing, done=done):
                if len(done) == failing:
                    raise emulated.ClusterError(f"step {failing} failed: {argv}")
                done.append(argv)
                return real(argv)
            monkeypatch.setattr(emulated, "_run", fail_at_step)
            try:
                with pytest.raises(emulated.ClusterError, match=f"step {failing} failed"):
                    emulated.Cluster(1, rate="50mbit").up()
                assert (namespaces(), links(), state_dirs()) == before, steps[failing]
            finally:  # what the old code left, so that the next step starts clean
                for name in namespaces() - before[0]:
                    subprocess.run(["ip", "netns", "del", name], capture_output=True)
                for name in links() - before[1]:
                    subprocess.run(["ip", "link", "del", name], capture_output=True)
        monkeypatch.setattr(emulated, "_run", real)
        assert set(live.names) <= namespaces()
        live.link_bytes()


RANK = textwrap.dedent("""
    import os, signal, sys, time
    out, rank = sys.argv[1], os.environ["PMI_RANK"]
    def stopped(*_):
        open(f"{out}/stopped{rank}", "w").write(str(os.getpid()))
        if sys.argv[2] == "leave":
            sys.exit(0)
    signal.signal(signal.SIGTERM, stopped)
    open(f"{out}/ready{rank}", "w").write(str(os.getpid()))
    while True:
        time.sleep(0.05)
""")


def wait_for(path, count, seconds=60):
    """The ranks' pids, once ``count`` of them wrote ``path``/ready<rank>."""
    end = time.monotonic() + seconds
    while len(list(path.glob("ready*"))) < count:
        assert time.monotonic() < end, "the ranks did not start"
        time.sleep(0.05)
    time.sleep(0.1)  # the file is written once the handler is set
    return [int(ready.read_text()) for ready in path.glob("ready*")]


def running(pid):
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_launcher_stopped_by_sigterm_lets_the_ranks_on_every_host_stop(tmp_path):
    """SIGTERM to ``commlib cluster run`` (a test's time limit, a job
    scheduler) reaches the ranks on every host as SIGTERM, so they stop
    themselves (rather than being killed outright); then none is left
    running, nor any of the launcher's namespaces."""
    needs_a_cluster()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "commlib.tools.cluster", "run", "--hosts", "2", "-n", "2",
         "--quiet", sys.executable, "-c", RANK, str(tmp_path), "leave"])
    try:
        pids = wait_for(tmp_path, 2)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        launcher.kill()
    assert sorted(p.name for p in tmp_path.glob("stopped*")) == ["stopped0", "stopped1"]
    assert not any(running(pid) for pid in pids)
    assert not any(name.startswith(f"cl{launcher.pid}c") for name in namespaces())


def test_ranks_that_ignore_sigterm_are_killed_after_the_grace(tmp_path):
    """Ranks that do not stop on SIGTERM get ``grace`` seconds, then are
    killed, and the exception that interrupted the run goes on."""
    needs_a_cluster()
    main_thread = threading.main_thread().ident
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    pids, sent = [], []

    def terminate_once_started():
        pids.extend(wait_for(tmp_path, 2))
        sent.append(time.monotonic())
        signal.pthread_kill(main_thread, signal.SIGTERM)
    try:
        with emulated.Cluster(2) as hosts:
            threading.Thread(target=terminate_once_started, daemon=True).start()
            with pytest.raises(SystemExit):
                hosts.run(1, [sys.executable, "-c", RANK, str(tmp_path), "stay"], grace=0.5,
                          timeout=60)
            assert 0.5 <= time.monotonic() - sent[0] < 30
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sorted(p.name for p in tmp_path.glob("stopped*")) == ["stopped0", "stopped1"]
    end = time.monotonic() + 10  # killed with mpiexec's proxies, which see it gone
    while any(running(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert len(pids) == 2 and not any(running(pid) for pid in pids)
