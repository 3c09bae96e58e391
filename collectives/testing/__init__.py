"""Test collectives (ours and yours) on real ranks from pytest and Hypothesis::

    import numpy as np
    from collectives.testing import get_pool

    def job(comm, x):                 # a module-level function: runs on every rank
        return comm.all_reduce(x)

    def test_sum():
        pool = get_pool("mpi", 4)     # mpiexec -n 4, started once per session, then warm
        results = pool.run(job, [(np.full(3, r),) for r in range(4)])   # one entry per rank

What lives here:

- :class:`RankPool` / :func:`get_pool`: N ranks of a backend started with the real launcher
  (mpiexec, torchrun, or none for local) that run jobs ``fn(comm, *args)`` sent by the
  test process and send back per-rank results. A job that raises comes back as
  :class:`RankError` with every failing rank's traceback; one that hangs past its
  timeout or kills its rank is :class:`RankTimeout` / :class:`RankCrashed`, and the pool
  restarts on the next job. :func:`worlds` / :func:`cpu_backends`: the backends of the
  registry that run without a GPU, as test parameters.
- The pytest plugin (:mod:`.plugin`, opt-in: ``pytest_plugins = ["collectives.testing.plugin"]``
  in your conftest.py, or ``pytest -p collectives.testing.plugin``): the ``world`` fixture,
  the Hypothesis profiles ``ci`` / ``dev`` (``COLLECTIVES_HYPOTHESIS_PROFILE``), and a check
  that no pool process outlives the session.
- :mod:`.strategies` (needs hypothesis; imported explicitly): dtypes, ops, shapes,
  per-rank arrays with edge values, roots, world sizes.
- :mod:`.reference`: numpy references and error bounds for reductions, and the
  conversions between the numpy arrays tests draw and the arrays ranks use.

Nothing here imports a transport or hypothesis; the ranks import their transport.
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
    cpu_backends,
    get_pool,
    worlds,
)
from .reference import as_array, check_reduction_result, reference_reduce, same_bits, to_numpy

__all__ = [
    "LAUNCHERS",
    "PoolError",
    "RankCrashed",
    "RankError",
    "RankPool",
    "RankTimeout",
    "RemoteError",
    "as_array",
    "check_reduction_result",
    "close_all_pools",
    "cpu_backends",
    "get_pool",
    "reference_reduce",
    "same_bits",
    "to_numpy",
    "worlds",
]
