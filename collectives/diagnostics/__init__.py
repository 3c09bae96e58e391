"""What tells a user why a job failed or hung: the diagnostics, apart from the call path.

- :mod:`~collectives.diagnostics.recorder`: the flight recorder, the ring of each
  communicator's last calls, its hooks, and the dump written on a timeout, a mismatch,
  a signal or a crash.
- :mod:`~collectives.diagnostics.trace`: the reader of those dumps (``collectives-trace``):
  which rank is behind, in which call.
- :mod:`~collectives.diagnostics.process_hooks`: the process-wide hooks an MPI or torchrun
  job needs (excepthook, signals, the MPI abort at a failing exit).
- :mod:`~collectives.diagnostics._exits`: how this process is ending (normally, or through an
  uncaught ``SystemExit`` and its code); standard library only.

May import: the standard library and collectives' config, launcher and farewell; never a
transport at import time, never the call path (communicator, checks, calls).
"""
