"""An emulated cluster on one Linux machine: real hosts with their own
network, host name and links of a chosen rate, to run MPI programs across
(``commlib cluster run``, or ``Cluster`` from Python).

Each host is a network namespace with one interface, ``eth0``, a veth into
a bridge that lives in a namespace of its own (made inside those
namespaces, so never on the machine's own network), and a UTS namespace
(kept alive by a bind mount) for its host name. A link's rate is a ``tc`` token
bucket on both of its ends: what the host sends and what it receives.
Names, addresses and links exist only inside those namespaces, so nothing
reaches the machine's own network; the names carry the process's pid and
a count of its clusters, so any number of clusters (in one process or
several) can run at once. ``mpiexec`` (MPICH's Hydra) runs in the first host and starts
its proxies on the others with ``-launcher ssh`` pointed at a script that
enters the host's namespaces instead of logging in; the host names resolve
through a private ``/etc/hosts`` (a mount namespace around the launch).

Ranks on one host talk through MPICH's shared memory. Between hosts, the
default netmod would use shared memory too (the namespaces share the
machine), so launches select MPICH's OFI netmod with the libfabric TCP
provider on ``eth0``: every byte between hosts crosses a shaped link
(``Cluster.link_bytes`` counts them). The MPI world then sees real nodes:
``MPI.COMM_TYPE_SHARED`` groups the ranks of a host, with no emulation
variable.

Needs root, Linux namespaces and iproute2 (``ip``, ``tc``), util-linux
(``nsenter``, ``unshare``), and MPICH's ``mpiexec``; ``problem()`` says
what is missing.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import click

from commlib.tools.world import mpiexec_path

SUBNET = "10.99.0"  # hosts are .1, .2, ...; the addresses exist only inside the namespaces
INTERFACE = "eth0"
# MPICH between hosts: the OFI netmod over libfabric's TCP provider on the shaped link
# (the default netmod's shared memory would cross the namespaces, and no link)
NETWORK_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": INTERFACE}
# the namespaces Cluster and problem() name, with the pid that made them
# (cl<pid>h<i>, without the count, is what earlier versions named)
_STALE_NAME = re.compile(r"^(?:cl(\d+)(?:c\d+)?(?:h\d+|br)|commlib-probe-(\d+))$")
_CLUSTERS = itertools.count()  # this process's clusters, for their names
# seconds mpiexec has, once told to stop (SIGTERM, which Hydra forwards to
# every rank on every host), before it is killed (its proxies then kill the ranks)
GRACE = 5.0
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*(?:/s)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}
# Hydra's ssh launcher runs `SCRIPT [ssh options] HOST COMMAND...`, COMMAND as
# one shell line (as ssh passes it on): enter that host's namespaces instead
_LAUNCHER = """#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
line="$*"
set -- nsenter --net=/run/netns/"$host" --uts=STATE/"$host".uts --
cpus=$(cat STATE/"$host".cpus)
if [ -n "$cpus" ]; then set -- "$@" taskset -c "$cpus"; fi
exec "$@" sh -c "$line"
"""


class ClusterError(RuntimeError):
    """The emulated cluster cannot be brought up here, or a step of it failed."""


def parse_rate(rate: str) -> int:
    """Bits per second of a rate such as "300mbit", "1gbit", "60 Mbit/s"."""
    found = _RATE.match(str(rate))
    if not found:  # a bare number would be tc's bytes per second: the unit is asked for
        raise click.BadParameter(f"{rate!r} is not a link rate: give bits per second as "
                                 f"tc writes them, such as 300mbit, 60mbit or 1gbit")
    bits = float(found.group(1)) * _UNITS[found.group(2).lower()]
    if bits < 8000:
        raise click.BadParameter(f"{rate!r} is below 8kbit, tc's smallest rate")
    return int(bits)


def problem() -> Optional[str]:
    """Why an emulated cluster cannot run here (None: it can)."""
    if not sys.platform.startswith("linux"):
        return "the emulated cluster needs Linux network namespaces (this is " \
            f"{sys.platform})"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth pairs and tc); " \
            "run as root, or on a real cluster use its launcher"
    missing = [tool for tool in ("ip", "tc", "nsenter", "unshare", "mount", "taskset")
               if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs {', '.join(missing)} (iproute2, util-linux)"
    probe = f"commlib-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here ({made.stderr.strip()}): a container " \
            "needs CAP_SYS_ADMIN and CAP_NET_ADMIN for the emulated cluster"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _mpiexec() -> str:
    """MPICH's mpiexec (``world.mpiexec_path``)."""
    found = mpiexec_path()
    if found is None:
        raise ClusterError("mpiexec not found: pip install mpich")
    return found


class Cluster:
    """``hosts`` emulated hosts; every link at ``rate`` (tc syntax, None:
    unshaped) but those given in ``host_rates`` (host index -> rate).
    A context manager: brought up on entry, removed on exit."""

    def __init__(self, hosts: int, rate: Optional[str] = None,
                 host_rates: Optional[Mapping[int, str]] = None):
        if hosts < 1:
            raise ClusterError(f"a cluster needs at least one host, got {hosts}")
        unknown = sorted(set(host_rates or {}) - set(range(hosts)))
        if unknown:
            raise ClusterError(f"host_rates names hosts {unknown}, but the hosts are "
                               f"0..{hosts - 1}")
        self.hosts = hosts
        chosen = [(host_rates or {}).get(i, rate) for i in range(hosts)]
        self.rates: List[Optional[int]] = [parse_rate(r) if r else None for r in chosen]
        self.cpus = split_cores(sorted(os.sched_getaffinity(0)), hosts)
        tag = f"cl{os.getpid()}c{next(_CLUSTERS)}"  # another Cluster's names are not ours
        self.names = [f"{tag}h{i}" for i in range(hosts)]  # namespaces and host names
        self._bridge = f"{tag}br"
        self._state: Optional[Path] = None
        self._made: List[str] = []  # the namespaces up() made: down() removes these only

    # -- lifecycle ------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Make the namespaces, links and files; on any failure, undo them."""
        reason = problem()
        if reason:
            raise ClusterError(reason)
        sweep_stale()
        self._state = Path(tempfile.mkdtemp(prefix=f"commlib-cluster-{os.getpid()}-"))
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _build(self) -> None:
        state = self._state
        hosts = "".join(f"{SUBNET}.{i + 1} {name}\n" for i, name in enumerate(self.names))
        (state / "hosts").write_text(f"127.0.0.1 localhost\n{hosts}")
        launcher = state / "launch-on-host"
        launcher.write_text(_LAUNCHER.replace("STATE", str(state)))
        launcher.chmod(0o755)
        self._add_namespace(self._bridge)
        _ip("-n", self._bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self._bridge, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            outer = f"h{i}"  # the link's end in the bridge
            self._add_namespace(name)
            # both ends made where they live, in one step: none is ever on the
            # machine's own network, where a failed move would leave it
            _ip("link", "add", INTERFACE, "netns", name, "type", "veth", "peer", "name", outer,
                "netns", self._bridge)
            _ip("-n", name, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", INTERFACE)
            _ip("-n", name, "link", "set", INTERFACE, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", self._bridge, "link", "set", outer, "master", "br0", "up")
            if self.rates[i] is not None:
                for namespace, device in ((name, INTERFACE), (self._bridge, outer)):
                    _shape(namespace, device, self.rates[i])
            (state / f"{name}.cpus").write_text(self.cpus[i] or "")
            uts = state / f"{name}.uts"
            uts.touch()
            _run(["unshare", f"--uts={uts}", "hostname", name])

    def down(self) -> None:
        """Remove everything ``up`` made (whatever part of it exists), and
        nothing else: a namespace of that name that ``up`` could not make
        is someone else's."""
        while self._made:  # its links and the bridge go with it
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)
        if self._state is not None:
            for uts in self._state.glob("*.uts"):
                subprocess.run(["umount", str(uts)], capture_output=True)
            shutil.rmtree(self._state, ignore_errors=True)
            self._state = None

    # -- use --------------------------------------------------------------------------
    def command(self, ranks_per_host: int, argv: Sequence[str],
                mpiexec_args: Sequence[str] = ()) -> List[str]:
        """The command line that runs ``argv`` as ``ranks_per_host`` ranks
        on every host (rank r on host r // ranks_per_host)."""
        if self._state is None:
            raise ClusterError("the cluster is not up: use it as a context manager")
        if ranks_per_host < 1:
            raise ClusterError(f"ranks_per_host must be at least 1, got {ranks_per_host}")
        hosts = ",".join(f"{name}:{ranks_per_host}" for name in self.names)
        mpiexec = [_mpiexec(), "-launcher", "ssh", "-launcher-exec",
                   str(self._state / "launch-on-host"), "-hosts", hosts,
                   "-n", str(ranks_per_host * self.hosts), *mpiexec_args, *argv]
        first = self.names[0]
        pinned = ["taskset", "-c", self.cpus[0]] if self.cpus[0] else []
        inside_first = ["nsenter", f"--net=/run/netns/{first}",
                        f"--uts={self._state / (first + '.uts')}", "--", *pinned, *mpiexec]
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(self._state / "hosts"),
                *inside_first]

    def run(self, ranks_per_host: int, argv: Sequence[str],
            env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
            grace: float = GRACE, input=None, capture_output: bool = False,
            check: bool = False, **popen) -> subprocess.CompletedProcess:
        """``argv`` across the hosts (``command``), with MPICH set to cross
        the links (``NETWORK_ENV``) unless ``env`` or the environment says
        otherwise; ``input``, ``capture_output``, ``check`` and the keyword
        arguments as ``subprocess.run`` takes them.

        Unlike ``subprocess.run``, a timeout or an exception while it runs
        (a signal handler's ``SystemExit``, Ctrl-C) first sends mpiexec
        SIGTERM, which Hydra forwards to the ranks on every host, and kills
        it only after ``grace`` seconds: the ranks get to stop themselves."""
        full_env = {**NETWORK_ENV, **os.environ, **(env or {})}
        if capture_output:
            popen["stdout"] = popen["stderr"] = subprocess.PIPE
        if input is not None:
            popen["stdin"] = subprocess.PIPE
        with subprocess.Popen(self.command(ranks_per_host, argv), env=full_env,
                              **popen) as process:
            try:
                out, err = process.communicate(input, timeout=timeout)
            except BaseException:
                _stop(process, grace)
                raise
        if check and process.returncode:
            raise subprocess.CalledProcessError(process.returncode, process.args, out, err)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def link_bytes(self) -> List[Tuple[int, int]]:
        """(bytes sent, bytes received) by each host on its link so far."""
        counted = []
        for name in self.names:
            shown = json.loads(_ip("-n", name, "-j", "-s", "link", "show", INTERFACE))[0]
            stats = shown["stats64"]
            counted.append((int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])))
        return counted


def sweep_stale() -> None:
    """Remove what clusters of processes that no longer exist left behind
    (a launch killed outright never reaches ``down``), and the namespace
    ``problem()`` makes to see whether it can, should it have been killed
    between making and removing it."""
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        found = _STALE_NAME.match(name)
        if found and not alive(int(found.group(1) or found.group(2))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for state in Path(tempfile.gettempdir()).glob("commlib-cluster-*-*"):
        pid = state.name.split("-")[2]
        if pid.isdigit() and not alive(int(pid)):
            for uts in state.glob("*.uts"):
                subprocess.run(["umount", str(uts)], capture_output=True)
            shutil.rmtree(state, ignore_errors=True)


def _stop(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM to mpiexec, SIGKILL after ``grace`` seconds (or at once,
    should another exception interrupt the wait); the pipes are read
    meanwhile, so that the ranks' last words do not block them."""
    try:
        process.terminate()
        process.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    finally:
        process.kill()
        process.wait()  # Popen's exit does not, after Ctrl-C


def split_cores(cores: Sequence[int], hosts: int) -> List[Optional[str]]:
    """Each host's cores (a taskset list), as many each and none shared, so
    that one host's ranks do not compute on another's cores (nor count them
    as theirs); None for every host where there are fewer cores than hosts."""
    per = len(cores) // hosts
    if per == 0:
        return [None] * hosts
    return [",".join(map(str, cores[i * per:(i + 1) * per])) for i in range(hosts)]


def _run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _shape(namespace: str, device: str, bits_per_s: int) -> None:
    """A token bucket of ``bits_per_s`` on ``device``'s egress: a burst of
    10 ms of the rate (at least 64 KiB, so that a 1500 B packet and the
    kernel's tick fit), a queue of 100 ms."""
    burst = max(bits_per_s // 8 // 100, 64 * 1024)
    _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
          "rate", f"{bits_per_s}bit", "burst", str(burst), "latency", "100ms"])


# -- the command line --------------------------------------------------------------------
def _host_rate(text: str) -> Tuple[int, str]:
    host, _, rate = text.partition("=")
    if not host.strip().isdigit() or not rate:
        raise click.BadParameter(f"{text!r}: give HOST=RATE, such as 1=60mbit")
    parse_rate(rate)
    return int(host), rate


@click.group()
def cluster() -> None:
    """An emulated cluster of hosts on this machine (network namespaces,
    links shaped by tc): run an MPI program across real hosts without
    owning them. Needs root."""


@cluster.command()
def check() -> None:
    """Whether an emulated cluster can run here, and if not, why."""
    reason = problem()
    click.echo(reason or "ok: network namespaces, veth pairs and tc work here")
    sys.exit(1 if reason else 0)


@cluster.command(context_settings={"ignore_unknown_options": True,
                                   "allow_interspersed_args": False})
@click.option("--hosts", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("-n", "--np", "ranks", type=click.IntRange(min=1), required=True,
              help="ranks in all, spread evenly: rank r on host r // (n / hosts)")
@click.option("--rate", default=None, help="every link's rate, such as 300mbit "
              "(default: unshaped)")
@click.option("--host-rate", "host_rates", multiple=True, callback=lambda c, p, v: dict(
    _host_rate(item) for item in v), help="one host's link, such as 1=60mbit (repeatable)")
@click.option("--quiet", is_flag=True, help="do not print the link byte counts")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def run(hosts: int, ranks: int, rate: Optional[str], host_rates: Dict[int, str],
        quiet: bool, argv: Tuple[str, ...]) -> None:
    """Bring up HOSTS hosts, run ARGV as NP ranks across them with mpiexec,
    print the bytes each link carried, tear down; exits with the program's
    status. Usable as a launcher: `commlib cluster run --hosts 2 -n 4 python x.py`."""
    if ranks % hosts:
        raise click.BadParameter(f"{ranks} ranks do not spread evenly over {hosts} hosts: "
                                 f"give a multiple of {hosts}", param_hint="-n")
    # a launcher killed politely (a test's time limit, Ctrl-C) still removes its hosts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        with Cluster(hosts, rate, host_rates) as emulated:
            done = emulated.run(ranks // hosts, argv)
            if not quiet:
                click.echo("link bytes (sent/received): " + ", ".join(
                    f"host {i} {sent / 1e6:.1f}/{received / 1e6:.1f} MB"
                    for i, (sent, received) in enumerate(emulated.link_bytes())), err=True)
    except ClusterError as error:
        raise click.ClickException(str(error)) from None
    sys.exit(done.returncode)


if __name__ == "__main__":
    cluster()
