"""The Communicator interface every backend implements. Read this file first.

A backend subclasses :class:`Communicator` and implements the underscored
methods (``_all_reduce``, ``_broadcast``, ...). The public methods here check
every argument first, through the rules of :mod:`collectives.ops` and the
adapters of :mod:`collectives.arrays`, so a bad call raises the same
``TypeError``/``ValueError`` on every backend, before anything is sent and with
the input untouched. Backends only ever see arguments that passed.

Reliability lives here too, once for every backend (see :mod:`collectives.debug`):
every collective gets a per-communicator sequence number; with ``COLLECTIVES_DEBUG=1``
the ranks compare a fingerprint of each call before it runs (``CollectiveMismatch``);
backends enforce ``timeout`` (``CollectiveTimeout``), after which the communicator
is unusable.
"""

from __future__ import annotations

import abc
import operator
from typing import Any

from . import arrays, config
from .arrays import ArrayAdapter
from .errors import CollectiveError, CollectiveTimeout
from .launcher import LaunchInfo
from .ops import ReduceOp, check_reduction


class Work:
    """Handle of an asynchronous collective. ``wait()`` completes it and returns the array."""

    def __init__(self, x: Any) -> None:
        self._x = x

    def wait(self) -> Any:
        """Block until the collective has completed; return its (in-place) result."""
        return self._x

    def is_completed(self) -> bool:
        return True


class Communicator(abc.ABC):
    """A group of ranks that run collectives together.

    Attributes: ``rank`` (0 .. size-1 within this communicator), ``size``,
    ``local_rank`` (this process's rank on its node, used to pick a GPU) and
    ``backend`` (the backend's name: "local", "torch", "mpi" or "cupy").

    Arrays may be ``torch.Tensor`` (CPU or CUDA), ``numpy.ndarray`` or
    ``cupy.ndarray``, as far as the backend takes them; results have the input's
    type, device and dtype. Every rank must call the same collectives in the
    same order with the same dtype, shape, op and root. Non-contiguous inputs are
    handled through a contiguous copy (results are written back into ``x``).

    ``timeout`` is the seconds a blocking collective may take before it raises
    :class:`CollectiveTimeout` (``None``: no timeout); it comes from the
    constructor's ``timeout`` argument, else ``COLLECTIVES_TIMEOUT``, else 1800 s,
    and a ``split`` inherits it. ``debug`` is whether calls are fingerprinted
    (``COLLECTIVES_DEBUG=1``).
    """

    backend: str = ""
    #: Whether this class overrides ``_check_device`` (the call path skips it when not).
    _checks_device: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._checks_device = cls._check_device is not Communicator._check_device

    def __init__(self, rank: int, size: int, local_rank: int, *,
                 timeout: Any = None) -> None:
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.timeout: float | None = config.timeout_seconds(timeout)
        # One rank has nobody to disagree with: debug costs nothing at size 1.
        self.debug: bool = bool(config.env_flag(config.DEBUG)) and size > 1
        self._closed = False
        # Why the communicator cannot be used any more (after a timeout), else None.
        self._broken: str | None = None
        # The running call, for error messages: its operation and sequence number.
        self._seq = 0
        self._operation = ""

    # -- the public interface ------------------------------------------------------------

    def all_reduce(self, x: Any, op: ReduceOp | str = "sum", *, async_op: bool = False) -> Any:
        """Reduce ``x`` elementwise over all ranks, in place; every rank gets the result.

        ``x`` keeps its shape and dtype. ``op`` must be allowed on ``x``'s dtype
        (see :data:`collectives.ops.ALLOWED_OPS`), else ``TypeError``. Returns
        ``x``, or with ``async_op=True`` a :class:`Work` whose ``wait()`` returns ``x``.
        """
        if self._closed or self._broken:
            self._check_open()
        try:  # the checks that depend only on the kind of x and on op passed before
            adapter, dtype, reduce_op = _REDUCTION_KINDS[type(x), x.dtype, op]
        except (KeyError, TypeError, AttributeError):
            adapter, dtype, reduce_op = self._check_reduction(x, op, in_place=True)
        else:
            if adapter.checks_memory:
                adapter.check_memory(x)
            adapter.check_writable(x)
            if self._checks_device:
                self._check_device(x, adapter)
        self._seq += 1
        self._operation = "all_reduce"
        if self.debug:
            self._compare_fingerprints(reduce_op, -1, dtype, x.shape)
        try:
            work = self._all_reduce(x, adapter, dtype, reduce_op, async_op)
        except CollectiveError:
            raise
        except Exception as error:
            raise self._transport_error(error) from error
        return work if async_op else x

    def broadcast(self, x: Any, src: int = 0, *, async_op: bool = False) -> Any:
        """Copy rank ``src``'s ``x`` into ``x`` on every rank, in place.

        ``x`` must have the same shape and dtype on every rank. ``src`` is a rank
        of this communicator (``0 <= src < size``), else ``ValueError``. Returns
        ``x``, or with ``async_op=True`` a :class:`Work` whose ``wait()`` returns ``x``.
        """
        if self._closed or self._broken:
            self._check_open()
        try:
            adapter, dtype = _ARRAY_KINDS[type(x), x.dtype]
        except (KeyError, TypeError, AttributeError):
            adapter, dtype = self._check_array(x, in_place=True)
        else:
            if adapter.checks_memory:
                adapter.check_memory(x)
            adapter.check_writable(x)
            if self._checks_device:
                self._check_device(x, adapter)
        if type(src) is not int or not 0 <= src < self.size:  # noqa: E721  (a bool is no rank)
            self._check_rank(src, "src")
        self._seq += 1
        self._operation = "broadcast"
        if self.debug:
            self._compare_fingerprints(None, src, dtype, x.shape)
        try:
            work = self._broadcast(x, adapter, dtype, src, async_op)
        except CollectiveError:
            raise
        except Exception as error:
            raise self._transport_error(error) from error
        return work if async_op else x

    def all_gather(self, x: Any) -> Any:
        """Gather every rank's ``x``: a new array of shape ``(size, *x.shape)``.

        Row ``r`` of the result is rank ``r``'s ``x``. ``x`` is not modified.
        """
        if self._closed or self._broken:
            self._check_open()
        try:
            adapter, dtype = _ARRAY_KINDS[type(x), x.dtype]
        except (KeyError, TypeError, AttributeError):
            adapter, dtype = self._check_array(x, in_place=False)
        else:
            if adapter.checks_memory:
                adapter.check_memory(x)
            if self._checks_device:
                self._check_device(x, adapter)
        self._seq += 1
        self._operation = "all_gather"
        if self.debug:
            self._compare_fingerprints(None, -1, dtype, x.shape)
        try:
            return self._all_gather(x, adapter, dtype)
        except CollectiveError:
            raise
        except Exception as error:
            raise self._transport_error(error) from error

    def reduce_scatter(self, x: Any, op: ReduceOp | str = "sum") -> Any:
        """Reduce ``x`` over all ranks and return this rank's block of rows.

        ``x.shape[0]`` must be divisible by ``size`` (else ``ValueError``); the
        result is a new array of shape ``(x.shape[0] // size, *x.shape[1:])``
        holding rows ``rank * n // size`` to ``(rank + 1) * n // size`` of the
        reduction. ``x`` is not modified.
        """
        if self._closed or self._broken:
            self._check_open()
        try:
            adapter, dtype, reduce_op = _REDUCTION_KINDS[type(x), x.dtype, op]
        except (KeyError, TypeError, AttributeError):
            adapter, dtype, reduce_op = self._check_reduction(x, op, in_place=False)
        else:
            if adapter.checks_memory:
                adapter.check_memory(x)
            if self._checks_device:
                self._check_device(x, adapter)
        shape = tuple(x.shape)
        if not shape:
            raise ValueError("reduce_scatter needs x with at least one dimension; got a 0-d array")
        if shape[0] % self.size:
            raise ValueError(
                f"reduce_scatter needs x.shape[0] divisible by size={self.size}; "
                f"got x.shape={shape}"
            )
        self._seq += 1
        self._operation = "reduce_scatter"
        if self.debug:
            self._compare_fingerprints(reduce_op, -1, dtype, shape)
        try:
            return self._reduce_scatter(x, adapter, dtype, reduce_op)
        except CollectiveError:
            raise
        except Exception as error:
            raise self._transport_error(error) from error

    def barrier(self) -> None:
        """Block until every rank of this communicator has called ``barrier``."""
        self._check_open()
        self._seq += 1
        self._operation = "barrier"
        if self.debug:
            self._compare_fingerprints(None, -1, None, ())
        try:
            self._barrier()
        except CollectiveError:
            raise
        except Exception as error:
            raise self._transport_error(error) from error

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """A new communicator over the ranks that passed the same ``color``.

        Collective over this communicator: every rank must call it. ``color`` is
        a non-negative int, or ``None`` to take part without joining any group
        (that rank gets ``None`` back). Ranks of the new communicator are ordered
        by ``key`` (default: this rank), ties broken by rank here.
        """
        self._check_open()
        for name, value in (("color", color), ("key", key)):
            if value is not None and (isinstance(value, bool) or not _is_int(value)):
                raise TypeError(f"{name} must be an int or None; got {type(value).__name__}")
        if color is not None and int(color) < 0:
            raise ValueError(f"color must be >= 0 (or None to join no group); got {color}")
        self._seq += 1
        self._operation = "split"
        if self.debug:  # colors and keys differ by design: only the call itself is compared
            self._compare_fingerprints(None, -1, None, ())
        try:
            return self._split(None if color is None else int(color),
                               self.rank if key is None else int(key))
        except CollectiveError:
            raise
        except Exception as error:
            raise self._transport_error(error) from error

    def close(self) -> None:
        """Release the transport's resources; the communicator can no longer be used."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ", unusable" if self._broken else ""
        return (f"<{type(self).__name__} backend={self.backend} rank={self.rank} "
                f"size={self.size}{state}>")

    # -- argument checks shared by every backend ----------------------------------------

    # The checks run on every call. The public methods above first look the kind of x
    # (its type and dtype, and op) up among the kinds that passed before, and then check
    # only what can differ from one array to the next (memory, writable, device); a kind not seen
    # yet goes through the full checks below. The order of the checks, and so which
    # error a call with several faults gets, is the same on both paths.

    def _check_array(self, x: Any, in_place: bool) -> tuple[ArrayAdapter, str]:
        if self._closed or self._broken:
            self._check_open()
        try:
            adapter, dtype = _ARRAY_KINDS[type(x), x.dtype]
        except (KeyError, TypeError, AttributeError):
            adapter = arrays.adapter_for(x)
            dtype = adapter.dtype_name(x)
            _remember(_ARRAY_KINDS, (type(x), x.dtype), (adapter, dtype))
        else:
            if adapter.checks_memory:
                adapter.check_memory(x)
        if in_place:
            adapter.check_writable(x)
        if self._checks_device:
            self._check_device(x, adapter)
        return adapter, dtype

    def _check_reduction(self, x: Any, op: Any, in_place: bool) -> tuple[ArrayAdapter, str, ReduceOp]:
        """``_check_array``, then ``check_reduction``; remembers the kind of x with op."""
        adapter, dtype = self._check_array(x, in_place)
        reduce_op = check_reduction(dtype, op)
        _remember(_REDUCTION_KINDS, (type(x), x.dtype, op), (adapter, dtype, reduce_op))
        return adapter, dtype, reduce_op

    def _check_device(self, x: Any, adapter: ArrayAdapter) -> None:
        """``TypeError``/``ValueError`` if this backend cannot take ``x`` (device, kind)."""

    def _check_rank(self, rank: Any, name: str) -> None:
        if isinstance(rank, bool) or not _is_int(rank):
            raise TypeError(f"{name} must be an int rank; got {type(rank).__name__}")
        if not 0 <= rank < self.size:
            raise ValueError(f"{name}={rank} is out of range; valid ranks: 0 to {self.size - 1}")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed; create a new communicator")
        if self._broken:
            raise CollectiveError(self._broken)

    # -- reliability: sequence numbers, fingerprints, timeouts ---------------------------

    @property
    def sequence_number(self) -> int:
        """How many collectives this communicator has started (the running one's number)."""
        return self._seq

    @property
    def _timeout_arg(self) -> float:
        """``timeout`` as a constructor argument, for a split to inherit (0: none)."""
        return 0.0 if self.timeout is None else self.timeout

    def _call_name(self, call: tuple[str, int] | None = None) -> str:
        operation, seq = call or (self._operation, self._seq)
        return f"{operation or 'collective'} (call #{seq}) on {self!r}"

    def _timeout_error(self, detail: str = "", call: tuple[str, int] | None = None) -> CollectiveTimeout:
        """A :class:`CollectiveTimeout` for the running call (or ``call``: operation and
        sequence number of an asynchronous one); the communicator becomes unusable.

        Backends call this when their deadline passes (or their transport timed out).
        """
        call_name = self._call_name(call)
        self._broken = (f"{self!r} is unusable: {call_name} timed out, and the transport cannot "
                        "take it back (some ranks may still be inside it); create a new "
                        "communicator, or end the job")
        source = f"timeout={self.timeout:g}s" if self.timeout is not None else "the transport's timeout"
        return CollectiveTimeout(
            f"{call_name} did not complete within {source} ({config.TIMEOUT}): another rank "
            f"skipped this call, called a different collective, or is stuck or dead"
            f"{'; ' + detail if detail else ''}. This communicator is now unusable: "
            "every later call on it raises."
        )

    def _transport_error(self, error: Exception) -> Exception:
        """What a transport exception raised inside the running call becomes.

        Backends override this to turn their transport's timeout into
        :meth:`_timeout_error`; anything else propagates unchanged.
        """
        return error

    def _compare_fingerprints(self, reduce_op: ReduceOp | None, root: int, dtype: str | None,
                              shape: tuple[int, ...]) -> None:
        """Debug mode: ``CollectiveMismatch`` on every rank unless every rank makes this call.

        One all_gather of a fixed-size int64 vector over this communicator's own transport.
        """
        from .debug import fingerprint, mismatch  # noqa: PLC0415  (debug mode only)

        mine = fingerprint(self._operation, self._seq, reduce_op, root, dtype, tuple(shape))
        try:
            everyone = self._all_gather(mine, arrays.NUMPY, "int64")
        except CollectiveError:
            raise
        except Exception as error:
            raise self._transport_error(error) from error
        error = mismatch(everyone, self)
        if error is not None:
            raise error

    def _split_groups(self, color: int | None, key: int) -> list[list[int]] | None:
        """Every rank's group for ``split``, through one all_gather of (color, key).

        Returns this rank's group as a list of ranks of this communicator in the
        new communicator's order, or ``None`` when ``color`` is ``None``. For
        backends whose transport has no native split.
        """
        import numpy as np  # noqa: PLC0415  (numpy is a dependency of the interface)

        mine = np.array([-1 if color is None else color, key], dtype=np.int64)
        everyone = self._all_gather(mine, arrays.NUMPY, "int64")
        if color is None:
            return None
        members = [r for r in range(self.size) if everyone[r, 0] == color]
        return sorted(members, key=lambda r: (int(everyone[r, 1]), r))

    # -- what a backend implements --------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def from_launcher(cls, launch: LaunchInfo) -> Communicator:
        """The world communicator of this backend for a process started as ``launch`` says.

        Raises :class:`BackendUnavailable` with the reason when the backend cannot
        run under that launcher or its transport is missing.
        """

    @abc.abstractmethod
    def _all_reduce(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp,
                    async_op: bool) -> Work | None:
        """Reduce in place; return a Work when ``async_op``."""

    @abc.abstractmethod
    def _broadcast(self, x: Any, adapter: ArrayAdapter, dtype: str, src: int,
                   async_op: bool) -> Work | None:
        """Broadcast in place; return a Work when ``async_op``."""

    @abc.abstractmethod
    def _all_gather(self, x: Any, adapter: ArrayAdapter, dtype: str) -> Any:
        """Return the gathered ``(size, *x.shape)`` array."""

    @abc.abstractmethod
    def _reduce_scatter(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp) -> Any:
        """Return this rank's reduced block (shape already checked)."""

    @abc.abstractmethod
    def _barrier(self) -> None: ...

    @abc.abstractmethod
    def _split(self, color: int | None, key: int) -> Communicator | None: ...

    def _close(self) -> None:
        """Release transport resources (called once)."""


# (type(x), x.dtype) -> (adapter, dtype name) for kinds of arrays that passed before, and
# (type(x), x.dtype, op as spelled) -> (adapter, dtype name, ReduceOp) for reductions.
_ARRAY_KINDS: dict[tuple[Any, ...], tuple[ArrayAdapter, str]] = {}
_REDUCTION_KINDS: dict[tuple[Any, ...], tuple[ArrayAdapter, str, ReduceOp]] = {}


def _remember(cache: dict[Any, Any], key: tuple[Any, ...], value: Any) -> None:
    try:
        cache[key] = value
    except TypeError:  # an unhashable op spelling or dtype: valid, just not remembered
        pass


def _is_int(value: Any) -> bool:
    try:
        operator.index(value)  # int and numpy integers; not float, str or None
    except TypeError:
        return False
    return True


__all__ = ["Communicator", "Work", "CollectiveError"]
