"""The torch transport's handle as the call path waits on it (``_TorchWork.wait_for``), against
torch's own Work semantics: ``Work.wait(timeout)`` raises "Operation timed out!" when the call is
not done at the deadline, and the process group's thread may complete it a moment later."""

from __future__ import annotations

import datetime

import torch  # noqa: F401  (the handle's wait() uses the loaded torch)
from collectives.backends.torch_handles import _TorchWork


class _CompletesAtItsDeadline:
    """A torch Work whose call completes just after ``wait(timeout)`` gave up on it (the race)."""

    def __init__(self) -> None:
        self.completed = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and not self.completed:
            self.completed = True  # the process group's thread, a moment late
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return self.completed


class _NeverCompletes(_CompletesAtItsDeadline):
    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        raise RuntimeError("Operation timed out!")


class _Fails(_CompletesAtItsDeadline):
    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.completed = True
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")


def test_a_call_that_completes_as_the_slice_ends_is_complete_not_timed_out() -> None:
    work = _TorchWork("x", _CompletesAtItsDeadline())
    assert work.wait_for(0.05) is True
    assert work.wait() == "x"


def test_a_call_still_running_at_the_end_of_a_slice_is_not_complete() -> None:
    assert _TorchWork("x", _NeverCompletes()).wait_for(0.05) is False


def test_a_failed_call_raises_its_error_from_the_wait() -> None:
    work = _TorchWork("x", _Fails())
    try:
        work.wait_for(0.05)
    except RuntimeError as error:
        assert "Connection closed" in str(error)
    else:
        raise AssertionError("the failure was not raised")
