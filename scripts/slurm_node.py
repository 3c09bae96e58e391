"""A one-node Slurm on this machine, for testing jobs under srun and sbatch (as root).

    with SlurmNode(Path("build/slurm")) as slurm:      # munged, slurmctld, slurmd started
        env = {**os.environ, **slurm.env}               # SLURM_CONF points at its slurm.conf
        subprocess.run(["srun", "--mpi=pmi2", "-n", "3", "hostname"], env=env)
    # every daemon stopped by its PID, and every job step's process with it

Nothing is written outside ``folder``: the munge key, the socket, slurm.conf, the state and
spool folders and the logs all live there, and the clients find slurm.conf through
``SLURM_CONF``. The daemons run in the foreground as children of this process (their PIDs
are known, never looked up by name); on exit, or on SIGTERM/SIGINT, they are stopped
(SIGTERM, then SIGKILL), the processes of its jobs first (slurmstepd, tasks, srun: whatever carries its SLURM_CONF).

The node is this host (its name as ``hostname`` says, at 127.0.0.1) with more CPUs than
the machine has (``SlurmdParameters=config_overrides``): the tests start more ranks than
cores. Process tracking is linuxproc and task/none (no cgroups needed), accounting off,
both PMI plugins of the Debian packages available (``--mpi=pmi2``, ``--mpi=pmix``).
Needs the Debian packages slurm-wlm, munge and libpmix-dev (scripts/environments.py
installs them).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

#: CPUs the node claims (more than the machine has: tests oversubscribe on purpose).
CPUS = 32
#: Seconds the daemons get to come up, and to go.
START_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0


def missing_tools() -> list[str]:
    """The programs a SlurmNode needs that are not installed."""
    return [tool for tool in ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
            if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]


def _tool(name: str) -> str:
    found = shutil.which(name)
    return found if found is not None else str(Path("/usr/sbin", name))


def _free_port() -> int:
    from collectives.testing.launch import free_port  # noqa: PLC0415  (outside the ephemeral range)

    return free_port()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class SlurmNode:
    """munged, slurmctld and slurmd for one node, in ``folder``; a context manager."""

    def __init__(self, folder: Path, *, cpus: int = CPUS) -> None:
        self.folder = folder.resolve()
        self.cpus = cpus
        self.host = socket.gethostname().split(".")[0]
        self._daemons: list[tuple[str, subprocess.Popen[bytes]]] = []

    @property
    def running(self) -> bool:
        return bool(self._daemons)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a client (srun, sbatch, sinfo) needs in its environment."""
        return {"SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        folder = self.folder
        for sub in ("state", "spool", "munge", "log"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(folder / "munge", 0o700)
        key = folder / "munge" / "munge.key"
        if not key.exists():
            subprocess.run([_tool("mungekey"), "--create", f"--keyfile={key}"], check=True, timeout=30)
        os.chmod(key, 0o600)
        ctld_port, slurmd_port = _free_port(), _free_port()
        self.conf.write_text(f"""\
# A one-node cluster on this machine for the test bed (scripts/slurm_node.py); nothing else reads it.
ClusterName=collectives
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge/munge.socket
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
# A job whose srun was killed is ended within seconds, not held.
InactiveLimit=15
KillWait=2
MinJobAge=10
MessageTimeout=20
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def start(self) -> None:
        """Start the three daemons and wait until the node takes jobs."""
        missing = missing_tools()
        if missing:
            raise RuntimeError(f"Slurm test node: {', '.join(missing)} not installed "
                               "(apt-get install slurm-wlm munge libpmix-dev; scripts/environments.py setup)")
        self.stop()
        self._write_config()
        folder = self.folder
        atexit.register(self.stop)
        self._daemon("munged", [_tool("munged"), "--foreground", "--force",
                                f"--key-file={folder}/munge/munge.key", f"--socket={folder}/munge/munge.socket",
                                f"--pid-file={folder}/munge/munged.pid", f"--log-file={folder}/log/munged.log",
                                f"--seed-file={folder}/munge/munged.seed"])
        self._wait(lambda: (folder / "munge" / "munge.socket").exists(), "munged's socket")
        env = {**os.environ, **self.env}
        self._daemon("slurmctld", [_tool("slurmctld"), "-D", "-i", "-f", str(self.conf)], env)
        self._daemon("slurmd", [_tool("slurmd"), "-D", "-f", str(self.conf)], env)
        self._wait(self._node_idle, "the node to be idle in sinfo")

    def _daemon(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.folder / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the daemon's for life)
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True)
        log.close()
        self._daemons.append((name, process))

    def _node_idle(self) -> bool:
        result = subprocess.run([_tool("sinfo"), "-h", "-o", "%t"], env={**os.environ, **self.env},
                                capture_output=True, text=True, timeout=30)
        return result.returncode == 0 and result.stdout.strip() in ("idle", "mix", "alloc")

    def _wait(self, ready: object, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():  # type: ignore[operator]
            for name, process in self._daemons:
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} while waiting for "
                                       f"{what}; see {self.folder}/log/")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test node: no {what} after {START_TIMEOUT:.0f}s; see {self.folder}/log/")
            time.sleep(0.2)

    def leftovers(self) -> list[int]:
        """PIDs of the processes of this node's jobs still alive: slurmstepd (which detaches
        from slurmd), the tasks, and srun clients, all of which carry this node's SLURM_CONF
        in their environment (the daemons excepted)."""
        daemons = {process.pid for _, process in self._daemons} | {os.getpid()}
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in daemons:
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0") and _alive(int(entry.name)):
                found.append(int(entry.name))
        return sorted(found)

    def stop(self) -> None:
        """Stop the job steps, then slurmd, slurmctld and munged, each by its PID."""
        if not self._daemons:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _signal(self.leftovers(), sig)
            deadline = time.monotonic() + STOP_TIMEOUT
            while self.leftovers() and time.monotonic() < deadline:
                time.sleep(0.05)
        for _, process in reversed(self._daemons):
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT)
        self._daemons = []
        atexit.unregister(self.stop)

    def __enter__(self) -> SlurmNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
