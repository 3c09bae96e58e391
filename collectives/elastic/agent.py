"""The membership authority of a fault-tolerant job on the torch backend: the store the ranks
agree through, served by the process that starts them (``collectives-elastic``).

Why the launcher and not a rank: the membership must outlive every rank (rank 0 included), and
the process that started the ranks is the first to know that one ended (it is the parent: its
exit reaches ``waitpid`` at once, a clean exit, a crash, SIGKILL or ``os._exit`` alike). It
holds no training state, so nothing is lost with a rank. It writes ``dead/<id>`` as a rank
ends, starts replacements (``--replace``), ends a rank the survivors left out (it hung past
the timeout: SIGKILL), ends replacements never admitted once the job is done, and ends every
rank when fewer than ``--min`` remain (the replacements started count). Nothing it started
outlives it: each rank dies with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import config
from .membership import PREFIX

#: Seconds between two looks at the store for a new generation (a rank to end).
LOOK_SECONDS = 0.05
#: Seconds the ranks get after SIGTERM before SIGKILL, when the job ends early.
TERM_GRACE = 5.0


class Agent:
    """Serves the store, starts ``size`` ranks of ``command`` and watches them (see the module)."""

    def __init__(self, size: int, command: Sequence[str], *, min_size: int = 1,
                 replace: bool = False, max_restarts: int = 3, host: str = "127.0.0.1") -> None:
        import torch.distributed as dist  # noqa: PLC0415

        self.size, self.command, self.min_size = size, list(command), min_size
        self.replace, self.max_restarts = replace, max_restarts
        self.store: Any = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=60),
                                   wait_for_workers=False)
        self.address = f"{host}:{self.store.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.slots: dict[str, int] = {}  # member -> its LOCAL_RANK
        self.exits: dict[str, int] = {}
        self.ever_members: set[str] = set()
        self.latest: list[str] = [str(i) for i in range(size)]
        self.generation = 0
        self.restarts = 0
        self.finished = False  # a member ended normally: the training is over
        self._ended: queue.Queue[tuple[str, int]] = queue.Queue()
        self._set("members/0", ",".join(self.latest))
        self._set("taken/0", "0")
        for member in self.latest:
            self._set(f"admitted/{member}", "0")
        self._set("current", "0")
        self.ever_members.update(self.latest)

    def _set(self, key: str, value: str) -> None:
        self.store.set(PREFIX + key, value)

    def _get(self, key: str) -> str:
        return bytes(self.store.get(PREFIX + key)).decode()

    def start(self, member: str, slot: int | None = None) -> None:
        """Start rank ``member`` on local slot ``slot`` (its ``LOCAL_RANK``, which picks its GPU):
        a first rank's is its id, a replacement's the slot of the rank it replaces."""
        slot = int(member) if slot is None else slot
        self.slots[member] = slot
        env = dict(os.environ)
        env.setdefault(config.BACKEND, "torch")
        env[config.FAULT_TOLERANT] = "1"
        env[config.ELASTIC_STORE] = self.address
        env[config.ELASTIC_ID] = member
        env["LOCAL_RANK"] = str(slot)
        proc = subprocess.Popen(self.command, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        self.procs[member] = proc
        threading.Thread(target=self._wait, args=(member, proc), daemon=True).start()

    def _wait(self, member: str, proc: subprocess.Popen[bytes]) -> None:
        self._ended.put((member, proc.wait()))

    def run(self) -> int:
        """Start the ranks and watch them until every one has ended; the job's exit status."""
        for member in self.latest:
            self.start(member)
        while len(self.exits) < len(self.procs):
            try:
                member, code = self._ended.get(timeout=LOOK_SECONDS)
            except queue.Empty:
                pass
            else:
                self._on_exit(member, code)
            self._look_at_generations()
        return self._status()

    def _on_exit(self, member: str, code: int) -> None:
        self.exits[member] = code
        self._set(f"dead/{member}", str(code))
        if code == 0 and member in self.latest:
            self.finished = True
        elif (self.replace and not self.finished and self.restarts < self.max_restarts
              and member in self.ever_members):
            self.restarts += 1
            self.start(str(self.size + self.restarts - 1), self.slots[member])  # ids go on: n, n + 1, ...
        running = [m for m in self.latest if m not in self.exits]
        # Replacements started and not yet admitted count: the survivors admit them.
        joining = [m for m in self.procs if m not in self.ever_members and m not in self.exits]
        if not running:  # the training is over (or lost): replacements never admitted end
            self._end(joining, signal.SIGTERM)
        elif len(running) + len(joining) < self.min_size and not self.finished:
            print(f"collectives-elastic: {len(running) + len(joining)} rank(s) left "
                  f"({_members(running + joining)}), fewer than --min {self.min_size}: ending "
                  f"the job; ended: {_ended(self.exits)}", file=sys.stderr, flush=True)
            self._end(running + joining, signal.SIGTERM)

    def _look_at_generations(self) -> None:
        try:
            current = int(self._get("current"))
        except (RuntimeError, ValueError):
            return
        while self.generation < current:
            self.generation += 1
            self.latest = self._get(f"members/{self.generation}").split(",")
            self.ever_members.update(self.latest)
            # Members the survivors left out hung past the timeout: ended here.
            left_out = [m for m in self.ever_members
                        if m not in self.latest and m in self.procs and m not in self.exits]
            self._end(left_out, signal.SIGKILL)

    def _end(self, members: list[str], how: int) -> None:
        for member in members:
            proc = self.procs[member]
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT if how == signal.SIGKILL else how)
                    proc.send_signal(how)
        if how == signal.SIGTERM and members:
            threading.Thread(target=self._kill_later, args=(members,), daemon=True).start()

    def _kill_later(self, members: list[str]) -> None:
        deadline = time.monotonic() + TERM_GRACE
        for member in members:
            proc = self.procs[member]
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(deadline - time.monotonic(), 0.0))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    def _status(self) -> int:
        """0 when every member of the last generation ended normally and there were at least
        ``--min`` of them; else the first failing status (1 if none failed)."""
        codes = [self.exits.get(m, 1) for m in self.latest]
        if len(self.latest) >= self.min_size and all(code == 0 for code in codes):
            return 0
        failing = [code for code in codes if code != 0]
        return (128 - failing[0] if failing[0] < 0 else failing[0]) if failing else 1

    def terminate(self) -> None:
        """End every rank still running (the launcher was interrupted)."""
        running = [m for m, proc in self.procs.items() if proc.poll() is None]
        self._end(running, signal.SIGTERM)
        self._kill_later(running)

    def close(self) -> None:
        self.store = None


def _members(members: list[str]) -> str:
    return f"member{'s' if len(members) > 1 else ''} {', '.join(members)}"


def _ended(exits: dict[str, int]) -> str:
    """``member 2 (status 9), member 1 (signal 9)``, in the order they ended."""
    return ", ".join(f"member {m} ({f'signal {-code}' if code < 0 else f'status {code}'})"
                     for m, code in exits.items())


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies (Linux), so no rank outlives it."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


