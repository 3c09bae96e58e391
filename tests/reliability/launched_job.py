"""A job under a real launcher, for tests that signal its ranks: its output read as it comes.

``LaunchedJob`` starts ``script`` on ``size`` ranks under mpiexec or torchrun, with a token in
every process's environment (so the test finds, and kills, each process of the job and checks
that none is left), and reads the launcher's output on a thread, so a test waits for a line
(``wait_for``), never for a time. tests/reliability/test_signals.py and test_trace.py build
their jobs on it.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_reliability import _describe, _launcher, _processes_with

from collectives.launcher import without_launcher_variables

ROOT = Path(__file__).resolve().parents[2]


class LaunchedJob:
    """``script ARGS`` on ``size`` ranks under ``launcher`` ("mpiexec" or "torchrun"), with
    ``env`` added to this process's environment."""

    def __init__(self, launcher: str, size: int, script: str, args: list[str], env: dict[str, str],
                 token_name: str) -> None:
        if launcher == "mpiexec":
            command = [_launcher("mpiexec"), "-n", str(size), sys.executable, script, *args]
        else:
            from collectives.testing.launch import free_port as _free_port

            command = [_launcher("torchrun"), "--nnodes", "1", "--nproc_per_node", str(size),
                       "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), script, *args]
        self.token = f"{token_name}={secrets.token_hex(8)}"
        name, value = self.token.split("=")
        environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                       "PYTHONUNBUFFERED": "1", name: value, **env}
        self.size = size
        self.process = subprocess.Popen(command, env=without_launcher_variables(environment),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.process.stdout:
            with self._changed:
                self.lines.append(raw.decode(errors="replace"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def text(self) -> str:
        """What the job printed (the launcher's output)."""
        return "".join(self.lines)

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 60) -> list[re.Match]:
        """The first ``count`` matches of ``pattern`` in the output, waiting for them."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                # finditer over all of it: Hydra may join two ranks' lines into one
                found = list(re.finditer(pattern, "".join(self.lines)))
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    self.kill()
                    pytest.fail(f"no {count} x {pattern!r} in the job's output:\n{self.text}")
                self._changed.wait(left)

    def pids(self, count: int | None = None) -> dict[int, int]:
        """Rank -> pid, from the ``READY rank R pid P`` lines of ``count`` ranks (default: all)."""
        return {int(m.group(1)): int(m.group(2))
                for m in self.wait_for(r"READY rank (\d+) pid (\d+)", count or self.size)}

    def wait_exit(self, timeout: float) -> int:
        """The launcher's exit code; the test fails (and the job is killed) past ``timeout``."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout} s:\n{self.text}")

    def assert_nothing_left(self) -> None:
        """Once the launcher exited: no process of the job may be left running."""
        self._reader.join(10)
        # Hydra may exit while the SIGKILLs it sent are still being delivered: a moment.
        deadline = time.monotonic() + 5
        while (left := _processes_with(self.token)) and time.monotonic() < deadline:
            time.sleep(0.02)
        if left:
            described = _describe(left)
            self.kill()
            pytest.fail(f"processes left running 5 s after the launcher exited: {described}")

    def kill(self) -> None:
        for pid in [self.process.pid, *_processes_with(self.token)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(10)
