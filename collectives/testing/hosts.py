"""Several hosts on one Linux machine, for testing a multi-node job without a cluster.

    from collectives.testing.hosts import TestBed, unavailable_reason

    if unavailable_reason() is None:
        with TestBed(hosts=2) as bed:              # host-a 10.213.0.1, host-b 10.213.0.2
            bed.run("host-a", ["hostname"])       # -> "host-a"
            mpiexec = bed.mpiexec_args(2)         # -launcher ssh -launcher-exec <wrapper> -f <hostfile>
            # the command each host runs: one mpiexec on host-a, or one torchrun per host
            for host, argv in bed.launch_commands("torchrun", ["job.py"], 2).items():
                bed.popen(host, argv, env={**os.environ, **bed.env})
            bed.shape(rate="1gbit")               # tc on each eth0; bed.tx_bytes(host) counts

Each host is a network namespace with its own loopback, one interface ``eth0`` with a
private address, and (through ``unshare --uts``) its own hostname. The hosts' ``eth0`` are
veth pairs plugged into a bridge that lives in a namespace of its own (the switch), so
nothing is added to the machine's own network: traffic only flows between the test hosts.
Every host gets its own ``/etc/hosts`` through ``ip netns exec``'s
``/etc/netns/<namespace>/hosts`` (bind-mounted over ``/etc/hosts`` for whatever runs there).
By default that file maps the host's *own* name to ``127.0.1.1``, as Debian and Ubuntu
installs do, and the other hosts' names to their addresses: the setting in which "my
hostname's address" is an address no other host can reach.

The hosts share one kernel, so whatever decides "same machine" from the kernel rather than
from the network takes a shortcut: UCX (MPICH's transport) compares boot ids and joins ranks
on different test hosts through shared memory (sysv, cma), never touching ``eth0``.
:data:`TestBed.env` (``UCX_TLS=tcp,self``) makes it use TCP between hosts as on a cluster
without InfiniBand; MPICH's own shared memory still serves the ranks of one host. Run the
jobs with it in their environment.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN), ``ip`` (iproute2) and ``unshare`` (util-linux);
:func:`unavailable_reason` says what is missing. :meth:`TestBed.close` (also run at exit,
and by ``with``) kills every process left in the hosts and deletes namespaces, veths, the
bridge and the ``/etc/netns`` files. Namespaces of a test bed whose process died without
cleaning up are deleted by the next TestBed (their names carry the owner's pid).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..diagnostics._exits import process_alive

#: Namespace names: ``collectives-<pid>-<n>-sw`` and ``collectives-<pid>-<n>-<host>``.
PREFIX = "collectives"
#: The hosts' network: a private range that exists only inside the bed's namespaces.
SUBNET = "10.213.0"
NETNS_ETC = Path("/etc/netns")
_HOST_NAMES = ("host-a", "host-b", "host-c", "host-d")
#: torchrun's c10d rendezvous port on the first host (inside the bed: nothing else holds it).
RENDEZVOUS_PORT = 29400

_beds_made = 0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why a test bed cannot be built here (``None``: it can)."""
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"the multi-host test bed needs `{tool}` on PATH"
    if os.geteuid() != 0:
        return "the multi-host test bed needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for network namespaces)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed (no network namespaces here?): {made.stderr.strip()}"
    try:
        up = _ip("-n", probe, "link", "set", "lo", "up", check=False)
        if up.returncode != 0:
            return f"cannot configure a network namespace (CAP_NET_ADMIN?): {up.stderr.strip()}"
        uts = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "hostname", "probe"],
                             capture_output=True, text=True, timeout=30)
        if uts.returncode != 0:
            return f"`unshare --uts` failed (no UTS namespaces here?): {uts.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _remove_stale_namespaces() -> None:
    """Delete namespaces (and /etc/netns entries) of beds whose owning process is gone."""
    listed = _ip("netns", "list", check=False).stdout
    for name in {line.split()[0] for line in listed.splitlines() if line.strip()}:
        match = re.fullmatch(rf"{PREFIX}-(\d+)-.+", name)
        if match is None or process_alive(int(match.group(1))):
            continue
        _kill_namespace_processes(name)
        _ip("netns", "del", name, check=False)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def _kill_namespace_processes(namespace: str, sig: int = signal.SIGKILL) -> list[int]:
    pids = [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


class TestBed:
    """``hosts`` (2-4) network namespaces on one bridge, each with its address and hostname.

    ``loopback_hostname``: each host's /etc/hosts maps its own name to 127.0.1.1 (Debian's
    default) instead of its address; the other hosts' names map to their addresses either way.
    """

    __test__ = False  # a helper, not a pytest test class
    #: Environment for the jobs on the bed: UCX between hosts over TCP (see the module's doc).
    env: dict[str, str] = {"UCX_TLS": "tcp,self"}

    def __init__(self, hosts: int = 2, *, loopback_hostname: bool = True, subnet: str = SUBNET) -> None:
        global _beds_made
        if not 2 <= hosts <= len(_HOST_NAMES):
            raise ValueError(f"hosts must be 2..{len(_HOST_NAMES)}, got {hosts!r}")
        self.names: list[str] = list(_HOST_NAMES[:hosts])
        self.addresses: dict[str, str] = {name: f"{subnet}.{i + 1}" for i, name in enumerate(self.names)}
        stem = f"{PREFIX}-{os.getpid()}-{_beds_made}"
        _beds_made += 1
        self.switch = f"{stem}-sw"
        self.namespaces: dict[str, str] = {name: f"{stem}-{name}" for name in self.names}
        self.loopback_hostname = loopback_hostname
        self._dir = Path(tempfile.mkdtemp(prefix=f"{stem}-"))
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- set-up and tear-down ------------------------------------------------------------------

    def _build(self) -> None:
        _remove_stale_namespaces()
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ns = self.namespaces[name]
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Both ends are made inside the bed's namespaces: the machine's own namespace
            # never sees them.
            _ip("-n", self.switch, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self.hosts_file(name))
            (etc / "hostname").write_text(name + "\n")
        self.hostfile = self._dir / "hostfile"
        self.launcher_exec = self._dir / "enter-host"
        self._write_launcher_exec()

    def hosts_file(self, host: str) -> str:
        """The /etc/hosts that ``host`` sees."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if self.loopback_hostname:
            lines.append(f"127.0.1.1\t{host}")
        # Every host's address is listed too (after the loopback line, which wins for the
        # host's own name), as DNS would have them: reverse look-ups of peers then work.
        lines += [f"{self.addresses[name]}\t{name}" for name in self.names]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """Kill every process in the hosts; delete namespaces, veths, bridge and files."""
        if self._closed:
            return
        self._closed = True
        for ns in [*self.namespaces.values(), self.switch]:
            _kill_namespace_processes(ns)
            _ip("netns", "del", ns, check=False)  # deletes the veths and the bridge with it
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> TestBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running things on a host -----------------------------------------------------------------

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``: in its network namespace (and its /etc/hosts), with its hostname."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def run(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(host, argv), **kwargs)

    def kill_host(self, host: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process on ``host`` (a machine that dies); returns their pids."""
        return _kill_namespace_processes(self.namespaces[host], sig)

    def pids(self, host: str) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.namespaces[host], check=False).stdout.split()]

    def tx_bytes(self, host: str) -> int:
        """Bytes ``host`` has sent on its ``eth0`` (to the other hosts) so far."""
        shown = _ip("-j", "-s", "-n", self.namespaces[host], "link", "show", "dev", "eth0").stdout
        return int(json.loads(shown)[0]["stats64"]["tx"]["bytes"])

    # -- MPI (Hydra) ------------------------------------------------------------------------------

    def _write_launcher_exec(self) -> None:
        # Hydra's ssh launcher runs `<launcher-exec> [-x] HOST COMMAND...` and, like ssh, the
        # command is one shell line for the remote side: this enters HOST instead.
        cases = "\n".join(f'  {name}) ns={self.namespaces[name]} ;;' for name in self.names)
        self.launcher_exec.write_text(f"""#!/bin/sh
# ssh stand-in for mpiexec -launcher ssh -launcher-exec: runs the command on a test host.
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
{cases}
  *) echo "enter-host: no test host named $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
""")
        self.launcher_exec.chmod(self.launcher_exec.stat().st_mode | stat.S_IXUSR)

    def mpiexec_args(self, ranks_per_host: int, hosts: Sequence[str] | None = None) -> list[str]:
        """mpiexec options that place ``ranks_per_host`` ranks on each of ``hosts`` (default all)."""
        hosts = list(self.names if hosts is None else hosts)
        path = self._dir / f"hostfile-{'-'.join(hosts)}-{ranks_per_host}"
        path.write_text("".join(f"{name}:{ranks_per_host}\n" for name in hosts))
        return ["-launcher", "ssh", "-launcher-exec", str(self.launcher_exec), "-f", str(path),
                "-n", str(ranks_per_host * len(hosts)), "-ppn", str(ranks_per_host)]

    # -- jobs -------------------------------------------------------------------------------------

    def launch_commands(self, launcher: str, argv: Sequence[str], ranks_per_host: int, *,
                        hosts: Sequence[str] | None = None, bin_dir: str | Path | None = None,
                        run_id: str = "testbed", rendezvous_port: int = RENDEZVOUS_PORT,
                        python: str = sys.executable) -> dict[str, list[str]]:
        """The command each host runs to start ``argv`` (a script and its arguments) on
        ``ranks_per_host`` ranks of each of ``hosts`` (default all): ``launcher`` "mpiexec"
        (one mpiexec on the first host, the others reached through :attr:`launcher_exec`)
        or "torchrun" (one per host, the c10d rendezvous on the first host's address)."""
        hosts = list(self.names if hosts is None else hosts)
        bin_dir = Path(python).parent if bin_dir is None else Path(bin_dir)
        if launcher == "mpiexec":
            return {hosts[0]: [str(bin_dir / "mpiexec"), *self.mpiexec_args(ranks_per_host, hosts),
                               python, *argv]}
        if launcher == "torchrun":
            return {host: [str(bin_dir / "torchrun"), "--nnodes", str(len(hosts)),
                           "--nproc_per_node", str(ranks_per_host), "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", f"{self.addresses[hosts[0]]}:{rendezvous_port}",
                           "--rdzv-id", run_id, "--max-restarts", "0", "--monitor-interval", "0.2",
                           *argv] for host in hosts}
        raise ValueError(f"launcher must be 'mpiexec' or 'torchrun', got {launcher!r}")

    # -- the link ---------------------------------------------------------------------------------

    def shape(self, *, delay_ms: float | None = None, rate: str | None = None) -> str:
        """Shape every host's ``eth0`` (both directions are shaped, each at its sender):
        ``tc netem`` with ``delay_ms`` and ``rate`` where the kernel has netem, else ``tbf``
        for the rate alone. Returns the qdisc set on each host, as ``tc`` was told."""
        netem = ["netem", *(["delay", f"{delay_ms}ms"] if delay_ms else []),
                 *(["rate", rate] if rate else [])]
        tbf = ["tbf", "rate", rate or "100gbit", "burst", "256kb", "latency", "50ms"]
        chosen = None
        # Without netem (some kernels lack sch_netem) only the rate is shaped: the returned
        # qdisc says which was set.
        for qdisc in (netem, tbf):
            results = [_ip_tc(self.namespaces[name], qdisc) for name in self.names]
            if all(r.returncode == 0 for r in results):
                chosen = qdisc
                break
            for name in self.names:
                _ip_tc(self.namespaces[name], None)
        if chosen is None:
            raise RuntimeError(f"tc could not shape the link: {results[0].stderr.strip()}")
        return " ".join(chosen)

    def cut(self, host: str) -> None:
        """Take ``host`` off the switch without a word: its port leaves the bridge, so from
        then on nothing it sends arrives and nothing reaches it, with no reset, no ICMP and
        its own ``eth0`` still up (a cable pulled further away, or a host that hangs)."""
        _ip("-n", self.switch, "link", "set", f"port{self.names.index(host)}", "nomaster")

    def reconnect(self, host: str) -> None:
        """Undo :meth:`cut`."""
        _ip("-n", self.switch, "link", "set", f"port{self.names.index(host)}", "master", "br0")

    def unshape(self) -> None:
        for name in self.names:
            _ip_tc(self.namespaces[name], None)


def _ip_tc(namespace: str, qdisc: list[str] | None) -> subprocess.CompletedProcess[str]:
    action = ["del", "dev", "eth0", "root"] if qdisc is None else ["replace", "dev", "eth0", "root", *qdisc]
    return subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", *action],
                          capture_output=True, text=True, timeout=30)
