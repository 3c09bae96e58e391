"""Round trip of one byte between two processes over TCP loopback, after nothing, a sleep or a spin.

    python scripts/wakeup_pingpong.py [--gap-ms 30] [--rounds 60]

No torch, no Gloo, no collectives: what a blocking wake-up costs on this machine. Both
processes do the same before each round trip (nothing; ``time.sleep``; a busy loop of
``--gap-ms``), then one sends a byte and waits for the other's reply, with a blocking
``recv`` (the receiver sleeps in the kernel and is woken, as Gloo's threads are) and with a
polling one (``MSG_DONTWAIT`` in a loop, as MPICH's shared-memory path polls). A Gloo
collective makes several such wake-ups (caller -> Gloo worker thread, the socket loop thread
per message, worker -> caller), so where the blocking round trip after a spin costs
milliseconds, so does every small Gloo collective right after compute
(docs/performance.md, "Gloo right after compute").
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable

import numpy as np


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _recv1(sock: socket.socket, poll: bool) -> bytes:
    if not poll:
        return sock.recv(1)
    while True:
        try:
            return sock.recv(1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gap-ms", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    gap = args.gap_ms / 1e3
    modes: dict[str, Callable[[], None]] = {
        "back to back": lambda: None, f"after {args.gap_ms:g} ms asleep": lambda: time.sleep(gap),
        f"after {args.gap_ms:g} ms spinning": lambda: _spin(gap)}
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    if os.fork() == 0:  # the echoing peer
        peer = socket.create_connection(listener.getsockname())
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for poll in (False, True):
            for before in modes.values():
                for _ in range(args.rounds):
                    before()
                    _recv1(peer, poll)
                    peer.send(b"x")
        os._exit(0)
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; round trip in us")
    for poll in (False, True):
        for name, before in modes.items():
            rtt = []
            for _ in range(args.rounds):
                before()
                start = time.perf_counter()
                sock.send(b"x")
                _recv1(sock, poll)
                rtt.append(time.perf_counter() - start)
            kept = np.array(rtt[5:]) * 1e6
            print(f"{'polling' if poll else 'blocking'} recv, {name:<24} median {np.median(kept):8.1f}"
                  f"   p90 {np.percentile(kept, 90):8.1f}", flush=True)
    os.wait()


if __name__ == "__main__":
    main()
