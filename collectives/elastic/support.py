"""Which transports can go on after a rank dies, in one place: the refusals name what works."""

from __future__ import annotations

from ..errors import BackendUnavailable

#: What works, as every refusal says it.
WHAT_WORKS = (
    "fault tolerance works on the torch backend (Gloo) in a job started by collectives-elastic "
    "(`collectives-elastic -n 4 --min 2 python train.py`: its membership store outlives the "
    "ranks), and on the mpi backend with Open MPI 5's ULFM (`collectives-elastic --mpi -n 4 "
    "python train.py`, or `mpirun --with-ft ulfm`)")

#: Why a transport cannot, by backend name.
WHY_NOT = {
    "cupy": "the cupy backend cannot: NCCL's communicator abort and shrink are not proven here",
    "local": "the local backend has one rank: no peer can fail",
}


def refuse(backend: str, what: str, why: str = "") -> BackendUnavailable:
    """The error for ``what`` (``"shrink()"``, ``"init(fault_tolerant=True)"``) on ``backend``."""
    reason = why or WHY_NOT.get(backend) or (
        f"this {backend} communicator is not fault-tolerant (made without "
        "collectives.init(fault_tolerant=True) / COLLECTIVES_FAULT_TOLERANT=1)")
    return BackendUnavailable(f"{what} needs a fault-tolerant communicator: {reason}; {WHAT_WORKS}")
