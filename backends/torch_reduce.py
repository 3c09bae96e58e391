"""``reduce`` on the torch backend: the one rule of how a reduce of a tensor torch reduces as it
is (``torch_dist._DIRECT``) starts, for the kind's plan (torch_plans) and the row's method
(torch_dist) alike.

Gloo's reduce uses every rank's buffer as scratch: off ``dst`` the caller's x would come back
holding partial results, and the library leaves x as it was off dst. So:

- **Two ranks, a CPU tensor on Gloo:** the rank off dst sends x to dst (torch's ``send``, which
  only reads it) and dst receives it into a kept buffer and reduces it into x there (``x + the
  peer's``, the sum Gloo makes at two ranks, bit for bit). No copy of x anywhere; one message
  where Gloo's reduce makes three steps, so it takes less than the raw ``dist.reduce``. The
  messages carry the reserved tag :data:`~collectives.calls.REDUCE_TAG`, which the library's
  ``send``/``recv`` refuse, so a user's message is never taken for one.
- **More ranks on Gloo:** off dst x is copied into a kept buffer (:class:`Scratch`: made once,
  not a new tensor per call, whose first touch of fresh memory costs more than the copy) and
  Gloo reduces that.
- **Other process groups** (NCCL reads x off dst and writes nothing there; an unknown backend
  might): off dst a copy, as on more ranks.

Imports: the interface (calls, ops); never torch_dist or torch_plans (which call this)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collectives.calls import REDUCE_TAG
from collectives.ops import ReduceOp

#: What a start returns (torch_plans.Started): the result, torch's handle (or one that folds the
#: peer's data in once it arrived) and the tensor AVG divides by the size after.
Started = tuple[Any, Any, Any]

#: The largest buffer a transport keeps between calls (a larger one is made per call).
KEEP_BYTES = 64 << 20


class Scratch:
    """One buffer of bytes a transport keeps for its reduces, taken for the length of a call
    (a call that finds it taken, or too small, makes its own; the larger is kept after)."""

    __slots__ = ("_empty", "_uint8", "_kept")

    def __init__(self, torch: Any) -> None:
        self._empty, self._uint8 = torch.empty, torch.uint8
        self._kept: Any = None

    def take(self, t: Any) -> tuple[Any, Any]:
        """``(buffer, view)``: a buffer of at least t's bytes and a view of it shaped as t."""
        nbytes = t.numel() * t.element_size()
        kept = self._kept
        if kept is not None and kept.numel() >= nbytes:
            self._kept = None
            buffer = kept
        else:
            buffer = self._empty(max(nbytes, 1), dtype=self._uint8)
        return buffer, buffer[:nbytes].view(t.dtype).view(t.shape)

    def give(self, buffer: Any) -> None:
        """Give back what :meth:`take` gave, once the call is done with it."""
        kept = self._kept
        if buffer.numel() <= KEEP_BYTES and (kept is None or kept.numel() < buffer.numel()):
            self._kept = buffer


class Folded:
    """torch's handle of the receive (or of the reduce of a kept copy), and what runs once it
    completed (the peer's data reduced into x; the buffer given back): ``wait`` and
    ``is_completed`` as a torch Work's, for torch_handles._TorchWork and the plans."""

    __slots__ = ("_work", "_then")

    def __init__(self, work: Any, then: Callable[[], None]) -> None:
        self._work = work
        self._then: Callable[[], None] | None = then

    def wait(self, timeout: Any = None) -> bool:
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        then, self._then = self._then, None
        if then is not None:
            then()
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


def _fold(torch: Any, op: ReduceOp) -> Callable[[Any, Any], Any]:
    """``x op= y`` in place, for the ops torch_dist._DIRECT lets through (SUM, PROD, AVG's sum,
    and MIN/MAX of integers)."""
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        return lambda x, y: x.add_(y)
    if op is ReduceOp.PROD:
        return lambda x, y: x.mul_(y)
    if op is ReduceOp.MIN:
        return lambda x, y: torch.minimum(x, y, out=x)
    if op is ReduceOp.MAX:
        return lambda x, y: torch.maximum(x, y, out=x)
    raise ValueError(f"reduce of op {op} is not one torch reduces as it is")


def reducing(transport: Any, pg: Any, options: Any, op: ReduceOp
             ) -> Callable[[Any, Any, Any, Any, bool], Started]:
    """``start(t, root, out, extra, async_op)`` of a reduce of the contiguous tensor ``t`` of a
    dtype and ``op`` torch reduces as it is, on ``transport`` (its group ``pg``; ``options``:
    torch_plans' reduce options, ``options.root(torch_rank, async_op)``). See the module's
    docstring for what runs where."""
    reduce, torch_rank, rank, size = pg.reduce, transport._torch_rank, transport.rank, transport.size
    divide = op is ReduceOp.AVG
    scratch = transport._reduce_scratch
    if scratch is None:
        scratch = transport._reduce_scratch = Scratch(transport._torch)
    pair = size == 2 and transport._on_gloo
    if pair:
        send, recv, fold, peer = pg.send, pg.recv, _fold(transport._torch, op), torch_rank[1 - rank]

    def start(t: Any, root: Any, out: Any, extra: Any, async_op: bool) -> Started:
        if pair and not t.is_cuda:
            if root != rank:  # (send reads x only)
                return t, send([t], torch_rank[root], REDUCE_TAG), None
            buffer, theirs = scratch.take(t)

            def folded() -> None:
                fold(t, theirs)
                scratch.give(buffer)
            return t, Folded(recv([theirs], peer, REDUCE_TAG), folded), t if divide else None
        if root == rank:
            return t, reduce([t], options.root(torch_rank[root], async_op)), t if divide else None
        # Off dst the process group may use its buffer as scratch (Gloo does): a copy goes, x stays.
        if t.is_cuda:
            return t, reduce([t.clone()], options.root(torch_rank[root], async_op)), None
        buffer, copy = scratch.take(t)
        copy.copy_(t)
        return t, Folded(reduce([copy], options.root(torch_rank[root], async_op)),
                         lambda: scratch.give(buffer)), None
    return start
