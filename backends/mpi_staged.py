"""The fast paths' staged persistent requests (see ``MPIChannel._staged``): a small call under a
timeout, where every rank runs it on its fast path, goes through an MPI-4 persistent collective of
its own shape (``MPI_Allreduce_init``, ``MPI_Allgather_init``, ...) made once on a staging array
kept for it: x copied into the array's first bytes, the request started and completed, the result
copied out of its last bytes (``MPIChannel._run_staged``, compiled as the Round's ``staged``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from collectives import calls

#: Calls of at most this many bytes go through a staged persistent request (see MPIChannel._staged).
STAGED_BYTES = 4096
#: The calls whose result is x itself: their staging array is both buffers.
_IN_PLACE = (calls.ALL_REDUCE, calls.BROADCAST, calls.REDUCE)

FastPath = Callable[[Any, Any, Any, Any], Any]
BOTH = (True, True)


def staged_table(channel: Any, call: Any, dtype: str, op: Any) -> dict[Any, tuple[Any, Any]] | None:
    """The channel's table of staged requests of this kind of call (``MPIChannel._staged``), or
    None where the call keeps none: the gathering calls (all_gather, gather, scatter, all_to_all,
    reduce_scatter) where the library's persistent all_gather is wrong (``_stages_gathers``)."""
    if call not in _IN_PLACE and not channel._stages_gathers:
        return None
    return channel._staged((call, dtype, op))  # type: ignore[no-any-return]


def staged_or(channel: Any, table: dict[Any, tuple[Any, Any]] | None, plain: FastPath,
              make: Callable[[Any, Any, Any], Any], *, rooted: bool, sends: tuple[bool, bool] = BOTH,
              gets: tuple[bool, bool] = BOTH, result_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None,
              new: Any = None, avg: bool = False) -> FastPath:
    """``plain``, or for a small call under a timeout its staged persistent request over
    ``channel`` (an MPIChannel; ``table``: its table for this kind of call, None where it keeps
    none): ``make(send, recv, root)`` makes it, on views of a staging array kept per shape (and
    root, where ``rooted``). ``sends[mine]`` and ``gets[mine]``: whether this rank copies x in
    and a result out, ``mine`` being whether the call is not rooted or this rank is its root. The
    result is x itself where ``result_shape`` is None (all_reduce, broadcast, reduce: the staging
    array is both buffers), else a new one of ``result_shape(x.shape)`` (``new(buf, shape, out)``:
    the result and its buffer), None where this rank gets none; ``avg``: divided by the size."""
    if table is None:
        return plain
    stage, rank, size = channel._stage, channel.rank, channel.size
    run = channel._run_staged if channel._compiled_round is None else channel._compiled_round.staged

    def made(buf: Any, root: Any) -> Any:
        shape = buf.shape
        if result_shape is None:
            return stage(table, (shape, root) if rooted else shape, shape, buf.dtype,
                         lambda array: make(array, array, root))
        n, got = buf.size, result_shape(shape)
        return stage(table, (shape, root) if rooted else shape, (n + math.prod(got),), buf.dtype,
                     lambda array: make(array[:n].reshape(shape), array[n:].reshape(got), root))

    def staged(buf: Any, root: Any, out: Any, extra: Any) -> Any:
        if not 0 < buf.nbytes <= STAGED_BYTES or channel.timeout is None or not channel._everyone_fast:
            return plain(buf, root, out, extra)
        request, array = table.get((buf.shape, root) if rooted else buf.shape) or made(buf, root)
        mine = not rooted or root == rank
        if result_shape is None:  # (x is the result)
            result, recv = buf, buf if gets[mine] else None
        elif gets[mine]:
            result, recv = new(buf, result_shape(buf.shape), out)
        else:
            result = recv = None
        run(request, buf if sends[mine] else None, array, recv)
        if avg and gets[mine]:
            result /= size
        return result
    return staged
