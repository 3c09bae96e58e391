"""The torch backend's process group as a channel: what every collective of
:class:`collectives.backends.torch_dist.TorchTransport` relies on.

:class:`TorchGroup` holds the torch.distributed process group, the map between this
transport's rank order (a split's key) and torch's, and torch's reduce ops; it maps torch's
errors (its timeouts, a peer's closed connection), carries the default check's word (and posts
that of a call on a CUDA stream, compared beside it: backends/posted_checks.py), watches the calls
on CUDA streams against their timeout (backends/torch_watch.py, stream_watch.py), the farewells
(keys in torch's store), the barrier, Gloo's monitored barrier and the group's release. The
collectives, the tensors they take and the split are the subclass's, in backends/torch_dist.py.

Imports: the interface (errors, farewell, launcher, ops, transport) and the torch backend's
helper modules (torch_bootstrap, posted_checks, torch_handles, torch_watch, stream_watch); never
backends/torch_dist.py.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

from collectives import arrays, farewell
from collectives.calls import ALL_GATHER, Request
from collectives.context import LISTEN_SLICE
from collectives.errors import BackendUnavailable, CollectiveError, CollectiveTimeout
from collectives.ops import ReduceOp

from .posted_checks import PostedChecks, PostingTransport, TorchRounds
from .stream_watch import StreamWatch, unwatch, watch
from .torch_bootstrap import (
    created_groups,
    group_named,
    import_torch_distributed,
    planning,
    posting,
    store_said,
    torch_timeout,
    watching,
)
from .torch_handles import _cupy_stream_as_torch, _TorchWork, launch_batch, raise_mapped
from .torch_watch import WORKS, CudaEvents

#: Up to this many ranks an uneven collective's counts, and a small call's data, travel in the
#: default check's round (one all_to_all of ``size + 2`` int64 and CARRY_BYTES a pair of ranks).
COUNTS_RANKS = 8
#: The bytes of a call's x that travel in the check's round at most (backends/torch_carried.py).
CARRY_BYTES = 1024
#: The same at 2 ranks, where Gloo's all_to_all of 4 KiB blocks takes what one of 1 KiB does.
PAIR_CARRY_BYTES = 4096
#: The first wait of a check's round (torch's own, a condition variable), then polled.
_LISTEN_SLICE = datetime.timedelta(seconds=LISTEN_SLICE)


class TorchGroup(PostingTransport):
    """A torch.distributed process group (default: the world group) as a transport's channel."""

    backend = "torch"

    def __init__(self, group: Any = None, ranks: list[int] | None = None,
                 local_rank: int | None = None) -> None:
        """``group``: a torch ProcessGroup (None: the default group). ``ranks``: the
        group's global ranks in this transport's rank order (None: torch's order)."""
        import torch  # noqa: PLC0415

        dist = import_torch_distributed()
        if not dist.is_initialized():
            raise BackendUnavailable("torch.distributed is not initialized; use "
                                     "collectives.init('torch') or TorchCommunicator.from_launcher")
        self._torch = torch
        self._dist = dist
        self._group = group
        group_ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        # torch orders a group's ranks by global rank; ours may differ (split's key).
        self._global_ranks = list(group_ranks) if ranks is None else list(ranks)
        # Position in torch's order for each of our ranks.
        torch_order = sorted(group_ranks) if ranks is not None else list(group_ranks)
        self._torch_rank = [torch_order.index(g) for g in self._global_ranks]
        # Whether our rank order (split's key) differs from torch's order of the group's ranks
        # (ascending global rank), where torch places rows and blocks: all_gather then puts
        # the rows in ours, reduce_scatter hands torch x's blocks in its order, and the
        # collectives whose rows go to or come from given ranks take the emulations.
        self._reordered = self._torch_rank != list(range(len(self._torch_rank)))
        # The default check is a CPU all_reduce: a group with no CPU transport (NCCL alone)
        # checks only with COLLECTIVES_DEBUG=1. On a group with NCCL beside Gloo, the check of
        # a call on a CUDA stream goes beside it (backends/posted_checks.py).
        backend = str(dist.get_backend(group)).lower()
        self._checks_by_default = backend != "nccl"
        self._has_nccl = "nccl" in backend
        self._posts_checks = self._has_nccl and self._checks_by_default
        # Whether a stream-ordered call (a CUDA tensor's, on NCCL) is watched against its timeout
        # beside it (backends/torch_watch.py) instead of by torch's NCCL watchdog.
        self._watches_streams = self._has_nccl
        self._posted: PostedChecks | None = None  # the checks posted (made by the first)
        self._posting_group: Any = None  # the Gloo group they travel over
        # The calls on CUDA streams in flight under a timeout (made by the first: see
        # torch_watch.watched), and the CUDA events recorded after them.
        self._stream_watch: StreamWatch | None = None
        self._events: Any = None
        me = self._global_ranks.index(dist.get_rank())
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", 0)) if ranks is None else 0
        super().__init__(me, len(self._global_ranks), local_rank)
        # The single-tensor forms (torch >= 2.12 names; the older ones are deprecated there).
        self._all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                                       or dist.reduce_scatter_tensor)
        # The timeout torch enforces on this group (a call's own timeout= may be shorter): the
        # communicator's when it takes the transport (see attach).
        self._group_timeout: float | None = None
        self._farewells_seen = 0  # the count of farewells in the store at the last look
        self._flags: dict[int, tuple[Any, Any]] = {}  # the check rounds' arrays and tensors (see _flag)
        self._counts_arrays: tuple[Any, ...] | None = None  # (see _counts_round)
        self._small_arrays: dict[int, tuple[Any, ...]] = {}  # (see _exchange_small)
        self._alltoall: tuple[Any, list[int], Any, Any] | None = None  # (see _all_to_all_base)
        self._barrier_flag: Any = None  # the barrier's zero (see _barrier)
        self._band = dist.ReduceOp.BAND
        # On Gloo up to COUNTS_RANKS ranks the default check's round is an all_to_all of blocks that
        # carry the uneven collectives' counts and a small call's data (_carried_round), where the
        # round is this class's: the fault-tolerant transports' own rounds hold their failure handling.
        self._on_gloo = "gloo" in backend
        self._round_bytes = PAIR_CARRY_BYTES if self.size == 2 else CARRY_BYTES  # (the round's payload)
        self._counts_with_check = (self._on_gloo and 1 < self.size <= COUNTS_RANKS
                                   and type(self)._agree_word is TorchGroup._agree_word)
        self._name = "world"  # unique among communicators; split derives its children's
        self._splits = 0
        R = dist.ReduceOp
        self._ops = {ReduceOp.SUM: R.SUM, ReduceOp.AVG: R.SUM, ReduceOp.PROD: R.PRODUCT,
                     ReduceOp.MIN: R.MIN, ReduceOp.MAX: R.MAX, ReduceOp.BAND: R.BAND,
                     ReduceOp.BOR: R.BOR, ReduceOp.BXOR: R.BXOR}

    def attach(self, context: Any, timeout: float | None) -> None:
        super().attach(context, timeout)
        self._group_timeout = timeout  # the timeout the group was made with (torch enforces it)

    def _map_error(self, error: Exception) -> Exception | None:
        """torch's timeout errors become ``CollectiveTimeout``, its transport failures
        (a peer's connection closed: it died) ``CollectiveError``; the rest take the
        default mapping."""
        if self._failed_beside():  # (the NCCL backend aborted)
            return self.context.failure()
        if not isinstance(error, RuntimeError):
            return None
        text = str(error)
        first_line = text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__
        lowered = text.lower()
        # Gloo: "Timed out waiting 5000ms for recv operation to complete"; NCCL's
        # watchdog: "Watchdog caught collective operation timeout".
        if "timed out" in lowered or "timeout" in lowered:
            return self.context.timeout_error(detail="torch: " + first_line)
        dist_error = getattr(self._dist, "DistError", ())
        if isinstance(error, dist_error) or any(
                phrase in lowered for phrase in ("connection closed", "connection reset",
                                                 "broken pipe", "connection refused")):
            try:  # a peer that left said so before its connection closed
                self.context.hear_farewells()
            except CollectiveError as left:
                return left
            except Exception:  # noqa: BLE001 - the store went with that peer
                pass
            return CollectiveError(f"{self.context.call_name()} failed in torch.distributed (a peer rank "
                                   f"may have died): its connection closed, and it left no "
                                   f"farewell: {first_line}")
        return None

    @property
    def process_group(self) -> Any:
        """The torch ProcessGroup (None means the default group)."""
        return self._group

    def _agree_word(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        """The check's round: one all_reduce (BAND) of the transport's one int64 CPU tensor, or,
        where the uneven collectives' counts travel in the round (``_counts_with_check``), the
        round of :meth:`_agree_counts` with no row: every call's word travels in the same
        collective, so that a rank in another call meets it. Polled (:meth:`_await_round`);
        ``waiting()`` runs first."""
        if waiting is not None:
            waiting()
        if self._counts_with_check:
            return self._agree_counts(word, [])[0]
        word_array, flag = self._flag(1)
        word_array[0] = word
        self._await_round(_TorchWork(flag, self._dist.all_reduce(flag, op=self._band, group=self._group,
                                                                 async_op=True), transport=self))
        return int(word_array[0])

    def _agree_counts(self, word: int, row: list[int], view: Any = None) -> tuple[int, list[list[int]], Any]:
        """:meth:`_agree_word`'s AND and every rank's ``row`` (at most ``size + 1`` ints) from one
        :meth:`_carried_round` with no payload. ``view`` does not travel (the data moves in the
        call's own collective)."""
        if not row:
            return self._carried_round(word)[0], [], None
        first, head, rest, columns = self._row_columns(len(row))
        at = 1
        for count in row:  # (one int a column of the first block sent; the others copy them)
            first[at] = count
            at += 1
        rest[...] = head
        reduced, everyone = self._carried_round(word)
        if self._reordered:  # (everyone: the blocks in rank order, a copy)
            return reduced, everyone[:, 1:at].tolist(), None
        return reduced, columns.tolist(), None

    def _row_columns(self, n: int) -> tuple[Any, Any, Any, Any]:
        """Where a row of ``n`` ints goes in :meth:`_counts_round`'s blocks (from column 1): the
        first block sent, its row's columns, those of the other blocks sent, and those of every
        block received (torch's order); made once a row length, with the blocks."""
        blocks = self._counts_arrays or self._counts_round()
        found: tuple[Any, Any, Any, Any] | None = blocks[8].get(n)
        if found is None:
            mine, everyone = blocks[0], blocks[1]
            found = blocks[8][n] = (mine[0], mine[0, 1:1 + n], mine[1:, 1:1 + n], everyone[:, 1:1 + n])
        return found

    def _carried_round(self, word: int) -> tuple[int, Any]:
        """The check's round where it carries (``_counts_with_check``): one all_to_all of a block
        to every rank (:meth:`_counts_round`: the word, a row of ``size + 1`` int64 and
        ``_round_bytes`` of payload: :data:`CARRY_BYTES`, :data:`PAIR_CARRY_BYTES` at 2 ranks), on
        Gloo one small round, as an all_reduce of the word alone is. The caller wrote the row
        and the payload in the blocks it sends (:meth:`_agree_counts`, torch_carried). Returns
        the AND of the ranks' words and every rank's block as int64 (rank order)."""
        _, everyone, send, received, _, _, words, their_words, _ = self._counts_arrays or self._counts_round()
        words.fill(word)
        self._await_exchange(self._exchange(received, send))
        if self._reordered:  # (received in torch's order of the group's ranks)
            everyone = everyone[self._torch_rank]
        reduced = -1
        for each in their_words.tolist():
            reduced &= each
        return reduced, everyone

    def _counts_round(self) -> tuple[Any, ...]:
        """The blocks of :meth:`_carried_round`, ``(size, size + 2 + _round_bytes / 8)`` int64 sent
        and received, their tensors, the payloads' bytes in them, the words' column of each and
        the views of their rows' columns (by the row's length, :meth:`_row_columns`): made once
        (see :meth:`_flag`)."""
        found = self._counts_arrays
        if found is None:
            size, width = self.size, self.size + 2 + self._round_bytes // 8
            both, flag = self._flag(2 * size * width)
            mine, everyone = both[:size * width].reshape(size, width), both[size * width:].reshape(size, width)
            found = self._counts_arrays = (mine, everyone, flag[:size * width], flag[size * width:],
                                           mine[:, size + 2:].view("uint8"), everyone[:, size + 2:].view("uint8"),
                                           mine[:, 0], everyone[:, 0], {})
        return found

    def _exchange(self, received: Any, send: Any) -> Any:
        """Start the group's all_to_all of ``send`` (even splits) into ``received``; torch's handle
        (see :meth:`_all_to_all_base`)."""
        bound = self._alltoall or self._bind_all_to_all()
        return bound[0](received, send, bound[1], bound[1], bound[3])

    def _all_to_all_base(self, received: Any, send: Any, got: list[int], sent: list[int], async_op: bool) -> Any:
        """dist.all_to_all_single(received, send, got, sent, group, async_op) as torch's own
        ``alltoall_base`` of the group, bound once: dist's Python costs about as much host work as
        the call itself. A blocking call waited (None), as dist's; else torch's handle."""
        bound = self._alltoall or self._bind_all_to_all()
        work = bound[0](received, send, got, sent, bound[3] if async_op else bound[2])
        if async_op:
            return work
        work.wait()
        return None

    def _bind_all_to_all(self) -> tuple[Any, list[int], Any, Any]:
        c10d = self._dist.distributed_c10d
        group = self._group if self._group is not None else c10d._get_default_group()
        blocking, asynchronous = c10d.AllToAllOptions(), c10d.AllToAllOptions()
        if hasattr(asynchronous, "asyncOp"):  # (torch >= 2.7)
            blocking.asyncOp, asynchronous.asyncOp = False, True
        bound: tuple[Any, list[int], Any, Any] = (group.alltoall_base, [], blocking, asynchronous)
        self._alltoall = bound
        planning.add(self)  # (the bound method holds the group: dropped before it is destroyed)
        return bound

    def _await_exchange(self, work: Any) -> None:
        """The check's round, torch's ``work``, done: torch's own wait for at most LISTEN_SLICE
        first (a round takes well under it), else polled as :meth:`_await_round` does."""
        if self.timeout is None or self.timeout >= LISTEN_SLICE:
            try:
                work.wait(_LISTEN_SLICE)
            except RuntimeError as error:
                if "timed out" not in str(error).lower():
                    self._flags_abandoned()
                    raise_mapped(self, error)
            else:
                if (self._posted is not None or self._stream_watch is not None) and self._failed_beside():
                    raise self.context.failure()
                return
        self._await_round(_TorchWork(None, work, transport=self))

    def _await_round(self, work: _TorchWork) -> None:
        """The check's round ``work`` done, polled: a peer's farewell is heard while it waits, and
        a call's own ``timeout=`` (shorter than the group's, which torch enforces) is kept."""
        try:
            self.context.await_work(work, math.inf if self.timeout is None or self.timeout == self._group_timeout
                                    else self.timeout)
            work.wait()
        except BaseException:
            self._flags_abandoned()
            raise

    def _flags_abandoned(self) -> None:
        """A check's round failed or timed out while torch may still write its tensors: the next
        rounds take new ones."""
        self._flags.clear()
        self._counts_arrays = None
        self._small_arrays.clear()

    def _start_exchange_small(self, vector: Any) -> Any:
        """Every rank's int64 ``vector`` in one all_to_all (each rank sends its vector to every
        rank): on Gloo one small round, where a small all_gather, or an all_reduce of more than
        one element, takes about two. A group without Gloo (NCCL alone) takes the all_gather of
        the base class."""
        if not self._on_gloo:
            return self._all_gather(Request(ALL_GATHER, vector, arrays.NUMPY, "int64", async_op=True))
        import numpy as np  # noqa: PLC0415

        size, width = self.size, len(vector)
        mine, everyone = np.empty((size, width), dtype=np.int64), np.empty((size, width), dtype=np.int64)
        mine[:] = vector  # (the same row to every rank)
        work = self._exchange(self._torch.from_numpy(everyone), self._torch.from_numpy(mine))
        if not self._reordered:  # (else received in torch's order of the group's ranks)
            return _TorchWork(everyone, work, transport=self)
        ours = np.empty_like(everyone)

        def in_our_order() -> None:
            ours[:] = everyone[self._torch_rank]
        return _TorchWork(ours, work, in_our_order, transport=self)

    def _exchange_small(self, vector: Any) -> Any:
        """:meth:`_start_exchange_small`, waited: on Gloo through arrays and tensors made once
        per length (see :meth:`_flag`), the rows returned a copy."""
        if not self._on_gloo:
            return self._start_exchange_small(vector).wait()
        found = self._small_arrays.get(len(vector))
        if found is None:
            size, width = self.size, len(vector)
            both, flag = self._flag(2 * size * width)
            found = self._small_arrays[width] = (both[:size * width].reshape(size, width), flag[:size * width],
                                                 both[size * width:].reshape(size, width), flag[size * width:])
        mine, send, everyone, received = found
        mine[:] = vector
        work = self._exchange(received, send)
        try:
            work.wait()
        except BaseException as error:
            self._flags_abandoned()
            if isinstance(error, RuntimeError):
                raise_mapped(self, error)
            raise
        return everyone[self._torch_rank] if self._reordered else everyone.copy()

    # -- the check of a call on a CUDA stream, beside it (backends/posted_checks.py) ------------

    #: The torch backend of the group the posted checks travel over (a CPU one).
    _posting_backend = "gloo"

    def _stream_ordered(self, x: Any) -> bool:
        """A CUDA tensor, or a CuPy array (anything with ``__cuda_array_interface__``)."""
        cuda = getattr(x, "is_cuda", None)
        if cuda is None:
            return hasattr(x, "__cuda_array_interface__")
        return cuda is True

    def _posting_rounds(self) -> TorchRounds:
        """The Gloo group of this transport's ranks that the posted checks travel over (made by
        every rank at its first posted check, the same call on every rank)."""
        count = _posting_groups[self._name] = _posting_groups.get(self._name, 0) + 1
        with group_named(f"collectives/{self._name}/checks/{count}"):
            group = self._dist.new_group(sorted(self._global_ranks), backend=self._posting_backend,
                                         use_local_synchronization=True, timeout=torch_timeout(self.timeout))
        created_groups.append(group)
        self._posting_group = group
        posting.add(self)
        return TorchRounds(self._torch, group)

    def _posted_failed(self, error: Exception) -> None:
        # (the NCCL backend aborted)
        self.context.fail_later(error)
        self._abort_stream_backend()

    def _abort_stream_backend(self) -> None:
        """Abort the backend of the group that runs the calls on device streams (NCCL's: its
        communicators aborted, a waiting kernel returns), where the group has one."""
        if self._has_nccl:
            group = self._group or self._dist.distributed_c10d._get_default_group()
            try:
                group._get_backend(self._torch.device("cuda")).abort()
            except Exception:  # noqa: BLE001  (a torch without it: the calls end at their timeout)
                pass

    def _failed_beside(self) -> bool:
        """Whether the watchdog found a failure of this transport's calls beside them (a posted
        check's mismatch, a call on a device stream past its timeout)."""
        posted, watched = self._posted, self._stream_watch
        return (posted is not None and posted.failed) or (watched is not None and watched.failed)

    # -- the timeouts of calls on CUDA streams, beside them (backends/torch_watch.py) ----------

    def _watch_handle(self, handle: Any, timeout: float) -> None:
        """Watch the asynchronous stream-ordered call just made (its handle ``handle``) against
        ``timeout``: torch's handle, whose ``is_completed()`` queries the call's end event (a
        batched send/recv's goes out later: unwatched). (A blocking call's event is posted by
        torch_watch.watched itself.)"""
        work = getattr(handle, "_work", None)
        if work is not None:
            (self._stream_watch or self._start_watch()).add(WORKS, work, self.context.call, timeout)

    def _cuda_events(self) -> Any:
        self._events = made = CudaEvents(self._torch)
        return made

    def _stream_of(self, x: Any, adapter: Any) -> Any:
        """The stream a stream-ordered call on ``x`` (of ``adapter``'s kind) ran on: a CUDA
        tensor's, torch's current one of its device; a CuPy array's, CuPy's current one (see
        torch_handles._torch_call); ``None`` for a call that is not stream-ordered (as
        :meth:`_stream_ordered` says)."""
        if adapter is arrays.CUPY:
            return _cupy_stream_as_torch(self._torch, x)
        if adapter is arrays.TORCH and x.is_cuda:
            return self._torch.cuda.current_stream(x.get_device())
        return None

    def _start_watch(self) -> StreamWatch:
        self._stream_watch = made = watch(self._expired)
        watching.add(self)
        return made

    def _expired(self, call: tuple[str, int]) -> None:
        """(The watchdog's thread.) ``call`` ran past its deadline: this communicator's next call
        or wait raises the :class:`CollectiveTimeout` naming it; the NCCL backend is aborted."""
        self.context.fail_later(self.context.timeout_error(
            "the watchdog aborted the process group's NCCL backend (its communicators' ncclCommAbort)",
            call=call))
        self._abort_stream_backend()
        self._stop_watch()

    def _stop_watch(self) -> None:
        """The watchdog stops looking at this transport's calls (at close, at exit, once one
        expired)."""
        watched = self._stream_watch
        if watched is not None:
            unwatch(watched)
            watching.discard(self)

    def _stop_posting(self, settle: bool) -> None:
        """Stop comparing posted checks (``settle``: once those posted are compared, within the
        timeout) and destroy their group, before the transport's own."""
        posted, self._posted, self._post_to = self._posted, None, None
        if posted is None:
            return
        try:
            if settle and not self.context.broken:
                posted.settle(math.inf if self.timeout is None else self.timeout)
        finally:
            posted.stop()
            posting.discard(self)
            group, self._posting_group = self._posting_group, None
            if group in created_groups:
                created_groups.remove(group)
                with contextlib.suppress(ValueError, RuntimeError):
                    self._dist.destroy_process_group(group)

    def _flag(self, length: int) -> tuple[Any, Any]:
        """An int64 numpy array of ``length`` and the CPU tensor that shares its memory, for the
        check's rounds: one per length, made once (a new tensor each call made the check's round
        about half a raw round slower on Gloo), written and read in nanoseconds. The calls of a
        communicator run one at a time and a round completes before its call returns, so no two
        rounds share one."""
        found = self._flags.get(length)
        if found is None:
            import numpy as np  # noqa: PLC0415

            array = np.zeros(length, dtype=np.int64)
            found = self._flags[length] = (array, self._torch.from_numpy(array))
        return found

    def _store(self) -> Any:
        try:
            return self._dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no default group, or a torch without it
            return None

    def _tell_peers_left(self, how: int) -> None:
        store = self._store()
        if store is not None:  # (host and pid: see farewell.wait_for_departed)
            store.set(f"collectives/left/{self._name}/{self.rank}",
                      f"{self.context.call[1]} {how} {socket.gethostname()} {os.getpid()}")
            store.add(f"collectives/left/{self._name}", 1)

    def _peers_left(self) -> list[tuple[int, int, int]]:
        store = self._store()
        if store is None:
            return []
        count = store.add(f"collectives/left/{self._name}", 0)
        if count <= self._farewells_seen:
            return []
        self._farewells_seen = count
        found = []
        for peer in range(self.size):
            key = f"collectives/left/{self._name}/{peer}"
            if peer != self.rank and not self.context.has_left(peer) and store.check([key]):
                calls, how, host, pid = store.get(key).decode().split()
                found.append((peer, int(calls), int(how)))
                farewell.note_departed(int(how), host, int(pid))
        return found

    def _barrier(self) -> None:
        # A tiny all_reduce rather than dist.barrier(): it works on every group without
        # guessing a device, and it completes only when every rank has reached it.
        # One zero tensor per transport, made once (a sum of zeros stays zero, also where an
        # abandoned barrier's round still writes it): a new tensor each call costs Gloo time.
        launch_batch()
        if self._barrier_flag is None:
            self._barrier_flag = self._torch.zeros(1, dtype=self._torch.int32)
        self._dist.all_reduce(self._barrier_flag, group=self._group)

    def _native_monitored_barrier(self, seconds: float, check: Callable[[], None] | None = None) -> bool:
        """Gloo's own monitored barrier: a Gloo recv's handle says it completed only once
        waited for, so the call path's polled one cannot see who arrived. With checks on, the
        check is the barrier (see :meth:`_checked_barrier`)."""
        launch_batch()
        if self._dist.get_backend(self._group) != "gloo":
            return False
        if check is not None:
            self._checked_barrier(seconds, check)
            return True
        try:
            self._dist.monitored_barrier(self._group, timeout=torch_timeout(seconds), wait_all_ranks=True)
        except RuntimeError as error:
            text = str(error).strip()
            # "Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms" (global ranks), on rank 0
            found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
            if found is None:
                raise self.context.timeout_error(
                    detail="rank 0 did not release the barrier: its CollectiveTimeout (or its dump, "
                           "with COLLECTIVES_TRACE_DIR) names the ranks that never arrived") from error
            missing = sorted(self._global_ranks.index(int(r)) for r in found.group(1).split(",") if r.strip())
            raise self.context.timeout_error(
                detail=f"rank(s) {', '.join(map(str, missing))} never arrived at the barrier") from error
        return True

    def _checked_barrier(self, seconds: float, check: Callable[[], None]) -> None:
        """The barrier as the check (a barrier against another call: CollectiveMismatch on every
        rank at once). At its timeout every rank that took part says so in torch's store; rank 0
        names the peers that did not say so within ``seconds`` more, and the others wait for it
        to have done so (a rank that ends first may end the job under its launcher)."""
        try:
            check()
        except CollectiveTimeout as error:
            store, seq = self._store(), self.context.call[1]
            if store is None:
                raise
            key = f"collectives/barrier/{self._name}/{seq}"
            store.set(f"{key}/{self.rank}", "1")
            deadline = time.monotonic() + seconds
            if self.rank:
                store_said(store, f"{key}/named", deadline + seconds)
                raise CollectiveTimeout(
                    f"{error} (rank 0 did not release the barrier: its CollectiveTimeout, or its dump "
                    "with COLLECTIVES_TRACE_DIR, names the ranks that never arrived)") from error
            missing = [peer for peer in range(1, self.size) if not store_said(store, f"{key}/{peer}", deadline)]
            store.set(f"{key}/named", "1")
            if not missing:
                raise
            raise CollectiveTimeout(
                f"{error} (rank(s) {', '.join(map(str, missing))} never arrived at the barrier)") from error

    def _forget_plans(self) -> None:
        """Drop what holds the group besides ``_group`` (the bound all_to_all, a subclass's plans)."""
        self._alltoall = None
        planning.discard(self)

    def _close(self) -> None:
        launch_batch()
        self._forget_plans()
        self._stop_posting(settle=True)
        self._stop_watch()
        if self._group is not None and self._dist.is_initialized():
            if self._group in created_groups:
                created_groups.remove(self._group)
            self._dist.destroy_process_group(self._group)


#: How many groups of posted checks this process made per transport name (their names differ).
_posting_groups: dict[str, int] = {}
