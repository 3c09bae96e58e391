"""pytest plugin (registered by the package's ``pytest11`` entry point): the ``world`` fixture.

    @pytest.mark.parametrize("world", [("mpi", 4), ("torch", 2)], indirect=True)
    def test_something(world):
        results = world.run(job, ...)

``world`` is a started :class:`~collectives.testing.RankPool` shared by every test
that asks for the same (backend, size[, launcher]); without parametrization it is
``COLLECTIVES_TEST_BACKEND`` (default mpi) with ``COLLECTIVES_TEST_SIZE`` (default 2) ranks.
"""

from __future__ import annotations

import os

import pytest

from .pool import close_all_pools, get_pool


# Session scope: pytest then orders the tests so that those sharing a world run together,
# and each pool starts once.
@pytest.fixture(scope="session")
def world(request: pytest.FixtureRequest):
    param = getattr(request, "param", None)
    if param is None:
        param = (os.environ.get("COLLECTIVES_TEST_BACKEND", "mpi"),
                 int(os.environ.get("COLLECTIVES_TEST_SIZE", 2)))
    return get_pool(*param)


def pytest_sessionfinish(session: pytest.Session) -> None:
    close_all_pools()
