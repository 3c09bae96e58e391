"""What a collective should return, computed with numpy alone, and the arrays tests send.

Tests draw plain numpy arrays in the test process (see :mod:`.strategies`), send them
to the ranks, and each rank turns them into the array it hands to a collective with
:func:`as_array`; results come back through :func:`to_numpy`. The checks here
compare them with an independent numpy float64 reference.

bfloat16 travels as a *carrier*: a float32 numpy array whose low 16 bits are zero,
so every value is exactly a bfloat16 value (NaN payloads included); :func:`as_array`
turns its upper halves into a ``torch.bfloat16`` tensor bit for bit and
:func:`to_numpy` does the reverse. numpy itself has no bfloat16, so a bfloat16 array
is always a torch tensor in the ranks. Every other dtype's carrier is the numpy
array of that dtype.

Nothing here imports hypothesis, torch or a transport at import time.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..ops import FLOAT_DTYPES, INTEGER_DTYPES, ReduceOp, resolve_op

#: Array libraries :func:`as_array` makes arrays of.
LIBRARIES = ("numpy", "torch")
#: Memory layouts :func:`as_array` makes: a fresh contiguous array, or a strided view
#: of a larger buffer (every other element of the last axis), which collectives must
#: accept and write back into.
LAYOUTS = ("contiguous", "strided")


def carrier_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy dtype that carries ``dtype``'s values (float32 for bfloat16)."""
    return np.dtype("float32" if dtype == "bfloat16" else dtype)


def round_to_bfloat16(values: NDArray[Any]) -> NDArray[Any]:
    """float32 values rounded to the nearest bfloat16 (ties to even), as a carrier.

    NaNs stay NaN with their sign and the upper bits of their payload (quiet bit set).
    """
    f32 = np.array(values, dtype=np.float32, order="C")  # (ascontiguousarray makes 0-d 1-d)
    # 1-d: numpy 1.x takes a 0-d uint64 and a Python int to float64 (no NEP 50), and shifts fail.
    bits = f32.reshape(-1).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    nan = np.isnan(f32.reshape(-1))
    rounded = np.where(nan, (bits & 0xFFFF0000) | 0x00400000, rounded)
    return rounded.astype(np.uint32).view(np.float32).reshape(f32.shape)


def as_array(values: NDArray[Any], dtype: str, library: str = "numpy",
             layout: str = "contiguous") -> Any:
    """The array a rank hands to a collective: ``values`` (a carrier) as ``library``'s array.

    ``library`` is "numpy" or "torch" (bfloat16 is always torch); ``layout`` is
    "contiguous" or "strided" (a non-contiguous view with the same values). Bits are
    preserved exactly, NaN payloads and -0.0 included.
    """
    values = np.asarray(values, dtype=carrier_dtype(dtype))
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; valid: {', '.join(LAYOUTS)}")
    if library not in LIBRARIES:
        raise ValueError(f"library={library!r}; valid: {', '.join(LIBRARIES)}")
    if dtype == "bfloat16":
        library = "torch"
    if library == "numpy":
        out = values.copy()
        if layout == "strided" and values.ndim:
            wide = np.zeros((*values.shape[:-1], 2 * values.shape[-1]), dtype=values.dtype)
            out = wide[..., ::2]
            out[...] = values
        return out
    import torch  # noqa: PLC0415  (only ranks that were asked for tensors need torch)

    if dtype == "bfloat16":
        # np.uint32 shifts: numpy 1.x takes a 0-d uint32 and a Python int to int64 (no NEP 50).
        upper = np.asarray(np.array(values, order="C").view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        tensor = torch.from_numpy(upper.view(np.int16).copy()).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(values.copy())
    if layout == "strided" and tensor.dim():
        wide_tensor = torch.zeros((*tensor.shape[:-1], 2 * tensor.shape[-1]), dtype=tensor.dtype)
        view = wide_tensor[..., ::2]
        view.copy_(tensor)
        tensor = view
    return tensor


def to_numpy(x: Any) -> NDArray[Any]:
    """A collective's result (numpy array or CPU tensor) as a contiguous carrier, bit for bit."""
    if isinstance(x, np.ndarray):
        return np.array(x, order="C")  # a copy; keeps 0-d arrays 0-d
    torch = sys.modules["torch"]
    t = x.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        upper = t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
        return np.asarray(upper << np.uint32(16)).view(np.float32)  # a new array (0-d stays 0-d)
    carrier: NDArray[Any] = t.numpy().copy()
    return carrier


def same_bits(a: NDArray[Any], b: NDArray[Any], *, nan_payloads: bool = True) -> bool:
    """Whether two carriers hold the same dtype, shape and bytes.

    With ``nan_payloads=False`` NaNs only need to be NaN in the same places (their sign
    and payload bits may differ); every other element must still be bit-identical.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not nan_payloads and a.dtype.kind == "f":
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        if not np.array_equal(nan_a, nan_b):
            return False
        a, b = np.where(nan_a, 0, a), np.where(nan_b, 0, b)
    return a.tobytes() == b.tobytes()


# -- the numpy reference -------------------------------------------------------------------

def reference_reduce(inputs: Sequence[NDArray[Any]], dtype: str, op: Any) -> NDArray[Any]:
    """The exact reduction of every rank's carrier, elementwise.

    bool and integer dtypes: in that dtype (SUM and PROD wrap around like C). Float
    dtypes: float64; SUM and AVG correctly rounded (``math.fsum``), PROD, MIN and MAX
    in float64, NaN wherever numpy gives NaN (MIN/MAX propagate NaN).
    """
    op = resolve_op(op)
    stack = np.stack([np.asarray(x) for x in inputs])
    table: dict[ReduceOp, np.ufunc]
    result: NDArray[Any]
    if dtype == "bool":
        table = {ReduceOp.MIN: np.logical_and, ReduceOp.BAND: np.logical_and,
                 ReduceOp.MAX: np.logical_or, ReduceOp.BOR: np.logical_or,
                 ReduceOp.BXOR: np.logical_xor}
        result = table[op].reduce(stack, axis=0)
        return result
    if dtype in INTEGER_DTYPES:
        table = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum,
                 ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
                 ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}
        with np.errstate(over="ignore"):
            result = table[op].reduce(stack, axis=0, dtype=stack.dtype)
            return result
    wide = stack.astype(np.float64)
    with np.errstate(all="ignore"):
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            total = _fsum(wide)
            return total / len(inputs) if op is ReduceOp.AVG else total
        table = {ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}
        result = table[op].reduce(wide, axis=0)
        return result


def reference_tensor(dtype: str, op: Any, per_rank: Sequence[Any]) -> Any:
    """:func:`reference_reduce` of CPU torch tensors (one per rank, one shape and dtype), as a
    torch tensor: of ``dtype`` for bool and integers, float64 for floats."""
    torch = sys.modules["torch"]
    return torch.from_numpy(np.ascontiguousarray(reference_reduce([to_numpy(t) for t in per_rank], dtype, op)))


#: Relative (and, times the rank count, absolute) tolerance of a float reduction of
#: :func:`random_rank_tensors` (values in [-2, 2]) against :func:`reference_tensor`.
FLOAT_TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}


def random_rank_tensors(dtype: str, size: int, rng: np.random.Generator,
                        shape: tuple[int, ...] = (64,)) -> list[Any]:
    """One CPU torch tensor per rank: all of the dtype's range for integers, [-2, 2] for floats."""
    import torch  # noqa: PLC0415  (only tests that use torch call this)

    if dtype == "bool":
        return [torch.from_numpy(rng.integers(0, 2, shape).astype(bool)) for _ in range(size)]
    if dtype in INTEGER_DTYPES:
        info = torch.iinfo(getattr(torch, dtype))
        return [torch.from_numpy(rng.integers(info.min, info.max, shape, endpoint=True)).to(getattr(torch, dtype))
                for _ in range(size)]
    return [torch.from_numpy(rng.uniform(-2, 2, shape)).to(getattr(torch, dtype)) for _ in range(size)]


def _fsum(wide: NDArray[Any]) -> NDArray[Any]:
    """Correctly rounded elementwise sum over axis 0 (NaN and inf as numpy gives them)."""
    with np.errstate(all="ignore"):
        total = np.array(wide.sum(axis=0))  # a 0-d array, not a scalar, for 0-d inputs
    flat, columns = total.reshape(-1), wide.reshape(wide.shape[0], -1)
    for i in range(flat.size):
        if math.isfinite(flat[i]):
            flat[i] = math.fsum(columns[:, i])
    return total


def float_tolerance(inputs: Sequence[NDArray[Any]], dtype: str, op: Any) -> tuple[NDArray[Any], NDArray[Any]]:
    """Per element: the error a correct float reduction may have, and whether it is checked.

    With n = size ranks, eps = ``finfo(dtype).eps`` (twice the unit roundoff u) and
    tiny = the smallest subnormal of ``dtype``:

    - SUM: any summation order adds n - 1 numbers, each addition rounding once with a
      relative error of at most u, and each partial sum is at most ``sum|x_i|`` in
      magnitude, so ``|computed - exact| <= (n - 1) * u * sum|x_i|`` (to first order).
      Transports that stage through a wider type (MPI's bfloat16) round once more, to
      the dtype, which adds ``u * |exact|``. The bound used is
      ``(n - 1) * eps * sum|x_i| + n * tiny`` (eps = 2u covers the final rounding and
      second-order terms; the tiny term covers rounding in the subnormal range, which
      is absolute, not relative).
    - AVG: SUM then one division by n: ``(bound_SUM + eps * |exact SUM|) / n + tiny``.
    - PROD: each of the n - 1 multiplications rounds with relative error u while every
      partial product is normal: ``(n - 1) * eps * |exact| + tiny``, plus the float64
      reference's own ``(n - 1) * 2**-52 * |exact|`` (it multiplies in order too).
    - MIN, MAX: exact (tolerance 0; -0.0 and 0.0 compare equal).

    An element is *not* checked when the reduction may overflow or underflow in some
    order of evaluation (then the result depends legitimately on the transport's
    order): SUM/AVG where the finite inputs' ``sum|x_i| * (1 + n * eps)`` exceeds the
    dtype's largest value; PROD where some product of a subset of the finite inputs
    leaves the normal range (a subset with a 0 is fine: its product is 0).
    Elements that are NaN in every order are always checked (a NaN input; +inf and
    -inf in a SUM; inf and 0 in a PROD).
    """
    op = resolve_op(op)
    n = len(inputs)
    info = np.finfo(carrier_dtype(dtype)) if dtype != "bfloat16" else None
    eps = info.eps if info else 2.0 ** -7
    largest = float(info.max) if info else float(np.float32(3.3895313892515355e38))
    tiny_normal = float(info.smallest_normal) if info else 2.0 ** -126
    tiny = float(info.smallest_subnormal) if info else 2.0 ** -133
    wide = np.stack([np.asarray(x, dtype=np.float64) for x in inputs])
    finite = np.where(np.isfinite(wide), wide, 0.0)
    exact = reference_reduce(inputs, dtype, op)
    with np.errstate(all="ignore"):
        if op in (ReduceOp.MIN, ReduceOp.MAX):
            return np.zeros(exact.shape), np.ones(exact.shape, dtype=bool)
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            magnitude = np.abs(finite).sum(axis=0)
            checked = magnitude * (1 + n * eps) <= largest
            bound = (n - 1) * eps * magnitude + n * tiny
            if op is ReduceOp.AVG:
                bound = (bound + eps * np.abs(exact * n)) / n + tiny
        else:
            # Subset products' magnitudes in log2 (float64 itself would under/overflow).
            zero = finite == 0
            logs = np.log2(np.where(finite == 0, 1.0, np.abs(finite)))
            low, high = math.log2(tiny_normal) + 1e-9, math.log2(largest) - 1e-9
            checked = np.ones(exact.shape, dtype=bool)
            for k in range(2, n + 1):
                for subset in itertools.combinations(range(n), k):
                    partial = logs[list(subset)].sum(axis=0)
                    checked &= zero[list(subset)].any(axis=0) | ((partial >= low) & (partial <= high))
            # The float64 reference multiplies in order too: its own (n - 1) * 2**-53.
            bound = (n - 1) * (eps + 2.0 ** -52) * np.abs(exact) + tiny
    # NaN in every order of evaluation: a NaN input, +inf meeting -inf, inf meeting 0.
    always_nan = np.isnan(wide).any(axis=0)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        always_nan |= (wide == np.inf).any(axis=0) & (wide == -np.inf).any(axis=0)
    elif op is ReduceOp.PROD:
        always_nan |= np.isinf(wide).any(axis=0) & (wide == 0).any(axis=0)
    return bound, checked | always_nan


def check_reduction_result(got: NDArray[Any], inputs: Sequence[NDArray[Any]], dtype: str, op: Any,
                           what: str = "result") -> None:
    """``AssertionError`` (with the offending elements) unless ``got`` is a correct reduction.

    ``got`` and ``inputs`` are carriers. Integers, bool and float MIN/MAX must equal the
    reference exactly; float SUM/PROD/AVG within
    :func:`~collectives.testing.reference.float_tolerance`, NaN exactly where the
    reference is NaN and infinities equal.
    """
    op = resolve_op(op)
    exact = reference_reduce(inputs, dtype, op)
    got = np.asarray(got)
    assert got.dtype == carrier_dtype(dtype), f"{what}: dtype {got.dtype}, expected {dtype}"
    assert got.shape == exact.shape, f"{what}: shape {got.shape}, expected {exact.shape}"
    if dtype not in FLOAT_DTYPES:
        bad = got != exact
        if bad.any():
            raise AssertionError(_describe(what, got, exact, bad, inputs, dtype, op))
        return
    bound, checked = float_tolerance(inputs, dtype, op)
    g = got.astype(np.float64)
    with np.errstate(all="ignore"):
        nan_wrong = np.isnan(exact) != np.isnan(g)
        inf_wrong = np.isinf(exact) & (g != exact)
        close = np.abs(g - exact) <= bound
        finite_wrong = np.isfinite(exact) & ~(np.isfinite(g) & close)
    bad = checked & (nan_wrong | inf_wrong | finite_wrong)
    if bad.any():
        raise AssertionError(_describe(what, got, exact, bad, inputs, dtype, op, bound))


def _describe(what: str, got: NDArray[Any], exact: NDArray[Any], bad: NDArray[Any],
              inputs: Sequence[NDArray[Any]], dtype: str, op: ReduceOp,
              bound: NDArray[Any] | None = None) -> str:
    lines = [f"{what}: {int(bad.sum())} of {bad.size} elements wrong for {op.name} on {dtype}"]
    got, exact, bad = np.atleast_1d(got), np.atleast_1d(exact), np.atleast_1d(bad)
    bound = None if bound is None else np.atleast_1d(bound)
    for index in list(zip(*np.nonzero(bad)))[:5]:
        ins = [np.atleast_1d(x)[index].item() for x in inputs]
        line = f"  at {tuple(int(i) for i in index)}: got {got[index]!r}, expected {exact[index]!r}"
        if bound is not None:
            line += f" +- {bound[index]:.3g}"
        lines.append(line + f"; inputs per rank {ins}")
    return "\n".join(lines)
