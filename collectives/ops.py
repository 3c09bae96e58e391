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

    ``TypeError`` names the dtype, the op and the ops allowed on that dtype.
    """
    try:
        return _PAIR_CACHE[(dtype, op)]
    except (KeyError, TypeError):
        pass
    resolved = resolve_op(op)
    allowed = ALLOWED_OPS[dtype]
    if resolved not in allowed:
        names = ", ".join(o.name for o in ReduceOp if o in allowed)
        raise TypeError(
            f"op={resolved.name} is not allowed on dtype {dtype}; allowed on {dtype}: {names}"
        )
    try:
        _PAIR_CACHE[(dtype, op)] = resolved
    except TypeError:  # unhashable spelling: valid but not cached
        pass
    return resolved
