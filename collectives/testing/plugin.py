"""pytest plugin: the ``world`` fixture and the project's Hypothesis profiles.

Opt-in, so that installing the package changes no other project's pytest runs (it loads a
Hypothesis profile): enable it in your ``conftest.py`` with
``pytest_plugins = ["collectives.testing.plugin"]``, or per run with
``pytest -p collectives.testing.plugin``.

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
"""

from __future__ import annotations

import os

import pytest

from .. import config
from .pool import RankPool, close_all_pools, get_pool

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


def pytest_sessionfinish(session: pytest.Session) -> None:
    close_all_pools()
