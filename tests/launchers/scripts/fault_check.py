"""Ranks that all_reduce in a loop until a peer is lost; for the multi-host fault tests.

Each rank prints ``READY rank=R host=H`` after its first all_reduce, then keeps reducing
(paced, so the machine stays usable) until the communicator raises; it prints
``PEER LOST rank=R after=S: <error>`` and exits 2. The test kills one host meanwhile.
"""

from __future__ import annotations

import socket
import sys
import time

import numpy as np

import collectives


def main() -> int:
    comm = collectives.init()
    x = np.ones(1024, np.float32)
    comm.all_reduce(x)
    print(f"READY rank={comm.rank} host={socket.gethostname()}", flush=True)
    last_ok = time.monotonic()
    try:
        while True:
            x[:] = 1
            comm.all_reduce(x)
            last_ok = time.monotonic()
            time.sleep(0.02)  # pacing only: the next call waits on the peers, not on this
    except collectives.CollectiveError as error:
        first_line = str(error).splitlines()[0] if str(error) else ""
        print(f"PEER LOST rank={comm.rank} after={time.monotonic() - last_ok:.2f}s: "
              f"{type(error).__name__}: {first_line}", flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
