"""The fast paths' staged persistent requests (see ``MPIChannel._staged``): a small call under a
timeout, where every rank runs it on its fast path, goes through an MPI-4 persistent collective of
its own shape (``MPI_Allreduce_init``, ``MPI_Allgather_init``, ...) made once on a staging array
kept for it: x copied into the array's first bytes, the request started and completed, the result
copied out of its last bytes (``MPIChannel._run_staged``, compiled as the Round's ``staged``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

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


def staged(channel: Any, table: dict[Any, tuple[Any, Any]] | None, make: Callable[[Any, Any, Any], Any], *,
           rooted: bool, sends: tuple[bool, bool] = BOTH, gets: tuple[bool, bool] = BOTH,
           result_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None,
           new: Any = None, avg: bool = False) -> FastPath | None:
    """The run of a small call under a timeout through its staged persistent request over
    ``channel`` (an MPIChannel; ``table``: its table for this kind of call; None where it keeps
    none, and then None), ``run(buf, root, out, extra)``, which the fast path (backends/mpi_moves.py)
    calls where x has at most STAGED_BYTES, there is a timeout and every rank runs the call on its
    fast path: ``make(send, recv, root)`` makes the request, on views of a staging array kept per
    shape (and root, where ``rooted``). ``sends[mine]`` and ``gets[mine]``: whether this rank copies
    x in and a result out, ``mine`` being whether the call is not rooted or this rank is its root.
    The result is x itself where ``result_shape`` is None (all_reduce, broadcast, reduce: the
    staging array is both buffers), else a new one of ``result_shape(x.shape)`` (``new(buf, shape,
    out)``: the result and its buffer), None where this rank gets none; ``avg``: divided by the size."""
    if table is None:
        return None
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

    def staged_run(buf: Any, root: Any, out: Any, extra: Any) -> Any:
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
    return staged_run


# -- the uneven collectives past the round's payload -----------------------------------------

#: An uneven call whose x is host memory of at most this many bytes on every rank, not all of it
#: in the check's round, goes through a staged request (see backends/mpi_uneven.py).
UNEVEN_BYTES = 8192
#: The dtype and op of an uneven call's table of staged requests (its kind: (call, dtype, op); the
#: uneven method looks its requests up there, backends/mpi_uneven.py).
UNEVEN_STAGED = ("uint8", None)


def uneven_stage(channel: Any, call: Any, block: int) -> tuple[Any, Any] | None:
    """The staged request of an uneven ``call`` with blocks of ``block`` bytes and its staging
    array (what this rank sends, then what it gets), made now where it is not yet (collective:
    every rank makes it at the same call, as the counts decide it, and every rank has them); None
    where the channel keeps none. all_gather_v: ``MPI_Allgather_init`` of one block a rank; the
    uneven all_to_all: ``MPI_Alltoall_init`` of one block a pair."""
    table = staged_table(channel, call, *UNEVEN_STAGED)
    if table is None:
        return None
    entry = table.get(block)
    if entry is None:
        gathered, size = call is calls.ALL_GATHER_V, channel.size
        sends = block if gathered else size * block
        comm, byte = channel._comm, channel._byte
        init = comm.Allgather_init if gathered else comm.Alltoall_init
        entry = channel._stage(table, block, (sends + size * block,), np.uint8,
                               lambda stage: init([stage[:sends], byte], [stage[sends:], byte]))
    return entry
