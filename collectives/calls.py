"""The table of calls: one row per collective, read by the one call path of
:class:`collectives.Communicator`.

Each row says what the call path checks for that collective (is ``op`` reduced and
checked against the dtype x op table, is ``x`` written in place, which argument is a
root rank, which shapes are allowed, what shape an ``out=`` array must have), how its
call is described in a debug-mode fingerprint, and which method of the backend does
the work. Adding a collective is adding a row here and a public method that hands its
arguments to ``Communicator._run``; the checks, the sequence number, the fingerprint,
the timeout and the error mapping come with the path, never with the method.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Shape = tuple[int, ...]


def _own_path(*args: Any) -> Any:
    raise AssertionError("this call has a path of its own; the table does not run it")


@dataclass(frozen=True, eq=False, slots=True)
class Call:
    """How the call path treats one collective (hashed by identity: a key of the call
    path's plans)."""

    #: The operation's name, as error messages and fingerprints show it.
    name: str
    #: ``op`` is a reduce op, checked against the dtype x op table.
    reduces: bool = False
    #: ``x`` is written in place (it must be writable; autograd tensors refused).
    in_place: bool = False
    #: The name of the root argument ("src" or "dst"), checked as a rank; ``None``: no root.
    root: str | None = None
    #: ``False`` for point-to-point calls: they take no part in the communicator's
    #: sequence numbers or fingerprints (only two ranks make them).
    collective: bool = True
    #: ``ValueError`` for shapes (and extra arguments) this collective cannot take:
    #: ``(comm, x.shape, extra, root)``.
    check: Callable[[Any, Shape, Any, Any], None] | None = None
    #: The shape an ``out=`` array must have, from x's shape (and the extra argument).
    out_shape: Callable[[Any, Shape, Any], Shape] | None = None
    #: The shape a fingerprint compares (dimensions that may differ by design are -1).
    fingerprint_shape: Callable[[Shape], Shape] = tuple
    #: Does the work: ``(comm, x, adapter, dtype, op, root, out, async_op, extra)``.
    #: Calls with a path of their own (barrier, split) keep the default.
    run: Callable[..., Any] = _own_path


# -- shape rules ---------------------------------------------------------------------------

def rows_divisible(comm: Any, shape: Shape, extra: Any, root: Any) -> None:
    if not shape:
        raise ValueError("reduce_scatter needs x with at least one dimension; got a 0-d array")
    if shape[0] % comm.size:
        raise ValueError(f"reduce_scatter needs x.shape[0] divisible by size={comm.size}; "
                         f"got x.shape={shape}")


def rows_equal_size(name: str) -> Callable[[Any, Shape, Any, Any], None]:
    def check(comm: Any, shape: Shape, extra: Any, root: Any) -> None:
        if not shape or shape[0] != comm.size:
            raise ValueError(f"{name} needs x of shape (size, ...) with size={comm.size} rows, "
                             f"one per rank; got x.shape={shape}")
    return check


def at_least_one_dim(name: str) -> Callable[[Any, Shape, Any, Any], None]:
    def check(comm: Any, shape: Shape, extra: Any, root: Any) -> None:
        if not shape:
            raise ValueError(f"{name} needs x with at least one dimension (rows); got a 0-d array")
    return check


def check_splits(comm: Any, shape: Shape, splits: Sequence[int], root: Any) -> None:
    """``send_splits``: ``size`` non-negative ints that sum to ``x.shape[0]``."""
    if not shape:
        raise ValueError("all_to_all with send_splits needs x with at least one dimension; "
                         "got a 0-d array")
    if isinstance(splits, (str, bytes)) or not hasattr(splits, "__len__"):
        raise TypeError(f"send_splits must be a list of {comm.size} ints (rows for each rank) "
                        f"or None; got {type(splits).__name__}")
    if len(splits) != comm.size:
        raise ValueError(f"send_splits must have one entry per rank (size={comm.size}); "
                         f"got {len(splits)}")
    for count in splits:
        if isinstance(count, bool) or not _is_int(count):
            raise TypeError(f"send_splits must hold ints; got {type(count).__name__}")
        if count < 0:
            raise ValueError(f"send_splits must be >= 0; got {list(splits)}")
    if sum(int(c) for c in splits) != shape[0]:
        raise ValueError(f"send_splits must sum to x.shape[0]={shape[0]}; got {list(splits)} "
                         f"(sum {sum(int(c) for c in splits)})")


def peer_and_tag(name: str) -> Callable[[Any, Shape, Any, Any], None]:
    """send/recv: the peer is another rank; ``tag`` a non-negative int."""
    def check(comm: Any, shape: Shape, tag: Any, peer: Any) -> None:
        if peer == comm.rank:
            raise ValueError(f"{name}={peer} is this rank; point-to-point calls go to another "
                             f"rank (valid: 0 to {comm.size - 1} except {comm.rank})")
        if isinstance(tag, bool) or not _is_int(tag):
            raise TypeError(f"tag must be an int; got {type(tag).__name__}")
        if not 0 <= tag < 2**31 - 1:
            raise ValueError(f"tag must be between 0 and 2**31 - 2; got {tag}")
    return check


def _is_int(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


# -- out= shapes ----------------------------------------------------------------------------

def stacked(comm: Any, shape: Shape, extra: Any) -> Shape:
    return (comm.size, *shape)


def block_of_rows(comm: Any, shape: Shape, extra: Any) -> Shape:
    return (shape[0] // comm.size, *shape[1:])


def one_row(comm: Any, shape: Shape, extra: Any) -> Shape:
    return tuple(shape[1:])


def same_shape(comm: Any, shape: Shape, extra: Any) -> Shape:
    return tuple(shape)


def rows_free(shape: Shape) -> Shape:
    """Fingerprint shape of calls whose first dimension differs between ranks by design."""
    return (-1, *shape[1:]) if shape else ()
