"""Hypothesis strategies for what collectives take, and the project's Hypothesis profiles.

This is the only module of ``collectives.testing`` that imports hypothesis (``import
collectives.testing`` does not need it). Every array strategy draws numpy *carriers*
(see :mod:`.reference`): the array of the dtype itself, or for bfloat16 a float32 array
whose values are exactly bfloat16 values (low 16 bits zero, NaN payloads included);
ranks turn a carrier into the numpy array or torch tensor they hand to a collective
with :func:`collectives.testing.reference.as_array`. For example::

    from hypothesis import given, strategies as st
    from collectives.testing import strategies as cst

    @given(st.data())
    def test_sum(world, data):
        dtype, op = data.draw(cst.dtype_and_op())
        shape = data.draw(cst.shapes())
        inputs = data.draw(cst.rank_arrays(dtype, shape, world.size))
        ...

Profiles (registered by the pytest plugin, picked by ``COLLECTIVES_HYPOTHESIS_PROFILE``,
default ``ci``; ``pytest --hypothesis-profile=NAME`` wins over the variable):

- ``ci``: 50 examples per test, no deadline (an example crosses processes), derandomized
  (the same examples on every run, so CI is reproducible), prints the reproduction blob.
- ``dev``: 400 examples per test, random, no deadline: a deeper search on a workstation.
"""

from __future__ import annotations

import os
from typing import Any, Literal, cast

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numpy.typing import NDArray

from .. import config
from ..ops import ALLOWED_OPS, BOOL_DTYPES, DTYPES, FLOAT_DTYPES, INTEGER_DTYPES, ReduceOp
from .reference import LAYOUTS, LIBRARIES, round_to_bfloat16

__all__ = [
    "PROFILES", "array_layouts", "array_libraries", "arrays", "disallowed_dtype_and_op",
    "dtype_and_op", "dtypes", "edge_values", "element_values", "load_profile", "ops",
    "rank_arrays", "register_profiles", "roots", "row_counts", "shapes", "splits_matrices",
    "world_sizes",
]

# -- profiles -------------------------------------------------------------------------------

# Examples cross processes (too_slow), carry arrays (data_too_large), and the ``world``
# fixture is a session-wide pool behind a function-scoped fixture (harmless to reuse).
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]

#: Name -> settings of the project's Hypothesis profiles.
PROFILES: dict[str, dict[str, Any]] = {
    "ci": dict(max_examples=50, deadline=None, derandomize=True, print_blob=True,
               suppress_health_check=_QUIET),
    "dev": dict(max_examples=400, deadline=None, print_blob=True,
                suppress_health_check=_QUIET),
}
#: The profile used when ``COLLECTIVES_HYPOTHESIS_PROFILE`` is unset. ``ci`` everywhere,
#: so that a plain ``make test`` on any machine keeps CI's time budget.
DEFAULT_PROFILE = "ci"


def register_profiles() -> None:
    """Register :data:`PROFILES` with Hypothesis (idempotent)."""
    for name, values in PROFILES.items():
        settings.register_profile(name, **values)


def load_profile(name: str | None = None) -> str:
    """Register the profiles and load ``name`` (default: ``COLLECTIVES_HYPOTHESIS_PROFILE``,
    else ``ci``); return its name. Any registered profile may be named."""
    register_profiles()
    name = name or os.environ.get(config.HYPOTHESIS_PROFILE) or DEFAULT_PROFILE
    try:
        settings.load_profile(name)
    except Exception as error:  # hypothesis raises InvalidArgument for unknown names
        raise ValueError(f"{config.HYPOTHESIS_PROFILE}={name!r} is not a Hypothesis profile; "
                         f"the project's: {', '.join(PROFILES)}") from error
    return name


# -- what a collective is called with ---------------------------------------------------------

def world_sizes(min_size: int = 1, max_size: int = 4) -> st.SearchStrategy[int]:
    """Numbers of ranks, ``min_size`` to ``max_size``; shrinks towards ``min_size``."""
    return st.integers(min_size, max_size)


def roots(size: int) -> st.SearchStrategy[int]:
    """A valid ``src`` for ``broadcast`` on ``size`` ranks (shrinks towards 0)."""
    return st.integers(0, size - 1)


def dtypes(kinds: tuple[str, ...] = ("bool", "integer", "float")) -> st.SearchStrategy[str]:
    """dtype names of :data:`collectives.ops.DTYPES`, restricted to ``kinds``."""
    chosen = {"bool": BOOL_DTYPES, "integer": INTEGER_DTYPES, "float": FLOAT_DTYPES}
    names = [name for name in DTYPES if any(name in chosen[k] for k in kinds)]
    return st.sampled_from(names)


def _spelled(op: ReduceOp) -> st.SearchStrategy[Any]:
    """``op`` as the enum or as a string in any case ("sum", "SUM", "Sum")."""
    return st.one_of(st.just(op), st.sampled_from([op.value, op.value.upper(),
                                                   op.value.capitalize()]))


def ops(dtype: str | None = None, *, spellings: bool = False) -> st.SearchStrategy[Any]:
    """Reduce ops allowed on ``dtype`` (any op when ``None``); with ``spellings`` also as
    strings in any case, which collectives accept wherever a ``ReduceOp`` goes."""
    allowed = [op for op in ReduceOp if dtype is None or op in ALLOWED_OPS[dtype]]
    base = st.sampled_from(allowed)
    return base.flatmap(_spelled) if spellings else base


def dtype_and_op(kinds: tuple[str, ...] = ("bool", "integer", "float"), *,
                 spellings: bool = False) -> st.SearchStrategy[tuple[str, Any]]:
    """An allowed (dtype, op) pair of the dtype x op table (:data:`collectives.ops.ALLOWED_OPS`)."""
    return dtypes(kinds).flatmap(lambda d: st.tuples(st.just(d), ops(d, spellings=spellings)))


def disallowed_dtype_and_op(*, spellings: bool = False) -> st.SearchStrategy[tuple[str, Any]]:
    """A (dtype, op) pair the table forbids: every collective must raise ``TypeError``."""
    pairs = [(d, op) for d in DTYPES for op in ReduceOp if op not in ALLOWED_OPS[d]]
    base = st.sampled_from(pairs)
    if not spellings:
        return base
    return base.flatmap(lambda pair: st.tuples(st.just(pair[0]), _spelled(pair[1])))


def shapes(*, min_dims: int = 0, max_dims: int = 3, max_side: int = 5,
           first: int | None = None) -> st.SearchStrategy[tuple[int, ...]]:
    """Array shapes with ``min_dims``..``max_dims`` axes of length 0..``max_side``.

    0-d (``()``) and 0-size shapes are included (and shrunk towards). ``first`` fixes a
    multiple for axis 0 (reduce_scatter's ``shape[0] % size == 0``): axis 0 is then
    ``first * k`` for k in 0..``max_side``.
    """
    if first is None:
        return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=0,
                                max_side=max_side)
    rest = hnp.array_shapes(min_dims=0, max_dims=max(max_dims - 1, 0), min_side=0,
                            max_side=max_side)
    return st.tuples(st.integers(0, max_side), rest).map(lambda kr: (first * kr[0], *kr[1]))


def row_counts(size: int, *, max_rows: int = 4) -> st.SearchStrategy[list[int]]:
    """Rows per rank for the uneven collectives (all_gather_v): ``size`` ints in
    0..``max_rows``; zeros (a rank with nothing) included and shrunk towards."""
    return st.lists(st.integers(0, max_rows), min_size=size, max_size=size)


def splits_matrices(size: int, *, max_rows: int = 3) -> st.SearchStrategy[list[list[int]]]:
    """A matrix of ``all_to_all`` splits: row ``i`` is rank ``i``'s ``send_splits`` (rows it
    sends to each rank); zero-length pieces and ranks that send nothing included. Rank
    ``i``'s x then has ``sum(matrix[i])`` rows; the transpose sends everything back."""
    return st.lists(row_counts(size, max_rows=max_rows), min_size=size, max_size=size)


def array_libraries() -> st.SearchStrategy[str]:
    """"numpy" or "torch": which array the ranks build from a carrier."""
    return st.sampled_from(LIBRARIES)


def array_layouts() -> st.SearchStrategy[str]:
    """"contiguous" or "strided" (a non-contiguous view the collective must write into)."""
    return st.sampled_from(LAYOUTS)


def _float_info(dtype: str) -> tuple[Literal[16, 32, 64], float, float, float]:
    """(width in bits, largest, smallest normal, smallest subnormal) of a float dtype."""
    if dtype == "bfloat16":
        return 32, 3.3895313892515355e38, 2.0 ** -126, 2.0 ** -133
    info = np.finfo(dtype)
    # The widths of FLOAT_DTYPES (float16/32/64): the ones hypothesis draws.
    return (cast(Literal[16, 32, 64], info.bits), float(info.max), float(info.smallest_normal),
            float(info.smallest_subnormal))


def edge_values(dtype: str) -> list[Any]:
    """The values collectives get wrong first, for ``dtype``.

    Floats: NaN, -NaN, +-inf, 0.0, -0.0, +-1, +-largest, +-smallest normal, +-smallest
    subnormal. Integers: 0, +-1, the type's min and max (and min + 1, max - 1). bool:
    False, True.
    """
    if dtype == "bool":
        return [False, True]
    if dtype in INTEGER_DTYPES:
        info = np.iinfo(dtype)
        values = {0, 1, int(info.min), int(info.max), int(info.min) + 1, int(info.max) - 1}
        if info.min < 0:
            values.add(-1)
        return sorted(values)
    _, largest, normal, subnormal = _float_info(dtype)
    return [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0,
            largest, -largest, normal, -normal, subnormal, -subnormal]


def element_values(dtype: str, *, edges: bool = True,
                   allow_nan: bool = True, allow_infinity: bool = True) -> st.SearchStrategy[Any]:
    """Single values of ``dtype`` (Python scalars; bfloat16 as float32-representable floats
    that :func:`arrays` rounds to bfloat16). With ``edges``, :func:`edge_values` come often.

    Floats are drawn mostly within +-largest/8, so that a sum over 4 ranks stays finite
    and the error bound is actually checked; the edge values bring the extremes.
    """
    if dtype == "bool":
        return st.booleans()
    if dtype in INTEGER_DTYPES:
        info = np.iinfo(dtype)
        base = st.integers(int(info.min), int(info.max))
    else:
        width, largest, _, _ = _float_info(dtype)
        bounded = st.floats(-largest / 8, largest / 8, width=width, allow_subnormal=True)
        small = st.floats(-4.0, 4.0, width=width)
        base = st.one_of(small, bounded)
    if not edges:
        return base
    special = edge_values(dtype)
    if dtype in FLOAT_DTYPES:
        special = [v for v in special if (allow_nan or v == v)
                   and (allow_infinity or abs(v) != float("inf"))]
    return st.one_of(base, st.sampled_from(special))


def arrays(dtype: str, shape: tuple[int, ...], *, edges: bool = True, allow_nan: bool = True,
           allow_infinity: bool = True) -> st.SearchStrategy[NDArray[Any]]:
    """A carrier of ``dtype`` and ``shape`` (see the module docstring for bfloat16)."""
    carrier = np.dtype("float32" if dtype == "bfloat16" else dtype)
    elements = element_values(dtype, edges=edges, allow_nan=allow_nan,
                              allow_infinity=allow_infinity)
    # unique=False, fill=None: every element drawn (arrays are small), so edge values can
    # sit anywhere, not only in a fill.
    strategy = hnp.arrays(carrier, shape, elements=elements, fill=st.nothing())
    if dtype == "bfloat16":
        strategy = strategy.map(round_to_bfloat16)
    return strategy


def rank_arrays(dtype: str, shape: tuple[int, ...], size: int, **kwargs: Any
                ) -> st.SearchStrategy[list[NDArray[Any]]]:
    """One carrier per rank, all of ``dtype`` and ``shape``; keywords as for :func:`arrays`."""
    return st.lists(arrays(dtype, shape, **kwargs), min_size=size, max_size=size)
