"""How a process ends, as collectives/diagnostics/_exits.py reads it: for tests/reliability/test_signals.py, run by
every Python version found (the module is loaded by path, so no dependency is needed).

    python tests/reliability/exit_cases.py CASE

prints ``VERDICT <repr of ExitWatch().failing_exit()>`` at exit.
"""

import atexit
import importlib.util
import sys
import threading
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "_exits", Path(__file__).resolve().parents[2] / "collectives" / "diagnostics" / "_exits.py")
_exits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_exits)
_exits.record_exit_calls()  # what `import collectives` does under an MPI launcher (size > 1)


def start():  # what collectives.init() does under an MPI launcher
    watch = _exits.ExitWatch()
    atexit.register(lambda: print(f"VERDICT {watch.failing_exit()!r}", flush=True))


def fail(status):
    sys.exit(status)


def main():
    start()
    return 3


case = sys.argv[1]
if case != "exit-main":
    start()
if case == "exit-main":  # sys.exit is looked up before main() starts the watch
    sys.exit(main())
elif case == "caught-exit":  # caught, then the module runs to its end
    try:
        fail(3)
    except SystemExit:
        pass
elif case == "exit":
    fail(3)
elif case == "raise-exit":
    raise SystemExit(3)
elif case == "exit-zero":
    sys.exit(0)
elif case == "exit-none":
    sys.exit()
elif case == "exit-message":
    sys.exit("bye")
elif case == "thread-exit":  # ends a thread, not the process
    thread = threading.Thread(target=fail, args=(3,))
    thread.start()
    thread.join()
elif case == "caught-then-raise":  # a caught sys.exit(3), then an uncaught raise of 4
    try:
        sys.exit(3)
    except SystemExit:
        pass
    raise SystemExit(4)
print("END OF MODULE", flush=True)
