"""Jobs over two hosts: the launchers (mpiexec with a hostfile, one torchrun per host with the
c10d rendezvous) and every backend, on the test bed of :mod:`collectives.testing.hosts`
(network namespaces on one machine; needs root, skipped with the reason elsewhere).

The hosts resolve their own names to 127.0.1.1, as Debian installs do: an address no other
host reaches. One bed serves the module; every launch is bounded by a timeout, and every
wait is on the processes' exit or on a line of their output.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_launchers import rank_lines
from test_train import SHORT as TRAIN_SHORT
from test_train import TRAIN, load_train, reference_params

from collectives.launcher import without_launcher_variables
from collectives.testing.hosts import TestBed, unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "launchers" / "scripts"
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 120
# The store/collective timeout of the ranks: bounds how long a rank waits for a lost peer
# when nothing tells it the peer is gone (a cable pulled rather than a process killed).
RANK_TIMEOUT = 30
RANKS_PER_HOST = 2
HOSTS = ("host-a", "host-b")
_run_ids = itertools.count()


@pytest.fixture(scope="module")
def bed():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    made = TestBed(len(HOSTS))
    yield made
    made.close()


def job_env(backend, rank_timeout=RANK_TIMEOUT):
    """The ranks' environment; ``rank_timeout=None``: the library's default timeout."""
    env = {k: v for k, v in without_launcher_variables(os.environ).items()
           if not k.startswith("COLLECTIVES_POOL") and k not in ("GLOO_SOCKET_IFNAME", "COLLECTIVES_TIMEOUT")}
    env.pop("COLLECTIVES_BACKEND", None)
    if backend is not None:
        env["COLLECTIVES_BACKEND"] = backend
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    if rank_timeout is not None:
        env["COLLECTIVES_TIMEOUT"] = str(rank_timeout)
    return env


class Job:
    """A job's launcher processes (one per host for torchrun, one for mpiexec), their output
    gathered line by line as it comes."""

    def __init__(self, bed, launcher, argv, backend, rank_timeout=RANK_TIMEOUT,
                 ranks_per_host=RANKS_PER_HOST, env=None):
        self.bed = bed
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self.output: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}
        env = {**job_env(backend, rank_timeout), **bed.env, **(env or {})}
        commands = bed.launch_commands(launcher, argv, ranks_per_host, hosts=HOSTS, bin_dir=BIN,
                                       run_id=f"multihost{os.getpid()}x{next(_run_ids)}")
        for host, command in commands.items():
            proc = bed.popen(host, command, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.procs[host] = proc
            threading.Thread(target=self._read, args=(host, proc), daemon=True).start()

    def _read(self, host, proc):
        for line in proc.stdout:
            self.lines.put((host, line))

    def _drain(self):
        while True:
            try:
                host, line = self.lines.get_nowait()
            except queue.Empty:
                return
            self.output.append(f"[{host}] {line}")

    def wait_for(self, pattern, count, timeout=LAUNCH_TIMEOUT):
        """Block until ``count`` output lines match ``pattern`` (or fail after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while len(re.findall(pattern, self.text)) < count:
            try:
                host, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                pytest.fail(f"no {count} lines {pattern!r} in {timeout}s:\n{self.text}")
            self.output.append(f"[{host}] {line}")

    def wait(self, hosts=None, timeout=LAUNCH_TIMEOUT):
        """Wait for the launchers on ``hosts`` (default: all) to end; their exit statuses."""
        deadline = time.monotonic() + timeout
        codes = {}
        for host in hosts or self.procs:
            try:
                codes[host] = self.procs[host].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"the job on {host} did not end within {timeout}s:\n{self.text}")
        return codes

    def kill(self):
        for host in self.bed.names:
            self.bed.kill_host(host)
        for proc in self.procs.values():
            proc.wait(timeout=30)

    @property
    def text(self):
        self._drain()
        return "".join(self.output)


def run_job(bed, launcher, argv, backend, timeout=LAUNCH_TIMEOUT, ranks_per_host=RANKS_PER_HOST,
            env=None):
    """Run a job to its end; the launchers' exit statuses and their output (after EOF)."""
    job = Job(bed, launcher, argv, backend, ranks_per_host=ranks_per_host, env=env)
    try:
        codes = job.wait(timeout=timeout)
        for proc in job.procs.values():
            proc.stdout.close()  # the readers saw EOF: the launcher ended
    finally:
        job.kill()
    return codes, job.text


# -- the test bed itself ---------------------------------------------------------------------------

def test_each_host_has_its_name_address_and_hosts_file(bed):
    resolve = ("import socket; print(socket.gethostname(), *(socket.gethostbyname(h) for h in "
               f"{HOSTS!r}))")
    for host in HOSTS:
        result = bed.run(host, [sys.executable, "-c", resolve])
        name, *addresses = result.stdout.split()
        assert name == host, result
        # Debian's habit: a host's own name is 127.0.1.1, the others' their addresses.
        assert addresses == [("127.0.1.1" if other == host else bed.addresses[other]) for other in HOSTS]
        assert bed.addresses[host] in bed.run(host, ["ip", "-4", "addr", "show", "eth0"]).stdout


PAYLOAD_MIB = 16
CROSSING = f"""
import numpy as np, collectives
comm = collectives.init()
x = np.full({PAYLOAD_MIB} << 18, comm.rank + 1, np.float32)  # {PAYLOAD_MIB} MiB
comm.all_reduce(x)
# Checked on each rank (a wrong sum exits non-zero): lines of several ranks may interleave.
assert x.min() == x.max() == 3.0, (comm.rank, x.min(), x.max())
print(f"SUMMED {PAYLOAD_MIB} MiB on {{comm.size}} ranks", flush=True)
"""


def test_mpi_data_between_ranks_on_different_hosts_crosses_the_hosts_link(bed, tmp_path):
    # One rank per host. On one kernel UCX would join them through shared memory unless the
    # bed's environment (UCX_TLS) says otherwise: then nothing but control traffic crossed.
    # (Gloo's TCP pairs have no other way than eth0 between two network namespaces.)
    before = {host: bed.tx_bytes(host) for host in HOSTS}
    script = tmp_path / "crossing.py"
    script.write_text(CROSSING)
    codes, text = run_job(bed, "mpiexec", [str(script)], "mpi", ranks_per_host=1)
    assert set(codes.values()) == {0}, text
    assert f"SUMMED {PAYLOAD_MIB} MiB on 2 ranks" in text, text
    # A ring all_reduce of 2 ranks sends half the array each way, at least.
    for host in HOSTS:
        assert bed.tx_bytes(host) - before[host] >= (PAYLOAD_MIB << 20) // 2, (host, text)


# -- the public contract over two hosts --------------------------------------------------------------

# launcher, COLLECTIVES_BACKEND, the backend it must pick
CONTRACT = [("mpiexec", "mpi", "mpi"), ("mpiexec", "torch", "torch"), ("mpiexec", None, "mpi"),
            ("torchrun", "torch", "torch"), ("torchrun", "auto", "torch")]


@pytest.mark.parametrize("launcher, backend, expected", CONTRACT)
def test_the_public_contract_holds_with_two_ranks_on_each_of_two_hosts(bed, launcher, backend, expected):
    codes, text = run_job(bed, launcher, [str(SCRIPTS / "contract_check.py")], backend)
    size = RANKS_PER_HOST * len(HOSTS)
    lines = rank_lines(text, "rank ")
    assert set(codes.values()) == {0}, text
    assert len(lines) == size and all(line.endswith("failures=[]") for line in lines), text
    assert all(f"backend={expected}" in line for line in lines)
    assert_ranks_fill_each_host_in_order(text, size)


def assert_ranks_fill_each_host_in_order(text, size):
    """Each host holds RANKS_PER_HOST consecutive ranks, whose local ranks count from 0 and
    whose local size is the host's (which host gets rank 0 is the launcher's choice)."""
    places = re.findall(r"PLACE rank=(\d+) host=(\S+) local_rank=(\d+) local_size=(\d+) "
                        r"host_ranks=\[([^\]]*)\]", text)
    assert sorted(int(p[0]) for p in places) == list(range(size)), text
    by_host = {}
    for rank, host, local_rank, local_size, host_ranks in places:
        by_host.setdefault(host, []).append((int(rank), int(local_rank), int(local_size), host_ranks))
    assert sorted(by_host) == sorted(HOSTS), text
    for host, ranks in by_host.items():
        ranks.sort()
        first = ranks[0][0]
        block = list(range(first, first + RANKS_PER_HOST))
        assert [r[0] for r in ranks] == block, (host, ranks)
        assert [r[1] for r in ranks] == list(range(RANKS_PER_HOST)), (host, ranks)
        assert {r[2] for r in ranks} == {RANKS_PER_HOST}, (host, ranks)
        assert {r[3] for r in ranks} == {", ".join(map(str, block))}, (host, ranks)


# -- the cupy backend's NCCL id exchange, without a GPU ------------------------------------------

@pytest.mark.parametrize("launcher, route", [("mpiexec", "mpi"), ("torchrun", "store")])
def test_rank_zeros_nccl_id_reaches_the_ranks_of_the_other_host(bed, launcher, route):
    # backends/cupy_id.py alone (no CUDA, no CuPy): MPI_Bcast under mpiexec, torchrun's agent
    # store (MASTER_ADDR:MASTER_PORT, which must be host-a's reachable address) under torchrun.
    # The NCCL communicator that uses the id needs GPUs: tests/gpu/test_gpu.py (GPU run owed).
    codes, text = run_job(bed, launcher, [str(SCRIPTS / "nccl_id_check.py")], None)
    assert set(codes.values()) == {0}, text
    assert f"NCCL IDS OK route={route} ranks={RANKS_PER_HOST * len(HOSTS)} exchanges=3" in text, text


# -- SyncBatchNorm training over two hosts -------------------------------------------------------

# launcher, COLLECTIVES_BACKEND
TRAINING = [("torchrun", "torch"), ("mpiexec", "mpi"), ("mpiexec", "torch")]


@pytest.mark.parametrize("launcher, backend", TRAINING)
def test_syncbn_training_on_two_hosts_equals_one_process_on_the_global_batch(bed, launcher, backend,
                                                                            tmp_path):
    # 101 images on 4 ranks: shards of 26/25/25/25, the last step short on every rank.
    checkpoint = tmp_path / "ck.pt"
    argv = [*TRAIN_SHORT, "--check", "--checkpoint", str(checkpoint)]
    codes, text = run_job(bed, launcher, [str(TRAIN), *argv], backend)
    size = RANKS_PER_HOST * len(HOSTS)
    assert set(codes.values()) == {0}, text
    assert f"equivalence check: {size} ranks vs one process" in text, text
    assert "SyncBN check passed" in text, text
    # Independently of the ranks' own check: the model rank 0 saved equals the one-process
    # BatchNorm run on the concatenated batches, recomputed here.
    train = load_train()
    model = train.build_model(0)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    want_params, want_stats = reference_params(argv, size)
    np.testing.assert_allclose(train._params(model).numpy(), want_params, rtol=0, atol=1e-5)
    np.testing.assert_allclose(train._running_stats(model).numpy(), want_stats, rtol=0, atol=1e-5)


# -- a host dies ------------------------------------------------------------------------------------

# launcher, COLLECTIVES_BACKEND, the host whose every process is killed. mpiexec runs on
# host-a: killing host-b is losing a remote host, killing host-a kills mpiexec with it (then
# host-b's proxy must end its ranks). torchrun's rendezvous store is host-a's agent: killing
# host-a loses the store too.
FAULTS = [("mpiexec", "mpi", "host-b"), ("mpiexec", "mpi", "host-a"), ("torchrun", "torch", "host-b"),
          ("torchrun", "torch", "host-a")]
# How long the survivors may take to end: far below the default COLLECTIVES_TIMEOUT (1800 s,
# which these jobs keep), so passing means the loss was detected, not timed out.
FAULT_DEADLINE = 60


@pytest.mark.parametrize("launcher, backend, victim", FAULTS)
def test_the_other_host_ends_within_seconds_when_every_process_of_one_host_is_killed(
        bed, launcher, backend, victim):
    job = Job(bed, launcher, [str(SCRIPTS / "fault_check.py")], backend, rank_timeout=None)
    try:
        job.wait_for(r"READY rank=\d+ host=", RANKS_PER_HOST * len(HOSTS))
        ranks = {int(r): h for r, h in re.findall(r"READY rank=(\d+) host=(host-[a-d])", job.text)}
        survivors = sorted(r for r, h in ranks.items() if h != victim)
        killed_at = time.monotonic()
        assert bed.kill_host(victim), f"nothing was running on {victim}"
        # The launchers left: mpiexec (on host-a) for a lost host-b; the surviving torchrun;
        # none when mpiexec's host is lost: then the surviving ranks themselves must go.
        surviving = [h for h in job.procs if h != victim]
        codes = job.wait(surviving, timeout=FAULT_DEADLINE)
        left = wait_until_hosts_are_empty(bed, timeout=10 if surviving else FAULT_DEADLINE)
        ended = time.monotonic() - killed_at
    finally:
        job.kill()
    text = job.text
    assert all(code != 0 for code in codes.values()), (codes, text)
    assert not left, f"processes left running after the launchers ended: {left}\n{text}"
    lost = [re.search(rf"PEER LOST rank={rank} after=[0-9.]+s: CollectiveError: all_reduce "
                      r"\(call #\d+\) .* failed in torch.distributed \(a peer rank may have died\)", text)
            for rank in survivors]
    if launcher == "mpiexec" and victim == "host-a":
        pass  # mpiexec died with host-a: nobody is left to say anything; nothing is left running
    elif launcher == "mpiexec":
        # Hydra's mpiexec sees the lost host's proxy go, says so and ends the job (its proxy
        # kills the surviving ranks).
        assert "[mpiexec@host-a]" in text, text
    elif victim == "host-b":
        # Each surviving rank says it lost a peer (the torch backend's CollectiveError), and
        # exits 2; torchrun's report names a failed rank and that status.
        assert all(lost), text
        assert re.search(r"exitcode\s*: 2", text), text
    else:
        # The surviving agent lost the rendezvous store as well: either its ranks said they
        # lost a peer and it reported them, or its poll of the store failed first and it
        # stopped them (it says the store's connection failed).
        assert all(lost) or "RendezvousConnectionError: The connection to the C10d store has failed" in text, text
    detected = [float(t) for t in re.findall(r"PEER LOST rank=\d+ after=([0-9.]+)s", text)]
    print(f"TIMING {victim} killed -> {launcher} ({backend}) on the other host ended: {ended:.2f} s"
          f"{f'; its ranks raised after {max(detected):.2f} s' if detected else ''}")


def wait_until_hosts_are_empty(bed, timeout=10):
    """Pids still running on the bed's hosts after ``timeout`` s (a launcher may exit while
    the SIGKILLs it sent are still being delivered)."""
    deadline = time.monotonic() + timeout
    while (left := {h: pids for h in bed.names if (pids := bed.pids(h))}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.parametrize("launcher, backend", [("torchrun", "torch"), ("mpiexec", "mpi")])
def test_a_host_that_goes_silent_ends_in_a_timeout_on_the_other_host_with_dumps(bed, tmp_path, launcher, backend):
    """host-b leaves the switch without a reset (its processes live on): host-a's ranks raise
    CollectiveTimeout at COLLECTIVES_TIMEOUT (or, under torchrun, the closed connection of a
    host-a rank that timed out first), write their flight-recorder dumps, and the
    launcher on host-a (torchrun, or mpiexec after their MPI_Abort) ends with nothing of the
    job left running there."""
    seconds = 5
    job = Job(bed, launcher, [str(SCRIPTS / "fault_check.py")], backend, rank_timeout=seconds,
              env={"COLLECTIVES_TRACE_DIR": str(tmp_path)})
    try:
        job.wait_for(r"READY rank=\d+ host=", RANKS_PER_HOST * len(HOSTS))
        ranks = {int(r): h for r, h in re.findall(r"READY rank=(\d+) host=(host-[a-d])", job.text)}
        survivors = sorted(r for r, h in ranks.items() if h == "host-a")
        cut_at = time.monotonic()
        bed.cut("host-b")
        codes = job.wait(["host-a"], timeout=FAULT_DEADLINE + 4 * seconds)
        ended = time.monotonic() - cut_at
        deadline = time.monotonic() + 10  # the launcher may exit while its kills are delivered
        while (left := bed.pids("host-a")) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        job.kill()
        bed.reconnect("host-b")
    text = job.text
    assert codes["host-a"] != 0, text
    assert not left, f"processes left running on host-a after its torchrun ended: {left}\n{text}"
    # host-a's survivors race at the deadline: the first to time out raises and its process ends,
    # closing its connections; under torchrun another survivor may see that closed connection a
    # moment before its own deadline (torch's Gloo error, a CollectiveError naming the closed
    # connection) instead of its timeout. At least one times out, and every one raises at the
    # timeout, not before it.
    errors = {int(r): e for r, e in re.findall(r"PEER LOST rank=(\d+) after=[0-9.]+s: (\w+): all_reduce", text)
              if int(r) in survivors}
    assert sorted(errors) == survivors and "CollectiveTimeout" in errors.values(), text
    for rank, error in errors.items():
        assert error == "CollectiveTimeout" or (
            launcher == "torchrun" and error == "CollectiveError"
            and re.search(rf"PEER LOST rank={rank} .*connection closed", text)), text
    detected = [float(t) for t in re.findall(r"PEER LOST rank=\d+ after=([0-9.]+)s", text)]
    assert all(seconds - 0.5 <= t < seconds + 10 for t in detected), detected
    for rank in survivors:  # a timeout writes the rank's dump (a closed connection is caught by the script)
        if errors[rank] == "CollectiveTimeout":
            dump = json.loads((tmp_path / f"rank-{rank}.json").read_text())
            assert dump["reason"].startswith("CollectiveTimeout in all_reduce"), dump["reason"]
            assert dump["host"] == "host-a"
    print(f"TIMING host-b silent -> host-a's ranks raised after {max(detected):.2f} s "
          f"(COLLECTIVES_TIMEOUT={seconds}); {launcher} ({backend}) there ended {ended:.2f} s after the cut")
