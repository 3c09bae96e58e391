"""The torch backend, fault-tolerant (Gloo; NCCL for CUDA tensors): a communicator that
survives the death of a peer.

Made by ``collectives.init(fault_tolerant=True)`` in a job started by ``collectives-elastic``:
the membership lives in the store the launcher serves (:mod:`collectives.elastic.membership`),
never in a rank. Generation ``g`` is torch's default process group of that generation's
members (Gloo, or ``cpu:gloo,cuda:nccl`` where torch has CUDA), made on a ``PrefixStore`` of
its own (``.../gen/<g>/``), so the keys of two generations never meet. A generation ends by
aborting the communicators of every group of it (an NCCL kernel waiting on a dead peer
returns), then destroying them.

A call that fails in the transport (a peer's connection closed or reset: it died; torch's
timeout: a peer hangs) settles with the other survivors which members are gone, and raises
:class:`~collectives.RankFailure` naming them, on every survivor: Gloo ends the calls of the
ranks that talk to the dead one, and a rank that waits on a survivor which gave up is told
by that survivor's closed connections (the settlement waits at most the communicator's
timeout for a member that is silent and alive: it is then left out, and the agent ends it).
``shrink()`` destroys the broken group and makes the next generation's; replacements that
registered meanwhile are admitted at the end of it (and by ``admit``, which
``collectives.elastic`` calls at each commit: a failure and an admission meet in the same
settlement of the next generation). A generation's members say they are ready before its group
is made; a member lost before or while it is made is left out, and the rest make the next one.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from collectives import config
from collectives.communicator import Communicator
from collectives.elastic.membership import Membership, Outcome, left_out
from collectives.errors import BackendUnavailable, CollectiveError, CollectiveMismatch, PeerLeft, RankFailure
from collectives.launcher import LaunchInfo

from .torch_bootstrap import created_groups, device_backend, import_torch_distributed, torch_timeout
from .torch_dist import TorchTransport

#: Seconds a settlement waits for a member that neither answers nor died (a hung rank is left
#: out after this): the communicator's timeout (a survivor blocked in a call on a rank that
#: gave up answers once its call times out), plus WINDOW_MARGIN; at most MAX_WINDOW.
MAX_WINDOW = 120.0
WINDOW_MARGIN = 5.0
#: Seconds between two looks at the store for a revocation while the check's call waits.
REVOKE_LOOK = 0.02


class ElasticTorchTransport(TorchTransport):
    """A fault-tolerant transport over torch's Gloo and NCCL (see the module's text)."""

    def __init__(self, membership: Membership, generation: int, members: list[str]) -> None:
        super().__init__(None, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        # A failure is settled in the check's round (the revocation is seen there): the check of
        # a CUDA call stays before it, never posted beside it (backends/posted_checks.py).
        self._posts_checks = False
        self._membership = membership
        self._members = members
        self._failure: RankFailure | None = None
        self._outcome: Outcome | None = None
        self._agreements = itertools.count()
        self._abandoned: list[Any] = []  # the check's handles a revocation left behind
        self.generation = generation
        # A failure may be settled from two threads at once: the caller's, and the worker of a
        # "collectives" process group (a split of this transport, see ElasticSplitTransport).
        self._settling = threading.Lock()

    @classmethod
    def from_launcher(cls, launch: LaunchInfo, *, timeout: Any = None) -> ElasticTorchTransport:
        """Generation 0 for a rank collectives-elastic started, or the generation that admits a
        replacement (it waits until the survivors admit it)."""
        address = os.environ.get(config.ELASTIC_STORE, "").strip()
        me = os.environ.get(config.ELASTIC_ID, "").strip()
        if not address or not me:
            from collectives.elastic.support import refuse  # noqa: PLC0415

            raise refuse("torch", "init(fault_tolerant=True)",
                         f"the torch backend needs the membership store of collectives-elastic "
                         f"({config.ELASTIC_STORE} and {config.ELASTIC_ID} are not set: this job "
                         "was not started by it)")
        dist = import_torch_distributed()
        if dist.is_initialized():
            raise BackendUnavailable("init(fault_tolerant=True) on the torch backend makes torch's "
                                     "default process group itself: call it before any "
                                     "init_process_group")
        seconds = config.timeout_seconds(timeout)
        window = min(MAX_WINDOW, seconds + WINDOW_MARGIN) if seconds is not None else MAX_WINDOW
        host, _, port = address.rpartition(":")
        store = dist.TCPStore(host, int(port), None, False, timeout=torch_timeout(MAX_WINDOW))
        membership = Membership(store, me, window)
        generation = membership.first_generation()
        if generation is None:
            generation = membership.wait_to_join()
        return cls._make(membership, generation, seconds)

    @classmethod
    def _make(cls, membership: Membership, generation: int,
              seconds: float | None) -> ElasticTorchTransport:
        """Generation ``generation``'s default group, and its transport. A member lost before the
        group is made (it never says it is ready: it died, or hung past the window) or while it
        is made (torch's rendezvous fails) is left out: the members that remain settle the next
        generation, as after a failed call, and make that one instead."""
        dist = import_torch_distributed()
        while True:
            members = membership.members(generation)
            if membership.me not in members:
                raise left_out(membership.me, generation)
            if generation > 0:  # (generation 0's members start seconds apart: no window for them)
                ready = membership.settle(f"ready/{generation}", members, "1")
                if ready.members != members:
                    membership.publish(generation + 1, ready.members, membership.taken(generation))
                    generation += 1
                    continue
            try:
                _init_group(dist, membership, generation, members, seconds)
            except RuntimeError:  # a member died while the group was made (or hung in it)
                membership.revoke(generation)  # (for the members whose group was made)
                outcome = membership.settle(f"next/{generation}", members, "1", membership.taken(generation))
                if membership.me not in outcome.members:
                    raise left_out(membership.me, generation + 1) from None
                membership.publish(generation + 1, outcome.members, outcome.joiners_taken)
                generation += 1
                continue
            _destroy_at_exit()
            return cls(membership, generation, members)

    # -- failures -------------------------------------------------------------------------

    def _rank_failure(self, error: Exception | None) -> RankFailure | None:
        with self._settling:
            return self._settled_failure(error)

    def _settled_failure(self, error: Exception | None) -> RankFailure | None:
        if error is None or self._failure is not None:  # the next call after a failure
            return _again(self._failure, error)
        if not isinstance(error, (RuntimeError, CollectiveError)) or (
                isinstance(error, CollectiveMismatch) and not isinstance(error, PeerLeft)):
            return None  # a mismatch of the calls, or not the transport's: what it says
        self._membership.revoke(self.generation)
        outcome = self._settle_next()
        failed = [r for r, member in enumerate(self._members) if member not in outcome.votes]
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        who = (f"rank(s) {', '.join(map(str, failed))} failed (died, or hung past the timeout)"
               if failed else "no rank died (the transport failed: a timeout, or a lost connection)")
        self._failure = RankFailure(
            f"{self.context.call_name()} failed in generation {self.generation}: {who}; call shrink() "
            f"on every survivor to go on without them. The transport said: {text}",
            failed, self.generation)
        return self._failure

    def _agree_word(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        """The default check's all_reduce, polled (``is_completed`` and short sleeps) rather than
        waited for: Gloo's wait with a timeout does not return before the call's own timeout,
        and a survivor waiting here must see the revocation (:meth:`_peers_left`) at once."""
        word_array, flag = self._flag(1)
        word_array[0] = word
        work = self._dist.all_reduce(flag, op=self._band, group=self._group, async_op=True)
        look = time.monotonic() + REVOKE_LOOK
        pause = 0.0
        if waiting is not None:  # (first: see Transport._says_waiting)
            waiting()
        while not work.is_completed():
            if time.monotonic() >= look:
                try:
                    self.context.hear_farewells()
                except CollectiveError:
                    self._abandoned.append((work, flag))  # Gloo may still write flag
                    self._flags_abandoned()
                    raise
                look = time.monotonic() + REVOKE_LOOK
            time.sleep(pause)
            pause = min(pause + 50e-6, 1e-3)
        work.wait()
        return int(word_array[0])

    def _peers_left(self) -> list[tuple[int, int, int]]:
        """Also the revocation: while a call waits (the call path looks every 50 ms), a survivor
        that saw a failure has revoked this generation in the store: this call fails too."""
        _check_revoked(self, self)
        return super()._peers_left()

    def _split_transport(self, group: Any, global_ranks: list[int]) -> TorchTransport:
        return ElasticSplitTransport(self, group, global_ranks)

    def _settle_next(self) -> Outcome:
        """Who forms the next generation: the members that vote (the others failed) and the
        replacements waiting. One settlement per generation, whether a failure or an admission
        started it: members that saw a failure and members that admit meet in it."""
        if self._outcome is None:
            membership = self._membership
            self._outcome = membership.settle(f"next/{self.generation}", self._members, "1",
                                              membership.taken(self.generation))
        return self._outcome

    # -- shrink, agree, admit ---------------------------------------------------------------

    def _shrink(self) -> ElasticTorchTransport:
        return self._next(self._settle_next())

    def _next(self, outcome: Outcome) -> ElasticTorchTransport:
        """End this generation's group and make the next one, of ``outcome.members``."""
        membership = self._membership
        if membership.me not in outcome.members:
            raise left_out(membership.me, self.generation + 1)
        membership.publish(self.generation + 1, outcome.members, outcome.joiners_taken)
        dist = self._dist
        if dist.is_initialized():
            # The failed generation's calls may still be running in Gloo until their timeout: the
            # group is kept alive (else destroying it waits for them) and released at exit. Its
            # NCCL kernels may wait on a dead peer for ever: every group's communicators are
            # aborted first (that ends them), then destroyed.
            _retired.append(dist.group.WORLD)
            _abort_every_group(dist)
            dist.destroy_process_group()
        return self._make(membership, self.generation + 1, self.timeout)

    def _agree(self, flag: bool) -> bool:
        outcome = self._membership.settle(f"agree/{self.generation}/{next(self._agreements)}",
                                          self._members, "1" if flag else "0")
        return all(vote == "1" for vote in outcome.votes.values())

    def _joiners_registered(self) -> int:
        return self._membership.joiners_registered()

    def _admit(self, registered: int) -> ElasticTorchTransport | None:
        if registered <= self._membership.taken(self.generation):
            return None
        # (also when the settlement found the replacement's id not yet written: the
        # generation's settlement is made, so the same members go on a generation later)
        return self._next(self._settle_next())

    @property
    def member_id(self) -> str:
        """This process's id in the job (``collectives-elastic`` numbers the first ranks
        ``0`` .. ``n-1`` and the replacements ``n``, ``n+1``, ...)."""
        return self._membership.me

    @property
    def members(self) -> list[str]:
        """The member ids of this generation, in rank order."""
        return list(self._members)


def _init_group(dist: Any, membership: Membership, generation: int, members: list[str],
                seconds: float | None) -> None:
    """torch's default group of generation ``generation`` (``members``), under the
    communicator's timeout for its calls."""
    store = dist.PrefixStore(f"collectives/elastic/gen/{generation}/", membership.store)
    backend = device_backend(int(os.environ.get("LOCAL_RANK", 0)))
    if "nccl" in backend:
        _nccl_keeps_the_process()
    # Generation 0's members reach this point seconds apart (torch's import): its group is made
    # under a long timeout. A later generation's members said they are ready: the window.
    making = MAX_WINDOW + (seconds or 0) if generation == 0 else membership.window
    # torch numbers its groups, a failed one too, and their keys in the store carry the number: a
    # failed attempt must leave no trace, or this member's next group would miss the others'.
    count = dist.get_pg_count()
    try:
        dist.init_process_group(backend, store=store, rank=members.index(membership.me),
                                world_size=len(members), timeout=torch_timeout(making))
    except RuntimeError:
        dist.distributed_c10d._world.group_count = count
        raise
    # torch >= 2.15 names it set_timeout (and deprecates the old name).
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(torch_timeout(seconds), None)


def _again(failure: RankFailure | None, error: Exception | None) -> RankFailure | None:
    """The failure already seen: itself for the error of the call that failed, a fresh one for
    the next call (``error=None``)."""
    if failure is None or error is not None:
        return failure
    return RankFailure(str(failure), failure.failed_ranks, failure.generation)


def _check_revoked(transport: TorchTransport, generation: ElasticTorchTransport) -> None:
    """``CollectiveError`` when a survivor revoked ``generation`` (it saw a rank fail)."""
    if generation._membership.is_revoked(generation.generation):
        raise CollectiveError(f"{transport.context.call_name()}: generation {generation.generation} was "
                              "revoked by a survivor that saw a rank fail")


class ElasticSplitTransport(TorchTransport):
    """A ``split()`` of a fault-tolerant transport (a Gloo subgroup of its generation's group): a
    failure in one of its calls is settled by the generation (revoked, the members' votes), so it
    raises :class:`~collectives.RankFailure` naming the failed ranks in its own numbering, and the
    generation's other communicators raise too. It ends with its generation: ``split()`` the
    communicator that ``shrink()`` of the parent gives (its own ``shrink()`` says so)."""

    def __init__(self, generation: ElasticTorchTransport, group: Any, global_ranks: list[int]) -> None:
        super().__init__(group, ranks=global_ranks, local_rank=generation.local_rank)
        self._posts_checks = False  # (as its generation's: see ElasticTorchTransport)
        self._generation = generation
        self._failure: RankFailure | None = None
        self._abandoned: list[Any] = []
        self._agreements = itertools.count()
        self.generation = generation.generation

    _agree_word = ElasticTorchTransport._agree_word

    def _split_transport(self, group: Any, global_ranks: list[int]) -> TorchTransport:
        return ElasticSplitTransport(self._generation, group, global_ranks)

    def _peers_left(self) -> list[tuple[int, int, int]]:
        _check_revoked(self, self._generation)
        return super()._peers_left()

    def _rank_failure(self, error: Exception | None) -> RankFailure | None:
        if error is None or self._failure is not None:
            return _again(self._failure, error)
        failure = self._generation._rank_failure(error)
        if failure is None:
            return None
        failed = [r for r, g in enumerate(self._global_ranks) if g in failure.failed_ranks]
        who = (f"rank(s) {', '.join(map(str, failed))} of this split failed" if failed
               else "no rank of this split failed (one of the generation did)")
        self._failure = RankFailure(
            f"{self.context.call_name()} failed in generation {self.generation}: {who}. A split of a "
            f"fault-tolerant communicator ends with its generation: call shrink() on the communicator "
            f"it was split from (every survivor), then split() the result again. ({failure})",
            failed, self.generation)
        return self._failure

    def _shrink(self) -> TorchTransport:
        raise BackendUnavailable(
            "shrink() of a split of a fault-tolerant communicator on the torch backend: the split ends "
            "with its generation; call shrink() on the communicator it was split from (every "
            "survivor), then split() the result again (Open MPI's ULFM shrinks a split itself)")

    def _agree(self, flag: bool) -> bool:
        generation = self._generation
        members = [generation._members[g] for g in self._global_ranks]
        outcome = generation._membership.settle(
            f"agree/{self.generation}/{self._name}/{next(self._agreements)}", members, "1" if flag else "0")
        return all(vote == "1" for vote in outcome.votes.values())

    def _close(self) -> None:
        self._stop_watch()
        if self._group in self._dist.distributed_c10d._world.pg_map:
            super()._close()  # (else its generation's shrink destroyed it already)
        elif self._group in created_groups:
            created_groups.remove(self._group)


#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: what torch's NCCL watchdog does with a call that failed
#: or timed out. 2 aborts the group's communicators and hands the error to the call (the process
#: goes on: the failure is settled and the generation shrinks); 0 leaves it to the transport.
#: 1 and 3 end the process, which would turn every survivor of a failure into a casualty.
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_MODES_THAT_KEEP_THE_PROCESS = ("0", "2")


def _nccl_keeps_the_process() -> None:
    """Set torch's NCCL error handling to abort-and-raise (2) before the group is made, or refuse
    a setting that would end the process at a peer's failure."""
    mode = os.environ.get(NCCL_ERROR_HANDLING, "").strip()
    if not mode:
        os.environ[NCCL_ERROR_HANDLING] = "2"
    elif mode not in NCCL_MODES_THAT_KEEP_THE_PROCESS:
        raise BackendUnavailable(
            f"init(fault_tolerant=True) on CUDA (NCCL): {NCCL_ERROR_HANDLING}={mode} makes torch end the "
            f"process when a peer fails, so no rank could survive; allowed: "
            f"{' or '.join(NCCL_MODES_THAT_KEEP_THE_PROCESS)}, or unset (collectives sets 2)")


def _abort_every_group(dist: Any) -> None:
    """Abort the communicators of every process group of the generation (an NCCL call in flight
    then ends instead of waiting for a dead peer; Gloo's abort ends nothing that runs; a
    "collectives" group's abort stops its worker). torch has no abort for some backends on
    some devices: those are left to ``destroy_process_group``."""
    import torch  # noqa: PLC0415

    device = torch.device("cuda")
    backends = []
    for group in reversed(list(dist.distributed_c10d._world.pg_map)):  # the newest first, as torch does
        try:
            backends.append(group._get_backend(device))
        except (RuntimeError, AttributeError, NotImplementedError):
            pass
    _abort_backends(backends)


def _abort_backends(backends: list[Any]) -> None:
    """Abort each backend, inside one NCCL group where one of them is an NCCL backend: aborts of
    different NCCL communicators can deadlock each other otherwise (pytorch#119797), so torch's own
    ``_abort_process_group`` brackets them in ``_group_start()`` / ``_group_end()`` the same way."""
    bracket = next((backend for backend in backends
                    if hasattr(backend, "_group_start") and hasattr(backend, "_group_end")), None)
    if bracket is not None:
        bracket._group_start()
    try:
        for backend in backends:
            try:
                backend.abort()
            except (RuntimeError, AttributeError, NotImplementedError):
                pass
    finally:
        if bracket is not None:
            bracket._group_end()


#: The groups of past generations (see ``ElasticTorchTransport._next``).
_retired: list[Any] = []
_destroying = False


def _destroy_at_exit() -> None:
    """A Gloo group alive when the interpreter ends aborts the process: destroyed at exit."""
    global _destroying
    if not _destroying:
        _destroying = True
        atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    _retired.clear()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):
            pass


class ElasticTorchCommunicator(Communicator):
    """The fault-tolerant communicator of the torch backend (``init(fault_tolerant=True)``)."""

    transport_class = ElasticTorchTransport
