"""pytest plugin: the ``world`` fixture, the project's Hypothesis profiles, and a check at
the end of the session that no process of a rank pool outlived it.

It is opt-in, so that it never changes the test runs of other projects that share the
environment: in your ``conftest.py`` (the top-level one)::

    pytest_plugins = ["collectives.testing.plugin"]

or ``pytest -p collectives.testing.plugin``. Then::

    @pytest.mark.parametrize("world", [("mpi", 4), ("torch", 2)], indirect=True)
    def test_something(world):
        results = world.run(job, [(x0,), (x1,), ...])   # job(comm, x_r) on rank r

``world`` is a started :class:`~collectives.testing.RankPool`: its parameter is
``(backend, size)`` or ``(backend, size, launcher)``. Every test that asks for the same
parameter shares one warm pool (see :func:`~collectives.testing.get_pool`); a pool that a
job crashed or hung is restarted by the next job. Without a parameter, ``world`` is
``COLLECTIVES_TEST_BACKEND`` (default mpi) with ``COLLECTIVES_TEST_SIZE`` (default 2) ranks.

The fixture is session-scoped, so pytest orders the session's tests world by world
and no more pools are alive at once than needed.

When hypothesis is installed, the profiles of :mod:`collectives.testing.strategies`
(``ci``, ``dev``) are registered and ``COLLECTIVES_HYPOTHESIS_PROFILE`` (default ``ci``)
is loaded as soon as pytest loads this plugin; ``--hypothesis-profile=NAME`` still wins.

At the end of the session every shared pool is closed; if a process any pool started (a
launcher or a rank: its environment carries the pool's key) is still alive, it is killed,
named, and the session fails.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from .. import config
from .pool import RankPool, close_all_pools, describe_processes, get_pool, leftover_processes

try:  # hypothesis is a test dependency, not a dependency of collectives.testing
    from . import strategies as _strategies
except ImportError:  # pragma: no cover - without hypothesis there is nothing to register
    _strategies = None  # type: ignore[assignment]
else:
    _strategies.load_profile()


# Session scope: pytest then orders the tests so that those sharing a world run together,
# and each pool starts once.
@pytest.fixture(scope="session")
def world(request: pytest.FixtureRequest) -> RankPool:
    """A warm pool of real ranks: ``(backend, size[, launcher])`` from ``indirect`` parametrization."""
    param = getattr(request, "param", None)
    if param is None:
        param = (os.environ.get(config.TEST_BACKEND, "mpi"),
                 int(os.environ.get(config.TEST_SIZE, 2)))
    return get_pool(*param)


#: Seconds the session's check gives a killed pool's processes to disappear.
LEFTOVER_GRACE = 5.0


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Close the shared pools, then fail the session if any process a pool started (its
    launcher or a rank: their environment carries the pool's key) is still alive."""
    close_all_pools()
    left = pool_processes_still_alive(LEFTOVER_GRACE)
    if not left:
        return
    description = describe_processes(left)
    for pid in left:  # do not leave them behind either
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    message = (f"collectives.testing: {len(left)} process(es) started by the rank pools outlived "
               f"them (killed now; a bug in the pool's cleanup):\n{description}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("!", "leftover rank-pool processes", red=True, bold=True)
        reporter.write_line(message)
    else:
        sys.stderr.write(message + "\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pool_processes_still_alive(grace: float) -> list[int]:
    """The pools' processes still alive after up to ``grace`` seconds (SIGKILLed ones need
    a moment to go)."""
    deadline = time.monotonic() + grace
    while (left := leftover_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
