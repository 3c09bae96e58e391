"""Test real ranks from pytest: a pool of ranks started once with the real launcher.

    from collectives.testing import get_pool

    def job(comm, x):                 # runs on every rank
        return comm.all_reduce(x)

    def test_sum():
        pool = get_pool("mpi", 4)     # mpiexec -n 4, started once per session
        results = pool.run(job, [(np.full(3, r),) for r in range(4)])

Nothing here imports a transport; the ranks do.
"""

from .pool import (
    LAUNCHERS,
    PoolError,
    RankCrashed,
    RankError,
    RankPool,
    RankTimeout,
    RemoteError,
    close_all_pools,
    get_pool,
)

__all__ = [
    "LAUNCHERS",
    "PoolError",
    "RankCrashed",
    "RankError",
    "RankPool",
    "RankTimeout",
    "RemoteError",
    "close_all_pools",
    "get_pool",
]
