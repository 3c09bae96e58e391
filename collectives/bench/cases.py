"""One collective at one size: its buffers, the call through collectives, the raw call, the check.

Sizes follow nccl-tests (doc/PERFORMANCE.md): for all_reduce, broadcast, reduce and send_recv
the size is the array's; for all_gather, all_gather_v, gather and reduce_scatter it is the
whole gathered (or reduced) array, ``size`` ranks' pieces together; for scatter, all_to_all and
all_to_all_v the whole array a rank sends. Each is rounded to whole elements per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from collectives import calls

#: Every collective the command times, in the order ``all`` runs them.
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_v", "reduce_scatter",
       "gather", "scatter", "all_to_all", "all_to_all_v", "send_recv", "barrier")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw, nccl-tests' factors (:func:`collectives.calls.bus_factor`: the rows of
    the table of calls; 1 for what nccl-tests does not define: send_recv)."""
    return calls.bus_factor(op, n)


_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


class Arrays:
    """Makes and reads arrays of one library (numpy, torch, cupy), dtype and device."""

    def __init__(self, lib: str, dtype: str, device: str) -> None:
        self.lib, self.dtype_name, self.device = lib, dtype, device
        if lib == "torch":
            import torch  # noqa: PLC0415

            self.mod: Any = torch
            self.dtype: Any = getattr(torch, dtype)
            self.itemsize: int = torch.empty(0, dtype=self.dtype).element_size()
        else:
            if lib == "cupy":
                import cupy  # noqa: PLC0415

                self.mod = cupy
            else:
                self.mod = np
            self.dtype = numpy_dtype(dtype)
            self.itemsize = self.dtype.itemsize

    def zeros(self, shape: tuple[int, ...]) -> Any:
        if self.lib == "torch":
            return self.mod.zeros(shape, dtype=self.dtype, device=self.device)
        return self.mod.zeros(shape, dtype=self.dtype)

    def of(self, values: NDArray[Any]) -> Any:
        """An array of this library and dtype holding ``values`` (small integers: exact in every dtype)."""
        if self.lib == "torch":
            return self.mod.from_numpy(np.ascontiguousarray(values, np.float64)).to(self.device, self.dtype)
        return self.mod.asarray(np.asarray(values, np.float64).astype(self.dtype))

    def float64(self, values: NDArray[Any]) -> Any:
        """A float64 array of this library (statistics exchanged between ranks)."""
        if self.lib == "torch":
            return self.mod.from_numpy(np.ascontiguousarray(values, np.float64)).to(self.device)
        return self.mod.asarray(np.asarray(values, np.float64))

    def to_numpy(self, x: Any) -> NDArray[np.float64]:
        if self.lib == "torch":
            x = x.detach().cpu()
            return np.asarray((x.float() if x.dtype == self.mod.bfloat16 else x).numpy(), np.float64)
        if self.lib == "cupy":
            return np.asarray(self.mod.asnumpy(x), np.float64)
        return np.asarray(x, np.float64)

    def sync(self) -> Callable[[], None] | None:
        """What completes queued device work (None on the host)."""
        if self.lib == "torch" and str(self.device).startswith("cuda"):
            return self.mod.cuda.synchronize  # type: ignore[no-any-return]
        if self.lib == "cupy":
            return lambda: self.mod.cuda.get_current_stream().synchronize()
        return None


def numpy_dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        try:
            import ml_dtypes  # noqa: PLC0415
        except ImportError:
            raise SystemExit("collectives-bench: -d bfloat16 with numpy or cupy arrays needs ml_dtypes; "
                             "use --array torch") from None
        return np.dtype(ml_dtypes.bfloat16)  # type: ignore[no-any-return]
    return np.dtype(name)


def pattern(rank: int, shape: tuple[int, ...], dtype: str, redop: str) -> NDArray[np.float64]:
    """Rank ``rank``'s input for --check: small integers, exact in every dtype, different per rank
    (1 or 2 for PROD, so products stay small; 0 or 1 for bool)."""
    i = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    if dtype == "bool":
        return ((i + rank) % 2).astype(np.float64)
    if redop == "prod":
        return ((i + rank) % 2 + 1).astype(np.float64)
    return ((i * 3 + rank * 5) % 7 + 1).astype(np.float64)


def reference(inputs: list[NDArray[np.float64]], dtype: str, redop: str) -> NDArray[np.float64]:
    """The reduction of every rank's input, in float64 (integers wrapped as the dtype wraps)."""
    stacked = np.stack(inputs)
    if redop == "avg":
        return np.asarray(stacked.sum(0) / len(inputs))
    if redop in ("band", "bor", "bxor"):
        ints = stacked.astype(np.int64)
        fold: Any = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[redop]
        result = fold.reduce(ints, axis=0).astype(np.float64)
    else:
        reduce: Any = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[redop]
        result = reduce(stacked, axis=0)
    if dtype in ("int8", "uint8", "int16", "int32", "int64"):
        result = result.astype(np.int64).astype(dtype).astype(np.float64)  # wraps like the dtype
    return np.asarray(result)


def count_wrong(got: NDArray[np.float64], want: NDArray[np.float64], dtype: str) -> int:
    """Elements of ``got`` that differ from ``want``: exact for integers and bool, within two ulps
    of the dtype for floats (AVG divides)."""
    got, want = got.reshape(-1), want.reshape(-1)
    if got.shape != want.shape:
        return max(got.size, want.size)
    if dtype in _EPS:
        bad = np.abs(got - want) > 2 * _EPS[dtype] * np.abs(want)
        return int(np.count_nonzero(bad | np.isnan(got)))
    return int(np.count_nonzero(got != want))


class Case:
    """``op`` at ``nbytes`` (nccl-tests' size; see the module's docstring)."""

    def __init__(self, op: str, nbytes: int, comm: Any, arr: Arrays, redop: str, root: int) -> None:
        self.op, self.comm, self.arr, self.redop, self.root = op, comm, arr, redop, root
        n, rank = comm.size, comm.rank
        count = max(1, nbytes // arr.itemsize)
        per = max(1, count // n)
        if op == "barrier":
            count = 0
        elif op in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all"):
            count = per * n
        elif op == "all_gather_v":  # uneven: odd ranks hold one row more
            self.counts = [per + r % 2 for r in range(n)]
            count = sum(self.counts)
        elif op == "all_to_all_v":  # uneven: rank r sends per + (r + j) % 2 rows to rank j
            self.splits = [[per + (r + j) % 2 for j in range(n)] for r in range(n)]
            count = sum(self.splits[rank])
        self.count, self.per = count, per
        self.nbytes = count * arr.itemsize
        # One set of buffers for ours and raw: two sets' placement alone (their pages, their
        # alignment against each other) moves a raw MPI call by up to 15% from 256 KiB, which a
        # ratio of two sets would book to the library.
        self.x_ours, self.out_ours = self._buffers(None)
        self.x_raw, self.out_raw = self.x_ours, self.out_ours

    # -- buffers: zeros for timing (repeated in-place sums neither overflow nor reach denormals),
    #    the pattern for --check
    def _shape_in(self, rank: int) -> tuple[int, ...]:
        op, n, per = self.op, self.comm.size, self.per
        if op in ("all_reduce", "broadcast", "reduce", "send_recv", "reduce_scatter"):
            return (self.count,)
        if op in ("all_gather", "gather"):
            return (per,)
        if op in ("scatter", "all_to_all"):
            return (n, per)
        if op == "all_gather_v":
            return (self.counts[rank],)
        if op == "all_to_all_v":
            return (sum(self.splits[rank]),)
        return (0,)

    def _shape_out(self) -> tuple[int, ...] | None:
        op, n, per, rank = self.op, self.comm.size, self.per, self.comm.rank
        if op in ("all_gather", "all_to_all"):
            return (n, per)
        if op == "gather":
            return (n, per) if rank == self.root else None
        if op in ("reduce_scatter", "scatter"):
            return (per,)
        if op == "all_gather_v":
            return (self.count,)
        if op == "all_to_all_v":
            return (sum(self.splits[j][rank] for j in range(n)),)
        if op == "send_recv":
            return (self.count,)
        return None

    def _buffers(self, values: NDArray[np.float64] | None) -> tuple[Any, Any]:
        shape = self._shape_in(self.comm.rank)
        x = self.arr.zeros(shape) if values is None else self.arr.of(values)
        out_shape = self._shape_out()
        return x, None if out_shape is None else self.arr.zeros(out_shape)

    # -- the calls
    def ours(self) -> Callable[[], Any] | None:
        """The collective through collectives (``out=`` where it takes one), or None where this
        world cannot run it (send_recv on one rank)."""
        return self._ours(self.x_ours, self.out_ours)

    def _ours(self, x: Any, out: Any) -> Callable[[], Any] | None:
        comm, op, redop, root = self.comm, self.op, self.redop, self.root
        if op == "all_reduce":
            return lambda: comm.all_reduce(x, redop)
        if op == "broadcast":
            return lambda: comm.broadcast(x, root)
        if op == "reduce":
            return lambda: comm.reduce(x, redop, root)
        if op == "all_gather":
            return lambda: comm.all_gather(x, out=out)
        if op == "all_gather_v":
            return lambda: comm.all_gather_v(x, out=out)
        if op == "reduce_scatter":
            return lambda: comm.reduce_scatter(x, redop, out=out)
        if op == "gather":
            return lambda: comm.gather(x, root, out=out)
        if op == "scatter":
            return lambda: comm.scatter(x, root, out=out)
        if op == "all_to_all":
            return lambda: comm.all_to_all(x, out=out)
        if op == "all_to_all_v":
            splits = self.splits[comm.rank]
            return lambda: comm.all_to_all(x, splits, out=out)
        if op == "send_recv":
            return ping_pong(comm.rank, comm.size, lambda peer: comm.send(x, peer),
                             lambda peer: comm.recv(out, peer), lambda peer: comm.send(out, peer))
        return comm.barrier  # type: ignore[no-any-return]

    def raw(self, raw: Any) -> Callable[[], Any] | None:
        """The same collective on the bare transport (None where the transport has none)."""
        return raw.bind(self, self.x_raw, self.out_raw)  # type: ignore[no-any-return]

    def raw_round(self, raw: Any, call: Callable[[], Any]) -> Callable[[], Any] | None:
        """The raw call ``call`` (:meth:`raw`'s) after one small round of the transport
        (``raw.round``): what the default check's round adds to a raw program; None where the
        check makes no round."""
        first = raw.round(self, self.x_raw)
        if first is None:
            return None

        def after_round() -> None:
            first()
            call()
        return after_round

    # -- the check
    def wrong(self, raw: Any = None) -> int:
        """Run the collective once through collectives (with ``raw``: the raw program of
        :meth:`raw` instead) on the pattern and count this rank's wrong elements against numpy
        (every rank computes every rank's input). The raw programs reduce AVG as SUM (ours
        divides): with ``raw`` and AVG nothing is run and 0 returned."""
        arr, op, n, rank = self.arr, self.op, self.comm.size, self.comm.rank
        dtype, redop, root = arr.dtype_name, self.redop, self.root
        if raw is not None and redop == "avg" and op in REDUCING:
            return 0
        inputs = [pattern(r, self._shape_in(r), dtype, redop) for r in range(n)]
        x, out = self._buffers(inputs[rank])
        call = self._ours(x, out) if raw is None else raw.bind(self, x, out)
        if call is None or op == "barrier":
            if call is not None:
                call()
            return 0
        result = call()
        if raw is not None:  # the raw programs write into out
            result = out
        elif isinstance(result, tuple):  # all_gather_v: (gathered, counts)
            result = result[0]
        want: NDArray[np.float64] | None
        if op == "all_reduce":
            got, want = x, reference(inputs, dtype, redop)
        elif op == "broadcast":
            got, want = x, inputs[root]
        elif op == "reduce":  # (off the root torch.distributed leaves x undefined: ours keeps it)
            got, want = x, reference(inputs, dtype, redop) if rank == root else \
                (inputs[rank] if raw is None else None)
        elif op in ("all_gather", "all_gather_v"):
            got, want = result, np.concatenate([v.reshape(-1) for v in inputs])
        elif op == "reduce_scatter":
            got, want = result, reference(inputs, dtype, redop)[rank * self.per:(rank + 1) * self.per]
        elif op == "gather":
            got, want = (result, np.stack(inputs)) if rank == root else (None, None)
        elif op == "scatter":
            got, want = result, inputs[root][rank]
        elif op == "all_to_all":
            got, want = result, np.stack([inputs[j][rank] for j in range(n)])
        elif op == "all_to_all_v":
            pieces = []
            for j in range(n):
                start = sum(self.splits[j][:rank])
                pieces.append(inputs[j][start:start + self.splits[j][rank]])
            got, want = result, np.concatenate(pieces)
        else:  # send_recv: rank 1 got rank 0's array, and rank 0 got it back
            got, want = (out, inputs[0]) if rank in (0, 1) else (None, None)
        if want is None:
            return 0
        return count_wrong(arr.to_numpy(got), want, dtype)


def ping_pong(rank: int, size: int, send: Callable[[int], Any], recv: Callable[[int], Any],
              send_back: Callable[[int], Any]) -> Callable[[], Any] | None:
    """One round trip 0 -> 1 -> 0: rank 0 sends x and receives into out, rank 1 receives into out
    and sends that back; other ranks idle."""
    if size < 2:
        return None
    if rank == 0:
        def first() -> None:
            send(1)
            recv(1)
        return first
    if rank == 1:
        def second() -> None:
            recv(0)
            send_back(0)
        return second
    return lambda: None


# -- timing ------------------------------------------------------------------------------------

def time_interleaved(fns: list[Callable[[], Any]], iters: int, barrier: Callable[[], Any],
                     sync: Callable[[], None] | None) -> NDArray[np.float64]:
    """Seconds per call, shape (len(fns), iters): a barrier before every call, and the order of
    the functions reversed every other iteration so that neither always goes first."""
    samples = np.empty((len(fns), iters))
    clock = time.perf_counter
    forward = list(range(len(fns)))
    backward = forward[::-1]
    for i in range(iters):
        for j in forward if i % 2 == 0 else backward:
            fn = fns[j]
            barrier()
            t0 = clock()
            fn()
            if sync is not None:
                sync()
            samples[j, i] = clock() - t0
    return samples


def stats(seconds: NDArray[np.float64], nbytes: int, bus: float) -> dict[str, float]:
    """Median and spread in microseconds; algbw and busbw (GB/s = 1e9 B/s) from the median."""
    us = seconds * 1e6
    p10, p25, median, p75, p90 = np.percentile(us, [10, 25, 50, 75, 90])
    algbw = nbytes / (median * 1e-6) / 1e9 if median > 0 else 0.0
    return {"median_us": float(median), "p10_us": float(p10), "p25_us": float(p25),
            "p75_us": float(p75), "p90_us": float(p90), "min_us": float(us.min()),
            "algbw_GBps": float(algbw), "busbw_GBps": float(algbw * bus)}
