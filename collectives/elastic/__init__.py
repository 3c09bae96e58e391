"""Training that survives the death of a rank: a state to commit and restore, and a loop.

    import collectives
    from collectives import elastic

    state = elastic.State(model=model, optimizer=optimizer, step=0)

    def train(comm, state):                      # called again after each membership change
        while state.step < steps:
            batch = shard(data[state.step], comm.rank, comm.size)
            ...                                   # forward, backward, comm.all_reduce(grads)
            state.step += 1
            state.commit()                        # what a failure rolls back to

    elastic.run(train, state, min_size=2)

started with ``collectives-elastic -n 4 --min 2 --replace python train.py``. On a
:class:`~collectives.RankFailure` :func:`run` restores the last commit, shrinks the
communicator to the survivors (admitting the replacements that wait), hands the committed
state from the new rank 0 to every rank (replacements included) and calls ``train`` again
with the new communicator; ``train`` recomputes its shard from ``comm.rank`` and
``comm.size``. A replacement that registers while the job is healthy is admitted at the next
``commit()``. The step in flight when a rank failed is lost (redone from the commit). A rank
lost anywhere in the loop (inside ``commit()``, ``restore()`` and the shrink included) is such a
failure.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..communicator import Communicator
from ..errors import RankFailure

__all__ = ["MembershipChange", "Generation", "State", "run"]


class MembershipChange(Exception):  # noqa: N818 - not an error: the loop's signal
    """Raised by :meth:`State.commit` when replacements were admitted: :func:`run` calls
    ``train`` again with the larger communicator (after handing it the committed state)."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__(f"replacements joined: generation {comm.generation}, {comm.size} ranks")
        self.comm = comm


@dataclass(frozen=True)
class Generation:
    """One membership of the job, as ``State.history`` records it."""

    #: The communicator's generation, its size, and the step the state was at when it began.
    generation: int
    size: int
    step: int
    #: The ranks of the previous generation that failed (empty after a join, and at first).
    failed: tuple[int, ...] = ()


class State:
    """What :func:`run` keeps across failures: objects with ``state_dict``/``load_state_dict``
    (models, optimizers, schedulers) and plain values (numbers, arrays), by name.

    ``state.step``, ``state.model``: the objects and values, read and set as attributes.
    :meth:`commit` copies them (in memory); :meth:`restore` puts the copy back; :meth:`sync`
    hands the committed copy of one rank to every rank.
    """

    def __init__(self, **objects: Any) -> None:
        object.__setattr__(self, "_objects", dict(objects))
        object.__setattr__(self, "_committed", None)
        object.__setattr__(self, "comm", None)
        #: The memberships the job went through (see :class:`Generation`).
        object.__setattr__(self, "history", [])
        self.commit(check_joiners=False)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._objects[name]
        except KeyError:
            raise AttributeError(f"State has no {name!r}; it holds {sorted(self._objects)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._objects:
            raise AttributeError(f"State has no {name!r} (it holds {sorted(self._objects)}); "
                                 "name every object when making it: State(model=..., step=0)")
        self._objects[name] = value

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of every object's state (``state_dict()``) and of every plain value."""
        return {name: copy.deepcopy(obj.state_dict() if _stateful(obj) else obj)
                for name, obj in self._objects.items()}

    def load(self, snapshot: dict[str, Any]) -> None:
        for name, saved in snapshot.items():
            obj = self._objects[name]
            if _stateful(obj):
                obj.load_state_dict(copy.deepcopy(saved))
            else:
                self._objects[name] = copy.deepcopy(saved)

    def commit(self, *, check_joiners: bool = True) -> None:
        """Remember the current state: a failure later rolls back to here. Inside :func:`run`
        on a communicator that admits replacements, a collective: replacements waiting to
        join are admitted here (:class:`MembershipChange` then leaves ``train``)."""
        object.__setattr__(self, "_committed", self.snapshot())
        comm = self.comm
        if check_joiners and comm is not None:
            grown = comm._fault.admit()
            if grown is not comm:
                raise MembershipChange(grown)

    def restore(self) -> None:
        """Put back the last committed state."""
        self.load(self._committed)

    def sync(self, comm: Communicator, src: int = 0) -> None:
        """Every rank takes rank ``src``'s committed state (a replacement gets it this way)."""
        object.__setattr__(self, "_committed", comm.broadcast_object(self._committed, src))
        self.restore()


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def run(train: Callable[[Communicator, State], Any], state: State, comm: Communicator | None = None, *,
        min_size: int = 1, max_restarts: int | None = None) -> Any:
    """Call ``train(comm, state)`` until it returns, going on after ranks fail; its result.

    ``comm``: a fault-tolerant communicator (default ``collectives.init(fault_tolerant=True)``).
    On :class:`~collectives.RankFailure`: the last commit is restored, the communicator
    shrinks to the survivors (with the replacements waiting to join), the committed state of
    its rank 0 (a survivor) goes to every rank, and ``train`` runs again. Fewer than
    ``min_size`` survivors, or more than ``max_restarts`` failures (``None``: no limit),
    re-raise the RankFailure. Every rank, replacements included, starts with rank 0's state.
    """
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1; got {min_size!r}")
    if max_restarts is not None and (isinstance(max_restarts, bool) or not isinstance(max_restarts, int)
                                     or max_restarts < 0):
        raise ValueError(f"max_restarts must be an int >= 0 or None; got {max_restarts!r}")
    if comm is None:
        from .. import registry  # noqa: PLC0415

        comm = registry.init(fault_tolerant=True)
    restarts = 0
    failed: tuple[int, ...] = ()
    while True:
        object.__setattr__(state, "comm", comm)
        try:
            state.sync(comm)
            state.history.append(Generation(comm.generation, comm.size, _step(state), failed))
            failed = ()
            return train(comm, state)
        except MembershipChange as change:
            comm = change.comm
            continue
        except Exception as error:  # noqa: BLE001 - a RankFailure, or one torch handed on as another error
            failure = error if isinstance(error, RankFailure) else comm._fault.failure_elsewhere()
            if failure is None:
                raise
            restarts += 1
            if max_restarts is not None and restarts > max_restarts:
                if failure is error:
                    raise
                raise failure from error
        finally:
            object.__setattr__(state, "comm", None)
        failed = failure.failed_ranks
        comm = _survivors(state, comm, min_size)


def _survivors(state: State, comm: Communicator, min_size: int) -> Communicator:
    """After a failure: the last commit restored, and the communicator of the survivors (at
    least ``min_size``, else :class:`RankFailure`). A peer lost inside the shrink is one more
    failure of the same recovery: the commit is restored again and the shrink made again (each
    time one rank fewer at least: at most ``comm.size`` times)."""
    for _ in range(comm.size):
        state.restore()
        try:
            comm = comm.shrink()
        except RankFailure as failure:
            lost = failure
            continue
        if comm.size < min_size:
            raise RankFailure(f"{comm.size} rank(s) survive, fewer than min_size={min_size}",
                              (), comm.generation) from None
        return comm
    raise lost


def _step(state: State) -> int:
    step = state._objects.get("step", 0)
    return int(step) if isinstance(step, int) else 0
