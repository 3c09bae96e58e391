"""Reduce operations and the dtype x op table: the one place these rules live.

Every backend asks :func:`check_reduction` before it sends anything, so a pair
that is not allowed is the same ``TypeError`` on every backend and every rank.
"""

from __future__ import annotations

import enum


class ReduceOp(str, enum.Enum):
    """Reduction applied by ``all_reduce`` and ``reduce_scatter``.

    Strings are accepted wherever a ``ReduceOp`` is, in any case (``"sum"``,
    ``"Max"``). ``AVG`` is ``SUM`` divided by the communicator's size, for
    floating dtypes only. On ``bool``, ``MIN`` is logical AND and ``MAX`` is
    logical OR.
    """

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __str__(self) -> str:  # "sum", not "ReduceOp.SUM", in messages
        return self.value


#: The boolean dtype.
BOOL_DTYPES = ("bool",)
#: The integer dtypes (SUM and PROD wrap around).
INTEGER_DTYPES = ("int8", "uint8", "int16", "int32", "int64")
#: The floating-point dtypes (the only ones with AVG).
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Every dtype a collective accepts, in the order of the README's table.
DTYPES = BOOL_DTYPES + INTEGER_DTYPES + FLOAT_DTYPES

_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
_ARITHMETIC = frozenset({ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX})

#: The dtype x op table: dtype name -> the reduce ops allowed on it (the README shows it).
ALLOWED_OPS: dict[str, frozenset[ReduceOp]] = {
    "bool": frozenset({ReduceOp.MIN, ReduceOp.MAX}) | _BITWISE,
    **{name: _ARITHMETIC | _BITWISE for name in INTEGER_DTYPES},
    **{name: _ARITHMETIC | {ReduceOp.AVG} for name in FLOAT_DTYPES},
}

# Any spelling a caller used before -> ReduceOp, so the call path pays one dict lookup.
_OP_CACHE: dict[object, ReduceOp] = {op: op for op in ReduceOp}
# (dtype, spelling) -> ReduceOp for pairs already found valid.
_PAIR_CACHE: dict[tuple[str, object], ReduceOp] = {}


# What to do instead, by the kind of pair the table refuses (read from the table itself).
_INSTEAD = {
    ReduceOp.AVG: "cast x to a float dtype first (numpy: x.astype(np.float32); torch: x.float()), "
                  "or reduce with SUM and divide by the communicator's size",
    ReduceOp.SUM: "for a count, cast x to an integer dtype first (x.astype(np.int32), x.int()); for "
                  "a logical OR or AND, use MAX or MIN",
    ReduceOp.PROD: "for a logical AND use MIN (or BAND); or cast x to an integer dtype first",
}
_BITWISE_INSTEAD = ("bitwise ops take bool and integer dtypes: reduce the bits through an integer view "
                    "of x of the same width (float32 as int32; numpy: x.view(np.int32), torch: "
                    "x.view(torch.int32)), or use MIN/MAX")
_OTHERWISE = "use an op allowed on this dtype, or cast x to a dtype the op is allowed on"


def refusal(dtype: str, op: ReduceOp) -> str:
    """The message of ``op`` refused on ``dtype`` (the table's answer): the ops allowed on
    ``dtype``, the dtypes ``op`` is allowed on, and what to do instead."""
    on_dtype = ", ".join(o.name for o in ReduceOp if o in ALLOWED_OPS[dtype])
    dtypes = ", ".join(name for name in DTYPES if op in ALLOWED_OPS[name])
    instead = _BITWISE_INSTEAD if op in _BITWISE else _INSTEAD.get(op, _OTHERWISE)
    return (f"op={op.name} is not allowed on dtype {dtype}; allowed on {dtype}: {on_dtype}; "
            f"{op.name} is allowed on: {dtypes}. What to do: {instead}")


def resolve_op(op: object) -> ReduceOp:
    """Return the ``ReduceOp`` that ``op`` names; ``ValueError`` listing the valid names."""
    try:
        return _OP_CACHE[op]
    except (KeyError, TypeError):
        pass
    if isinstance(op, str):
        try:
            resolved = ReduceOp(op.lower())
        except ValueError:
            resolved = None
        if resolved is not None:
            _OP_CACHE[op] = resolved
            return resolved
    valid = ", ".join(o.name for o in ReduceOp)
    raise ValueError(f"op={op!r} is not a reduce op; valid: {valid} (strings in any case)")


def check_reduction(dtype: str, op: object) -> ReduceOp:
    """Return the ``ReduceOp`` for ``op`` if the table allows it on ``dtype``.

    ``TypeError`` (:func:`refusal`'s message) names the dtype, the op, the ops allowed on that
    dtype, the dtypes that op is allowed on, and what to do.
    """
    try:
        return _PAIR_CACHE[(dtype, op)]
    except (KeyError, TypeError):
        pass
    resolved = resolve_op(op)
    if resolved not in ALLOWED_OPS[dtype]:
        raise TypeError(refusal(dtype, resolved))
    try:
        _PAIR_CACHE[(dtype, op)] = resolved
    except TypeError:  # unhashable spelling: valid but not cached
        pass
    return resolved
