"""The wire headers: the small int64 vectors ranks exchange next to the data.

- Fingerprints of calls (:func:`fingerprint`, :func:`check_word`): what the ranks compare
  before each collective, described below.
- The uneven collectives' counts header (:func:`uneven_header`): every all_gather_v and
  all_to_all with splits exchanges one to agree on the row counts (where the transport carries
  the counts in the default check's round, only when that round finds the ranks disagree).
- The point-to-point header of debug mode (:func:`p2p_header`): what a send announces.

May import: numpy and collectives' calls, errors and ops (no transport, no call path).

By default (``COLLECTIVES_DEBUG`` unset) every collective is preceded by one small all_reduce
of one 64-bit word per rank (:func:`check_word`): a 31-bit hash of the call's fingerprint and
sequence number next to its complement, reduced with BAND, so every rank learns from the same
result whether every rank made the same call. Only when they did not do the ranks exchange
the full fingerprints below (one all_gather), to say which ranks differ and in what.

With ``COLLECTIVES_DEBUG=1`` (debug mode) every collective all_gathers the full fingerprint, a
fixed-size int64 vector saying what each rank is about to do. Either way a difference raises
:class:`CollectiveMismatch` on every rank (every rank sees the same table, so every rank
raises the same message), naming the fields that differ and which ranks hold which value.
Nothing of the collective itself has been sent then, so the communicator stays usable.

A rank that makes an extra call, or skips one, is out of step: its next exchange meets a
different call on the others (a mismatch), a rank that finished (see
:mod:`collectives.farewell`), or nobody (the timeout).

A rank that refuses a call (a ``TypeError``/``ValueError`` of its arguments, raised before
anything is sent) still takes part in that call's check, where its peers make one: its word is
:data:`REFUSED_WORD`, which never agrees, and its fingerprint is marked refused (what it knows of
the call, and the kind of error). When some ranks refused and others did not, every rank then
exchanges the refusing ranks' reasons (:func:`reason_vector`, a fixed-size vector); the refusing
ranks raise their own error, the others :class:`CollectiveMismatch` naming the ranks that refused
and why (:func:`refusal_mismatch`). Every rank used one sequence number, so the next calls line
up. With checks off (``COLLECTIVES_DEBUG=0`` after a communicator's first call) a refused call
sends nothing: the peers meet this rank's next call.

The vector: ``[MAGIC, sequence number, operation, reduce op, root, dtype, ndim,
dims[0..MAX_DIMS-1] (padded with -1), hash of dims beyond MAX_DIMS, checks level, refused]``
(refused: 0, else :data:`REFUSALS`' code of the error's kind).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import calls
from .errors import CollectiveMismatch
from .ops import DTYPES, ReduceOp

MAGIC = 0x436F6C6C  # "Coll": tells a fingerprint from stray data
MAX_DIMS = 8
LENGTH = 7 + MAX_DIMS + 3
_TAIL = 7 + MAX_DIMS  # the hash of the dims beyond MAX_DIMS
_LEVEL = _TAIL + 1
REFUSED = LENGTH - 1  # the refused mark: 0, or the code of the error's kind (REFUSALS)
#: The kinds of error a rank refuses a call with, by their code in a fingerprint (1, 2).
REFUSALS = (TypeError, ValueError)
#: The check word of a refused call: 0 never passes words_agree, whatever the peers' words are.
REFUSED_WORD = 0
#: The int64 words of a refusing rank's reason (its error's text, UTF-8, cut to fit).
REASON_WORDS = 64

# The operations by their code in the fingerprints (each row of collectives.calls has its code).
_OPERATION_CODES = {row.name: row.code for row in calls.ROWS}
OPERATIONS = tuple(sorted(_OPERATION_CODES, key=_OPERATION_CODES.__getitem__))
_REDUCE_OPS = tuple(ReduceOp)
_REDUCE_CODES = {op: code for code, op in enumerate(_REDUCE_OPS)}
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}

# field name -> its slice of the vector, in the order a message lists them.
FIELDS = {"sequence number": slice(1, 2), "operation": slice(2, 3), "reduce op": slice(3, 4),
          "root": slice(4, 5), "dtype": slice(5, 6), "shape": slice(6, _LEVEL),
          "checks (COLLECTIVES_DEBUG)": slice(_LEVEL, REFUSED)}
_LEVEL_NAMES = {0: "0 (off)", 1: "unset (the default check)", 2: "1 (debug mode)"}


def fingerprint(operation: str, seq: int, reduce_op: ReduceOp | None, root: int,
                dtype: str | None, shape: tuple[int, ...], level: int = 2,
                refused: BaseException | None = None) -> NDArray[Any]:
    """The int64 vector (length :data:`LENGTH`) that describes one call (``level``: the rank's
    checks level, :func:`collectives.config.check_level`; ``refused``: the error this rank
    refused the call with, or None)."""
    vector = np.full(LENGTH, -1, dtype=np.int64)
    vector[0] = MAGIC
    vector[1] = seq
    vector[2] = _OPERATION_CODES[operation]
    vector[3] = -1 if reduce_op is None else _REDUCE_CODES[reduce_op]
    vector[4] = root
    vector[5] = -1 if dtype is None else _DTYPE_CODES[dtype]
    vector[6] = len(shape)
    head = shape[:MAX_DIMS]
    vector[7:7 + len(head)] = head
    if len(shape) > MAX_DIMS:
        vector[_TAIL] = zlib.crc32(repr(shape[MAX_DIMS:]).encode())
    vector[_LEVEL] = level
    vector[REFUSED] = 0 if refused is None else _refusal_code(refused)
    return vector


def _refusal_code(error: BaseException) -> int:
    for code, kind in enumerate(REFUSALS, 1):
        if isinstance(error, kind):
            return code
    return len(REFUSALS) + 1


def reason_vector(error: BaseException | None) -> NDArray[Any]:
    """A refusing rank's reason as :data:`REASON_WORDS` int64 (zeros for a rank that did not
    refuse): ``"TypeError: <its message>"`` in UTF-8, cut to fit."""
    vector = np.zeros(REASON_WORDS, dtype=np.int64)
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode()[:REASON_WORDS * 8]
        vector.view(np.uint8)[:len(text)] = np.frombuffer(text, dtype=np.uint8)
    return vector


def reason_text(row: NDArray[Any]) -> str:
    """The text of one rank's :func:`reason_vector`."""
    return bytes(np.ascontiguousarray(row, dtype=np.int64).view(np.uint8)).rstrip(b"\0").decode(errors="replace")


def refused_ranks(everyone: NDArray[Any]) -> list[int]:
    """The ranks whose fingerprint in ``everyone`` is marked refused."""
    return [rank for rank, row in enumerate(everyone) if row[0] == MAGIC and row[REFUSED] != 0]


def refusal_mismatch(everyone: NDArray[Any], reasons: NDArray[Any], comm: Any,
                     posted: tuple[str, int] | None = None) -> CollectiveMismatch:
    """The error of a rank that made the running call while ``refused_ranks(everyone)`` refused
    it (``reasons``: every rank's :func:`reason_vector`): who refused, and why; how the calls of
    the ranks that did not refuse differ, if they do. ``posted``: the call (operation, number)
    whose check went beside it (see :func:`mismatch`)."""
    refused = refused_ranks(everyone)
    said = "; ".join(f"rank {rank}: {reason_text(reasons[rank])}" for rank in refused)
    made = [rank for rank in range(len(everyone)) if rank not in refused]
    differing = mismatch(everyone[made], comm, made, posted) if made else None
    rest = "" if differing is None else f" The ranks that made it differ too: {differing}"
    who = f"rank{'s' if len(refused) > 1 else ''} {', '.join(map(str, refused))}"
    if posted is not None:
        made_it = "" if comm.rank in refused else f" (rank {comm.rank} made it)"
        return CollectiveMismatch(
            f"{who} refused {posted[0]} call #{posted[1]} on {comm!r}{made_it}: {said}. {POSTED_NOTE}" + rest)
    return CollectiveMismatch(
        f"{who} refused {comm._operation} call #{comm._seq} on {comm!r} (rank {comm.rank} made it) "
        f"before sending anything: {said}. Nothing of this call was sent on any rank; the ranks "
        "stay in step, so their next calls line up." + rest)


#: What a mismatch found by a posted check (beside a call on a device stream) adds.
POSTED_NOTE = ("The call was checked beside it, on its way on the device stream already: this "
               "communicator is aborted, and every later call on it raises.")


_LOW = 0xFFFFFFFF


def call_hash(operation: str, reduce_op: ReduceOp | None, root: int, dtype: str | None,
              shape: tuple[int, ...]) -> int:
    """A 32-bit hash of a call's fingerprint without its sequence number (cached by the
    call path per kind of call; :func:`check_word` adds the number)."""
    return zlib.crc32(fingerprint(operation, 0, reduce_op, root, dtype, shape, 1).tobytes())


def check_word(call_hash: int, seq: int) -> int:
    """The word a rank contributes to the default check: a 31-bit hash ``h`` of the call and
    its sequence number in the high half, its complement in the low half (a non-negative
    int64). The BAND of every rank's word passes :func:`words_agree` exactly when every
    rank's ``h`` is the same: a bit where two ranks differ is 0 in both halves. The one
    definition of the word's format, with :func:`words_agree` (compiled from this source with the
    types of collectives/wire.pxd, where the compiled checks call both in C)."""
    h = (call_hash ^ seq) & 0x7FFFFFFF
    return (h << 32) | (h ^ _LOW)


#: Bit 63 of a check word, which :func:`check_word` leaves clear: this rank runs the call on the
#: transport's fast path (a host view, blocking; and where the transport's round carries x, its
#: x travels in it). The AND of every rank's word keeps it only where every rank set it (a
#: transport may then take a route every rank must take alike); :func:`words_agree` ignores it.
FAST_BIT = -(1 << 63)


def words_agree(reduced: int) -> bool:
    """Whether the BAND of every rank's :func:`check_word` says every rank made the same call."""
    return ((reduced >> 32) | reduced) & _LOW == _LOW


def _describe(field: str, row: NDArray[Any]) -> str:
    """One rank's value of ``field`` in words."""
    if row[0] != MAGIC:
        return "not a fingerprint (that rank is not in debug mode, or out of step)"
    value = int(row[FIELDS[field]][0])
    if field == "sequence number":
        return f"#{value}"
    if field == "operation":
        return OPERATIONS[value] if 0 <= value < len(OPERATIONS) else f"unknown {value}"
    if field == "reduce op":
        return "-" if value < 0 else _REDUCE_OPS[value].name
    if field == "root":
        return "-" if value < 0 else str(value)
    if field == "dtype":
        return "-" if value < 0 else DTYPES[value]
    if field.startswith("checks"):
        return _LEVEL_NAMES.get(value, str(value))
    ndim = value
    dims = [int(d) for d in row[7:7 + min(ndim, MAX_DIMS)]]
    if ndim > MAX_DIMS:
        return f"({', '.join(map(str, dims))}, ... {ndim} dims, tail hash {int(row[_TAIL]):#x})"
    return str(tuple(dims))


def mismatch(everyone: NDArray[Any], comm: Any, ranks: list[int] | None = None,
             posted: tuple[str, int] | None = None) -> CollectiveMismatch | None:
    """``CollectiveMismatch`` describing how the rows of ``everyone`` (those of ``ranks``,
    default every rank in order) differ, or ``None``. ``posted``: the call (operation, number)
    whose check went beside it (``Transport._post_check``), found off the call path; else the
    running call, checked before it sent anything."""
    if (everyone == everyone[0]).all():
        return None
    differences = []
    for field, columns in FIELDS.items():
        if len({tuple(row[columns]) for row in everyone}) == 1:
            continue
        values: dict[str, list[int]] = {}
        for rank, row in zip(ranks or range(len(everyone)), everyone):
            values.setdefault(_describe(field, row), []).append(rank)
        held = "; ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} "
                         f"{', '.join(map(str, ranks))}" for value, ranks in values.items())
        differences.append(f"{field} differs: {held}")
    where, sent = (f"{comm._operation} call #{comm._seq}", "Nothing of this call was sent.") if posted is None \
        else (f"{posted[0]} call #{posted[1]}", POSTED_NOTE)
    if all(difference.startswith("checks") for difference in differences):
        return CollectiveMismatch(
            f"ranks check their calls differently ({where} on "
            f"{comm!r}, rank {comm.rank}): {differences[0]}. Set COLLECTIVES_DEBUG the same on "
            "every rank (the ranks' checks are collectives: they must all make the same). " + sent)
    return CollectiveMismatch(
        f"ranks made different collective calls ({where} on "
        f"{comm!r}, rank {comm.rank}): " + " | ".join(differences)
        + ". Every rank must make the same collectives in the same order, with the same "
        "reduce op, root, dtype and shape. " + sent
    )


# -- the uneven collectives' counts ------------------------------------------------------
# all_gather_v and the uneven all_to_all exchange one small vector per rank before the
# data: [rows, dtype, ndim, dims[1..MAX_DIMS-1] (padded with -1), hash of the dims beyond,
# rows of out (-1: none), then for all_to_all the rank's send_splits]. Every rank sees
# every rank's vector, so every rank finds the same disagreement and raises the same error.

_HEADER = 4 + MAX_DIMS  # rows, dtype, ndim, MAX_DIMS - 1 dims, tail hash, out rows


def uneven_header(shape: tuple[int, ...], dtype: str, out_rows: int | None,
                  splits: Any, size: int) -> NDArray[Any]:
    rest = [int(d) for d in shape[1:MAX_DIMS]]
    tail = zlib.crc32(repr(shape[MAX_DIMS:]).encode()) if len(shape) > MAX_DIMS else -1
    values = [int(shape[0]), _DTYPE_CODES[dtype], len(shape), *rest, *[-1] * (MAX_DIMS - 1 - len(rest)),
              tail, -1 if out_rows is None else out_rows]
    if splits is not None:
        values += [int(count) for count in splits]
    return np.array(values, dtype=np.int64)


def header_rows(everyone: NDArray[Any]) -> list[int]:
    """Each rank's x.shape[0], from the exchanged vectors."""
    return everyone[:, 0].tolist()  # type: ignore[no-any-return]


def header_splits(everyone: NDArray[Any], size: int) -> list[list[int]]:
    """``splits[i][j]``: rows rank i sends to rank j, from the exchanged vectors."""
    return everyone[:, _HEADER:_HEADER + size].tolist()  # type: ignore[no-any-return]


def _uneven_agree(rows: list[list[int]], with_splits: bool) -> bool:
    """Whether the exchanged vectors agree (dtype, trailing shape) and every ``out`` has the
    rows its rank receives: :func:`uneven_mismatch`'s common case, in plain Python."""
    first = rows[0][1:_HEADER - 1]  # dtype, ndim, dims, tail hash
    if any(row[1:_HEADER - 1] != first for row in rows):
        return False
    total = 0 if with_splits else sum(row[0] for row in rows)
    for rank, row in enumerate(rows):
        out_rows = row[_HEADER - 1]
        if out_rows >= 0:
            need = sum(other[_HEADER + rank] for other in rows) if with_splits else total
            if out_rows != need:
                return False
    return True


def _rest_shape(row: NDArray[Any]) -> str:
    ndim = int(row[2])
    dims = [int(d) for d in row[3:3 + max(0, min(ndim, MAX_DIMS) - 1)]]
    if ndim > MAX_DIMS:
        return f"({', '.join(map(str, dims))}, ... {ndim - 1} dims)"
    return str(tuple(dims))


def _held(values: list[str]) -> str:
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    return "; ".join(f"{value} on rank{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}"
                     for value, held in ranks.items())


def uneven_mismatch(everyone: NDArray[Any], comm: Any, operation: str,
                    with_splits: bool) -> ValueError | None:
    """``ValueError`` when the ranks' dtypes or trailing shapes differ, or some rank's ``out``
    has the wrong number of rows; else ``None``. The same message on every rank."""
    # (no rank in it: every rank raises the very same message)
    if _uneven_agree(everyone.tolist(), with_splits):
        return None
    where = f"{operation} (call #{comm._seq}, backend {comm.backend}, size {comm.size})"
    dtypes = [DTYPES[int(row[1])] for row in everyone]
    if len(set(dtypes)) > 1:
        return ValueError(f"{where} needs the same dtype on every rank; dtype differs: "
                          f"{_held(dtypes)}. Nothing of the data was sent.")
    rests = [_rest_shape(row) for row in everyone]
    if len({tuple(row[2:3 + MAX_DIMS]) for row in everyone}) > 1:
        return ValueError(f"{where} needs x.shape[1:] equal on every rank; x.shape[1:] differs: "
                          f"{_held(rests)}. Nothing of the data was sent.")
    if with_splits:
        splits = header_splits(everyone, comm.size)
        totals = [sum(row[rank] for row in splits) for rank in range(comm.size)]
    else:
        totals = [int(everyone[:, 0].sum())] * comm.size
    wrong = [(rank, int(row[3 + MAX_DIMS]), totals[rank]) for rank, row in enumerate(everyone)
             if row[3 + MAX_DIMS] >= 0 and row[3 + MAX_DIMS] != totals[rank]]
    if wrong:
        described = "; ".join(f"out.shape[0]={got} on rank {rank}, which receives {need} rows"
                              for rank, got, need in wrong)
        return ValueError(f"{where}: out has the wrong number of rows: {described}. "
                          "Nothing of the data was sent.")
    return None


# -- point-to-point (debug mode): a header before each payload --------------------------------

def p2p_header(dtype: str, shape: tuple[int, ...], tag: int, nbytes: int) -> NDArray[Any]:
    """What a debug-mode send sends ahead of its payload (and a recv expects): the
    fingerprint of a ``send`` with the tag as root, then the payload's size in bytes."""
    return np.append(fingerprint("send", 0, None, tag, dtype, shape), np.int64(nbytes))


def p2p_nbytes(header: NDArray[Any]) -> int:
    return int(header[-1])


def _p2p_side(header: NDArray[Any]) -> str:
    ndim = int(header[6])
    dims = [int(d) for d in header[7:7 + min(ndim, MAX_DIMS)]]
    shape = "(" + ", ".join(map(str, dims)) + ("," if ndim == 1 else "") + \
        (", ..." if ndim > MAX_DIMS else "") + ")"
    return f"shape {shape}, {DTYPES[int(header[5])]}, {int(header[-1])} bytes"


def p2p_mismatch(mine: NDArray[Any], theirs: NDArray[Any], comm: Any, src: int,
                 tag: int) -> CollectiveMismatch | None:
    """``CollectiveMismatch`` naming both sides unless the sender's header matches this recv."""
    if int(theirs[0]) != MAGIC:
        return CollectiveMismatch(
            f"recv from rank {src} (tag {tag}) on {comm!r}: the message there is no debug-mode "
            "header; is COLLECTIVES_DEBUG=1 set on every rank?")
    if np.array_equal(mine[5:], theirs[5:]):
        return None
    return CollectiveMismatch(
        f"recv from rank {src} (tag {tag}) on {comm!r} does not match the send: rank {src} sent "
        f"{_p2p_side(theirs)}; rank {comm.rank} receives into {_p2p_side(mine)}. The payload "
        "was received into scratch memory (x is untouched), so the ranks stay in step")
