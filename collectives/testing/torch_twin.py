"""The CPU twin of the torch route's CUDA decision: a torch transport over a Gloo group that takes
every call on a torch tensor as ordered on a device stream (as a CUDA tensor's call on NCCL is),
so that the default check of those calls goes beside them (backends/torch_checks.py), as it does
for CUDA tensors on a group with NCCL. The collectives themselves run on Gloo as usual (blocking:
they return once done, where NCCL's return once enqueued); what this proves is the check's
bookkeeping: no CPU collective and no wait of the calling thread per call, a mismatch raised at a
later call on every rank, nothing left running after ``close()`` (tests/collective_calls/
test_posted_checks.py; scripts/bench/host_cost.py ``--twin``).

:class:`StreamOrderedTwin` counts what the calling thread asks of the transport's own group for
the check (``agreed``: rounds of the check word; ``exchanged``: fingerprint exchanges).
Imported explicitly (it imports torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collectives.backends.torch_dist import TorchCommunicator, TorchTransport
from collectives.communicator import Communicator


class StreamOrderedTwin(TorchTransport):
    """A :class:`~collectives.backends.torch_dist.TorchTransport` whose torch tensors' calls are
    stream-ordered (their checks posted), with counts of the check's own rounds on its group."""

    def __init__(self, group: Any = None, ranks: list[int] | None = None, local_rank: int | None = None) -> None:
        super().__init__(group, ranks, local_rank)
        self._posts_checks = True
        #: Rounds of the check word (``_agree_word``) and fingerprint exchanges made on the
        #: transport's own group, by the calling thread.
        self.agreed = self.exchanged = 0

    def _stream_ordered(self, x: Any) -> bool:
        return type(x).__module__.startswith("torch")

    def _carried_path(self, call: Any, adapter: Any, dtype: str, reduce_op: Any) -> None:
        return None  # (a CUDA tensor's data never travels in the CPU check's round)

    def _agree_word(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        self.agreed += 1
        return super()._agree_word(word, waiting)

    def _exchange_small(self, vector: Any) -> Any:
        self.exchanged += 1
        return super()._exchange_small(vector)

    def _split_transport(self, group: Any, global_ranks: list[int]) -> TorchTransport:
        return StreamOrderedTwin(group, ranks=global_ranks, local_rank=self.local_rank)


def twin_of(comm: TorchCommunicator, *, timeout: Any = None) -> Communicator:
    """A communicator over a new Gloo group of ``comm``'s ranks (a ``split`` of it, every rank
    calling), through :class:`StreamOrderedTwin`."""
    transport = comm._transport
    split = transport._split(0, comm.rank)
    assert split is not None
    twin = StreamOrderedTwin(split._group, ranks=split._global_ranks, local_rank=comm.local_rank)
    twin._name = split._name + "/twin"
    return TorchCommunicator._adopt(twin, timeout=timeout if timeout is not None else comm.timeout,
                                    name=f"{comm.trace_name}/twin")
