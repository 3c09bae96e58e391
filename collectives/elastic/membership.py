"""Who is in each generation of a fault-tolerant job on the torch backend, agreed through a
store that outlives the ranks.

The store is a torch ``TCPStore`` served by ``collectives-elastic`` (collectives/elastic/agent.py),
the process that started the ranks: it sees each rank's exit first (it is the parent), it holds
no rank's state, and it lives until the last rank is gone, so the membership survives any rank,
rank 0 included. Every decision is a key set once with ``compare_set`` (the first proposal
wins): all survivors read the same outcome, whoever proposed it.

Keys, under :data:`PREFIX`:

- ``members/<g>``: the member ids of generation ``g``, comma-separated, in rank order (the
  agent writes generation 0: ids ``0`` .. ``n-1``).
- ``dead/<id>``: written by the agent when member ``id``'s process ended (its exit status).
- ``joiners`` (a counter) and ``joiner/<k>``: the replacements waiting to join, in arrival
  order; ``admitted/<id>``: the generation a replacement joined.
- ``revoked/<g>``: a member saw a failure in generation ``g`` (the others' waiting calls fail).
- ``vote/<topic>/<id>`` and ``result/<topic>``: a member's word in a settlement and its
  outcome: ``next/<g>`` (who forms generation ``g + 1``: after a failure, or to admit
  replacements), ``ready/<g>`` (who is there to make generation ``g``'s group), ``agree/...``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from ..errors import CollectiveError

PREFIX = "collectives/elastic/"


@dataclass(frozen=True)
class Outcome:
    """A settlement's result: the ids that took part, with their votes, and the next members."""

    votes: dict[str, str]
    members: list[str]
    joiners_taken: int


class Membership:
    """This process's view of the job's membership (member id ``me``) through ``store``."""

    def __init__(self, store: Any, me: str, window: float) -> None:
        self.store = store
        self.me = me
        #: Seconds a settlement waits for members that neither voted nor died (a hung rank).
        self.window = window

    # -- keys ---------------------------------------------------------------------------

    def _has(self, key: str) -> bool:
        return bool(self.store.check([PREFIX + key]))

    def _get(self, key: str) -> str:
        return bytes(self.store.get(PREFIX + key)).decode()

    def _set(self, key: str, value: str) -> None:
        self.store.set(PREFIX + key, value)

    def members(self, generation: int) -> list[str]:
        return self._get(f"members/{generation}").split(",")

    def current(self) -> int:
        """The newest generation (as far as this process's last look)."""
        return int(self._get("current")) if self._has("current") else 0

    def is_dead(self, member: str) -> bool:
        return self._has(f"dead/{member}")

    def revoke(self, generation: int) -> None:
        """A member saw a failure in ``generation``: the others' waiting calls fail too."""
        self._set(f"revoked/{generation}", "1")

    def is_revoked(self, generation: int) -> bool:
        return self._has(f"revoked/{generation}")

    # -- settlements ----------------------------------------------------------------------

    def settle(self, topic: str, members: list[str], value: str, taken: int = -1) -> Outcome:
        """Vote ``value`` on ``topic`` and wait for every one of ``members`` to vote or die (at
        most :attr:`window` seconds after this vote; the ones still silent then are left out:
        hung). The first outcome proposed wins, for everyone. With ``taken >= 0`` the outcome
        also admits the replacements waiting beyond the first ``taken``."""
        self._set(f"vote/{topic}/{self.me}", value)
        result = f"result/{topic}"
        deadline = time.monotonic() + self.window
        pause = 0.001
        while not self._has(result):
            votes: dict[str, str] = {}
            silent = False
            for member in members:
                if self._has(f"vote/{topic}/{member}"):
                    votes[member] = self._get(f"vote/{topic}/{member}")
                elif not self.is_dead(member):
                    silent = True
            if not silent or time.monotonic() >= deadline:
                joiners = self._waiting_joiners(taken) if taken >= 0 else []
                proposal = json.dumps({"votes": votes, "members": [m for m in members if m in votes] + joiners,
                                       "taken": taken + len(joiners)})
                self.store.compare_set(PREFIX + result, "", proposal)
                break
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        outcome = json.loads(self._get(result))
        return Outcome(outcome["votes"], outcome["members"], outcome["taken"])

    # -- replacements -------------------------------------------------------------------

    def joiners_registered(self) -> int:
        """How many replacements have asked to join so far (admitted or not)."""
        return int(self.store.add(PREFIX + "joiners", 0))

    def _waiting_joiners(self, taken: int) -> list[str]:
        """The ids of the replacements registered after the first ``taken``, in order (those
        whose id is written; a later one waits for the next settlement)."""
        ids = []
        for k in range(taken, self.joiners_registered()):
            if not self._has(f"joiner/{k}"):
                break
            ids.append(self._get(f"joiner/{k}"))
        return ids

    def publish(self, generation: int, members: list[str], taken: int) -> None:
        """Write generation ``generation`` (idempotent: every survivor writes the same)."""
        self._set(f"members/{generation}", ",".join(members))
        self._set(f"taken/{generation}", str(taken))
        for member in members:
            self._set(f"admitted/{member}", str(generation))
        self._set("current", str(generation))

    def taken(self, generation: int) -> int:
        return int(self._get(f"taken/{generation}")) if self._has(f"taken/{generation}") else 0

    def wait_to_join(self, poll: float = 0.05) -> int:
        """As a replacement: register, then wait until a generation admits this process;
        returns that generation. The agent ends a replacement that the job never admits."""
        k = int(self.store.add(PREFIX + "joiners", 1)) - 1
        self._set(f"joiner/{k}", self.me)
        while not self._has(f"admitted/{self.me}"):
            time.sleep(poll)
        return int(self._get(f"admitted/{self.me}"))

    def first_generation(self) -> int | None:
        """Generation 0 when this process is one of its members and no later one exists yet,
        else ``None`` (the process joins as a replacement)."""
        if self._has(f"admitted/{self.me}"):
            return int(self._get(f"admitted/{self.me}"))
        if self.current() == 0 and self.me in self.members(0):
            return 0
        return None


def left_out(me: str, generation: int) -> CollectiveError:
    return CollectiveError(
        f"member {me} was left out of generation {generation}: it did not answer within the "
        "settlement window (the communicator's timeout) after a failure, so the survivors "
        "went on without it; end this process")
