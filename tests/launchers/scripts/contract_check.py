"""The public contract checked against numpy on every rank: every allowed (op, dtype) of
all_reduce and reduce_scatter, broadcast from every root, all_gather, barrier, and split (by
host and across hosts). Run under a launcher; prints two lines per rank and exits 1 on any
mismatch:

    rank R/N backend=B checked=K failures=[...]
    PLACE rank=R host=H local_rank=L local_size=S host_ranks=[...]

    mpiexec -n 3 python tests/launchers/scripts/contract_check.py
    torchrun --nproc_per_node 3 tests/launchers/scripts/contract_check.py

A new collective gets a ``check_<name>(comm) -> (checked, failures)`` function in CHECKS.
"""

from __future__ import annotations

import os
import socket
import sys
import zlib

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "collective_calls"))  # grid.py
from grid import allowed_pairs, dtypes_for, make_input, tolerance  # noqa: E402

import collectives  # noqa: E402
from collectives.launcher import detect_launcher  # noqa: E402
from collectives.testing.reference import as_array, reference_reduce, to_numpy  # noqa: E402

KINDS = ("torch", "numpy")


def kinds_for(dtype):
    return [kind for kind in KINDS if dtype in dtypes_for(kind)]


def matches(got, inputs, dtype, op, ref):
    tol = tolerance(inputs, dtype, op, ref)
    if tol.any():
        return bool(np.all(np.abs(got.astype(np.float64) - ref) <= tol))
    return np.array_equal(got, ref)


def check_all_reduce(comm):
    failures = []
    for dtype, op in allowed_pairs():
        for kind in kinds_for(dtype):
            inputs = [make_input(7, r, dtype, op) for r in range(comm.size)]
            got = to_numpy(comm.all_reduce(as_array(inputs[comm.rank], dtype, kind), op.value))
            if not matches(got, inputs, dtype, op, reference_reduce(inputs, dtype, op)):
                failures.append(f"all_reduce {kind} {dtype} {op}")
    return len(allowed_pairs()), failures


def check_reduce_scatter(comm):
    failures = []
    shape = (2 * comm.size, 3)  # two rows for each rank
    for dtype, op in allowed_pairs():
        for kind in kinds_for(dtype):
            inputs = [make_input(8, r, dtype, op, shape) for r in range(comm.size)]
            got = to_numpy(comm.reduce_scatter(as_array(inputs[comm.rank], dtype, kind), op.value))
            mine = slice(2 * comm.rank, 2 * comm.rank + 2)
            ref = reference_reduce(inputs, dtype, op)[mine]
            if not matches(got, [x[mine] for x in inputs], dtype, op, ref):
                failures.append(f"reduce_scatter {kind} {dtype} {op}")
    return len(allowed_pairs()), failures


def check_broadcast(comm):
    failures = []
    checked = 0
    for src in range(comm.size):
        for dtype in dtypes_for("torch"):
            for kind in kinds_for(dtype):
                inputs = [make_input(9 + src, r, dtype, None) for r in range(comm.size)]
                got = to_numpy(comm.broadcast(as_array(inputs[comm.rank], dtype, kind), src))
                checked += 1
                if not np.array_equal(got, inputs[src]):
                    failures.append(f"broadcast {kind} {dtype} src={src}")
    return checked, failures


def check_all_gather(comm):
    failures = []
    for dtype in dtypes_for("torch"):
        for kind in kinds_for(dtype):
            inputs = [make_input(10, r, dtype, None) for r in range(comm.size)]
            got = to_numpy(comm.all_gather(as_array(inputs[comm.rank], dtype, kind)))
            if not np.array_equal(got, np.stack(inputs)):
                failures.append(f"all_gather {kind} {dtype}")
    return len(dtypes_for("torch")), failures


def check_barrier(comm):
    comm.barrier()
    return 1, []


def host_ranks(comm):
    """The global ranks on each host (gathered as crc32s of the hostnames: plain integers)."""
    ids = to_numpy(comm.all_gather(np.array([zlib.crc32(socket.gethostname().encode())], np.int64)))[:, 0]
    return ids, [r for r in range(comm.size) if ids[r] == ids[comm.rank]]


def check_split(comm):
    """One communicator per host (color: the host), and one across hosts (color: local rank,
    key: reversed global rank), each checked by an all_reduce of the global ranks."""
    failures = []
    ids, mine = host_ranks(comm)
    hosts = sorted(set(ids.tolist()))
    same_host = comm.split(hosts.index(ids[comm.rank]))
    x = np.array([comm.rank], np.int64)
    if (same_host.size, same_host.rank) != (len(mine), mine.index(comm.rank)) \
            or same_host.all_reduce(x.copy())[0] != sum(mine):
        failures.append(f"split by host: rank {same_host.rank}/{same_host.size}, host ranks {mine}")
    across = comm.split(comm.local_rank, key=-comm.rank)
    local_ranks = to_numpy(comm.all_gather(np.array([comm.local_rank], np.int64)))[:, 0]
    peers = sorted((r for r in range(comm.size) if local_ranks[r] == comm.local_rank), reverse=True)
    if (across.size, across.rank) != (len(peers), peers.index(comm.rank)) \
            or across.all_reduce(x.copy())[0] != sum(peers) \
            or to_numpy(across.all_gather(x))[:, 0].tolist() != peers:
        failures.append(f"split across hosts: rank {across.rank}/{across.size}, want order {peers}")
    for sub in (same_host, across):
        sub.close()
    return 2, failures


def check_local_rank(comm):
    """local_rank is the launcher's (what every backend uses), and numbers the ranks of each
    host 0..n-1 (in rank order under MPICH and torchrun; Open MPI's mapping may permute them)."""
    failures = []
    launch = detect_launcher()
    if launch.launcher is not None and comm.local_rank != launch.local_rank:
        failures.append(f"local_rank {comm.local_rank}, but the launcher says {launch.local_rank}")
    ids, mine = host_ranks(comm)
    local_ranks = to_numpy(comm.all_gather(np.array([comm.local_rank], np.int64)))[:, 0]
    if sorted(local_ranks[r] for r in mine) != list(range(len(mine))):
        failures.append(f"local ranks on this host {[int(local_ranks[r]) for r in mine]} are not 0..{len(mine) - 1}")
    if launch.local_size is not None and launch.local_size != len(mine):
        failures.append(f"local_size {launch.local_size}, but {len(mine)} ranks on this host")
    return 1, failures


# name -> check; each returns (how many cases it checked, failure descriptions).
CHECKS = {
    "all_reduce": check_all_reduce,
    "reduce_scatter": check_reduce_scatter,
    "broadcast": check_broadcast,
    "all_gather": check_all_gather,
    "barrier": check_barrier,
    "split": check_split,
    "local_rank": check_local_rank,
}


def main() -> int:
    comm = collectives.init()
    checked, failures = 0, []
    for check in CHECKS.values():
        count, failed = check(comm)
        checked += count
        failures += failed
    _, mine = host_ranks(comm)
    print(f"rank {comm.rank}/{comm.size} backend={comm.backend} checked={checked} failures={failures}",
          flush=True)
    print(f"PLACE rank={comm.rank} host={socket.gethostname()} local_rank={comm.local_rank} "
          f"local_size={detect_launcher().local_size} host_ranks={mine}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
