"""The default check of calls on device streams, made beside the calls: :class:`PostedChecks`.

A blocking NCCL call returns once it is enqueued on the caller's stream; a check made before it
(one small CPU all_reduce of the check word) would make the host wait for every peer before every
call. Instead the call path posts the call's check word (``Transport._post_check``: the word, the call's number and
its kind, a tuple made once per kind of call, put on a queue, nothing else: nothing made per call
outlives it, so the calls in flight do not wake the garbage collector), and the process's one watchdog thread
(backends/stream_watch.py) compares the ranks' words in call order, every
:data:`~.stream_watch.PERIOD_SECONDS`, over a CPU channel of the transport's ranks made for it (so
its rounds never meet the user's calls): the :class:`Rounds` of a Gloo group (:class:`TorchRounds`:
the torch route with NCCL) or of an MPI communicator (:class:`MPIRounds`: the cupy route under an
MPI launcher).

- a round is one asynchronous all_reduce (MIN) of ``[n, want, w_0 .. w_{C-1}, -w_0 .. -w_{C-1}]``,
  this rank's first ``n`` (at most the round's capacity ``C``) posted words and the capacity it
  wants next (its queue's length): every rank learns the least ``n`` and, for each of those calls,
  the least and the greatest word (equal when every rank made the same call). The calls compared
  leave the queue; a rank posts its next round once the last completed and it has words left, so
  the ranks' rounds pair up in order. The next round's capacity comes from the least ``want``
  (a power of two from :data:`ROUND_CALLS` to :data:`MOST_ROUND_CALLS`), which every rank reads
  from the same result: a backlog is compared in fewer, larger rounds;
- where the words of a call differ, one asynchronous all_gather of that call's fingerprint
  and reason (:mod:`collectives.wire`) names the ranks and the difference: the communicator
  gets the :class:`~collectives.CollectiveMismatch` (``CallContext.fail_later``: its next call or
  ``wait()`` raises it) and its NCCL communicators are aborted (the mismatched calls may never end).

Every rank sees the same rounds, so every rank finds the same mismatch. The bound: a mismatch is
found at most two periods (0.1 s) plus two CPU rounds after the last rank made the call, while
a program posts fewer than :data:`ROUND_CALLS` calls a period (more wait in the queue for the
next rounds, which grow to take up to :data:`MOST_ROUND_CALLS` calls each). A peer that never
makes its call leaves the round waiting: that call's timeout is the transport's own.

Imports: the interface (errors, transport), numpy, stream_watch; no transport (the rounds are handed the
transport's module and group or communicator).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from collectives.errors import CollectiveError
from collectives.ops import ReduceOp
from collectives.transport import Transport

from . import stream_watch

#: Calls the first round of the watchdog compares at most (the least capacity of a round).
ROUND_CALLS = 1024
#: Calls a round compares at most once a backlog has made the rounds grow (a 1 MiB all_reduce).
MOST_ROUND_CALLS = 1 << 16

#: What a posted check's fingerprint says of its kind of call: (operation, reduce op, root, dtype,
#: shape, refused); one tuple per kind of call, made once (``CallCheck.post``), or per refused call.
PostedKind = tuple[str, ReduceOp | None, int, str | None, tuple[int, ...], Exception | None]
#: The fields of one posted check on the queue, one after another: its word, its number, its kind.
POSTED_FIELDS = 3


class Round(Protocol):
    """A round in flight on a CPU channel (a torch ``Work``, an MPI request)."""

    def is_completed(self) -> bool: ...

    def wait(self) -> None: ...


class Rounds(Protocol):
    """The two asynchronous CPU collectives the posted checks need, over the ranks of one
    transport (in its rank order), on int64 numpy arrays that stay alive until the round ends."""

    def least(self, words: np.ndarray) -> Round:
        """The element-wise MIN of every rank's ``words``, in place."""
        ...

    def gather(self, mine: np.ndarray, everyone: np.ndarray) -> Round:
        """Every rank's ``mine`` into the rows of ``everyone`` (``(size, len(mine))``)."""
        ...


class TorchRounds:
    """:class:`Rounds` over a torch process group or Gloo backend (``group``: the torch route's
    Gloo group, or the cupy route's ``ProcessGroupGloo`` under torchrun): its own asynchronous
    calls, on tensors sharing the arrays' memory."""

    def __init__(self, torch: Any, group: Any) -> None:
        self._torch, self._group = torch, group
        self._min = torch.distributed.ReduceOp.MIN
        self._words: tuple[Any, Any] = (None, None)  # (the words' array, its tensor): one per capacity

    def least(self, words: np.ndarray) -> Any:
        if self._words[0] is not words:
            self._words = (words, self._torch.from_numpy(words))
        return self._group.allreduce([self._words[1]], self._min)

    def gather(self, mine: np.ndarray, everyone: np.ndarray) -> Any:
        from_numpy = self._torch.from_numpy
        return self._group._allgather_base(from_numpy(everyone), from_numpy(mine)[None])


class MPIRounds:
    """:class:`Rounds` over an mpi4py communicator of the transport's ranks (its own duplicate:
    MPI's nonblocking collectives, which the watchdog thread tests)."""

    def __init__(self, MPI: Any, comm: Any) -> None:  # noqa: N803  (mpi4py's module name)
        self._MPI, self._comm = MPI, comm

    def least(self, words: np.ndarray) -> Any:
        return _MPIRound(self._comm.Iallreduce(self._MPI.IN_PLACE, words, op=self._MPI.MIN))

    def gather(self, mine: np.ndarray, everyone: np.ndarray) -> Any:
        return _MPIRound(self._comm.Iallgather(mine, everyone))

    def free(self) -> None:
        self._comm.Free()


class _MPIRound:
    __slots__ = ("_request",)

    def __init__(self, request: Any) -> None:
        self._request = request

    def is_completed(self) -> bool:
        return bool(self._request.Test())

    def wait(self) -> None:
        self._request.Wait()


class PostedChecks:
    """The checks posted by one transport (:meth:`post`), compared with every rank's in
    ``rounds`` (a CPU channel of the same ranks, ``size`` of them, made for it) by the watchdog
    thread (:meth:`tick`). ``failed(error)``: a mismatch was found (the transport makes it the
    communicator's failure and aborts); ``mismatch(everyone, reasons, call)``: the error of the
    call whose words differ (``CallContext.posted_mismatch``)."""

    def __init__(self, rounds: Rounds, size: int,
                 mismatch: Callable[[Any, Any, tuple[str, int]], Exception | None],
                 failed: Callable[[Exception], None]) -> None:
        self._rounds, self._size = rounds, size
        self._mismatch, self._failed = mismatch, failed
        # (word, number, kind) of each posted check, flat: a check adds no object of its own
        self._queue: collections.deque[Any] = collections.deque()
        #: (The call path's thread.) One call's check, ``(word, seq, kind)`` (kind: a
        #: :data:`PostedKind`), in call order: the queue's own extend (no frame; the tuple
        #: passed dies with the call, its fields stay on the queue).
        self.post: Callable[[tuple[int, int, PostedKind]], None] = self._queue.extend
        self._capacity = 0  # (the calls a round compares at most, as every rank agreed: _resize)
        self._resize(ROUND_CALLS)
        self._work: Round | None = None  # the round in flight
        self._named: np.ndarray | None = None  # the fingerprints' round's result, while it is in flight
        self._mine: np.ndarray | None = None  # (this rank's fingerprint, alive while its round is)
        self._lock = threading.Lock()
        #: Whether a mismatch (or a failed round) was found: nothing is compared after it.
        self.failed = False
        #: Rounds completed (of words and of fingerprints).
        self.rounds = 0


    def idle(self) -> bool:
        """Whether every posted check was compared (or a mismatch found)."""
        return self.failed or (self._work is None and not self._queue)

    def tick(self) -> None:
        """(The watchdog's thread.) Take the round in flight if it completed, then post the next."""
        with self._lock:
            if self.failed:
                return
            try:
                self._step()
            except Exception as error:  # noqa: BLE001  (a round failed: a peer left or died)
                self._fail(CollectiveError(f"the check of the calls on a device stream failed: {error}"))

    def _step(self) -> None:
        work = self._work
        if work is not None:
            if not work.is_completed():
                return
            work.wait()
            self._work = None
            self.rounds += 1
            if self._named is None:
                self._compared()
            else:
                self._found()
            if self.failed or self._work is not None:
                return
        if self._queue:
            self._post_words()

    def _resize(self, capacity: int) -> None:
        """The words' array and tensor for rounds of ``capacity`` calls (one round at a time)."""
        if capacity != self._capacity:
            self._capacity = capacity
            self._words = np.zeros(2 + 2 * capacity, dtype=np.int64)

    def _post_words(self) -> None:
        queue, words, capacity = self._queue, self._words, self._capacity
        posted = len(queue) // POSTED_FIELDS  # (a check's fields go on in one extend)
        n = min(posted, capacity)
        words[0], words[1] = n, posted
        for i in range(n):
            word = queue[POSTED_FIELDS * i]
            words[2 + i] = word
            words[2 + capacity + i] = -word
        self._work = self._rounds.least(words)

    def _compared(self) -> None:
        """The words' round completed: drop the calls that every rank made alike; at the first
        that differs, post the round of its fingerprints. The next rounds' capacity: the least
        wanted, as a power of two (every rank reads the same)."""
        words, queue, capacity = self._words, self._queue, self._capacity
        n, want = int(words[0]), int(words[1])
        differ = np.flatnonzero(words[2:2 + n] != -words[2 + capacity:2 + capacity + n])
        agreed = n if not differ.size else int(differ[0])
        for _ in range(agreed * POSTED_FIELDS):
            queue.popleft()
        self._resize(min(max(ROUND_CALLS, 1 << max(want - 1, 0).bit_length()), MOST_ROUND_CALLS))
        if differ.size:
            self._post_fingerprint(queue[1], queue[2])

    def _post_fingerprint(self, seq: int, kind: PostedKind) -> None:
        from collectives.wire import LENGTH, fingerprint, reason_vector  # noqa: PLC0415

        operation, reduce_op, root, dtype, shape, refused = kind
        mine = np.concatenate([fingerprint(operation, seq, reduce_op, root, dtype, shape, 1, refused),
                               reason_vector(refused)])
        self._mine, self._named = mine, np.empty((self._size, len(mine)), dtype=np.int64)
        self._fingerprint_length = LENGTH
        self._work = self._rounds.gather(mine, self._named)

    def _found(self) -> None:
        """The fingerprints' round completed: the mismatch (or, where every rank refused the
        call, each raised its own error: the next calls are compared)."""
        queue = self._queue
        _, seq, kind = queue.popleft(), queue.popleft(), queue.popleft()
        everyone, self._named, self._mine = self._named, None, None
        assert everyone is not None
        length = self._fingerprint_length
        error = self._mismatch(everyone[:, :length], everyone[:, length:], (kind[0], seq))
        if error is not None:
            self._fail(error)

    def _fail(self, error: Exception) -> None:
        self.failed = True
        self._queue.clear()
        self._failed(error)

    def settle(self, seconds: float) -> bool:
        """(The caller's thread, at close.) Wait up to ``seconds`` for every posted check to be
        compared; whether they were."""
        from collectives.context import poll_until  # noqa: PLC0415
        from collectives.diagnostics.recorder import clock  # noqa: PLC0415

        def settled() -> bool:
            self.tick()  # (this thread drives the rounds too: no period's wait)
            return self.idle()

        return poll_until(settled, clock() + seconds)

    def start(self) -> None:
        """The watchdog thread looks at these checks from now on."""
        stream_watch.look_after(self)

    def stop(self) -> None:
        """The watchdog stops looking (its thread ends with the last thing it looks at)."""
        stream_watch.unwatch(self)


class PostingTransport(Transport):
    """A transport whose default check of a call on a device stream is posted beside the call
    (``_posts_checks``): each check goes to its :class:`PostedChecks`, made at the first (the same
    call on every rank) on the rounds of a CPU channel of its ranks (:meth:`_posting_rounds`); a
    mismatch found is :meth:`_posted_failed`'s."""

    #: The checks posted (made by the first; None before, and once stopped).
    _posted: PostedChecks | None = None

    def _post_check(self, word: int, operation: str, seq: int, reduce_op: ReduceOp | None,
                    root: int, dtype: str | None, shape: tuple[int, ...],
                    refused: Exception | None = None) -> None:
        posted = self._posted or self._start_posting()
        posted.post((word, seq, (operation, reduce_op, root, dtype, shape, refused)))

    def _start_posting(self) -> PostedChecks:
        self._posted = posted = PostedChecks(self._posting_rounds(), self.size, self.context.posted_mismatch,
                                             self._posted_failed)
        self._post_to = posted.post
        posted.start()
        return posted

    def _posting_rounds(self) -> Rounds:
        """The rounds of the CPU channel the posted checks travel on (made here, at the first)."""
        raise NotImplementedError(f"{type(self).__name__} posts no checks")

    def _posted_failed(self, error: Exception) -> None:
        """(The watchdog's thread.) A posted check found ``error``: the communicator's next call
        or wait raises it; the transport aborts its calls on device streams (the mismatched calls
        may never end)."""
        raise NotImplementedError(f"{type(self).__name__} posts no checks")
