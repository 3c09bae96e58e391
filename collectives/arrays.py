"""Array adapters: one small object per array library, used by every backend and the tests.

An adapter answers the questions the interface asks of an array (its dtype name
from :data:`collectives.ops.DTYPES`, whether it lives on a GPU, whether it may be
written in place) and makes new arrays of the same kind. Array libraries are never
imported here: a type is recognized by the module that defines it, and the
library is only touched once the caller has handed us one of its arrays.
"""

from __future__ import annotations

import sys
from typing import Any

from .host_views import numpy_host_view, tensor_host_view
from .ops import DTYPES


class ArrayAdapter:
    """What the interface needs to know about one array library."""

    #: "numpy", "torch" or "cupy".
    name: str = ""

    def dtype_name(self, x: Any) -> str:
        """The dtype of ``x`` as a name of :data:`DTYPES`; ``TypeError`` for any other."""
        name = self._dtype_names().get(x.dtype)
        if name is None:
            raise TypeError(
                f"dtype {x.dtype} of this {self.name} array is not supported; "
                f"supported dtypes: {', '.join(DTYPES)}"
            )
        return name

    def _dtype_names(self) -> dict[Any, str]:
        raise NotImplementedError

    def is_cuda(self, x: Any) -> bool:
        return False

    def device_index(self, x: Any) -> int | None:
        """CUDA device ordinal of ``x``, or ``None`` for host memory."""
        return None

    #: Whether ``check_memory`` checks anything (the call path skips it when not).
    checks_memory = False

    def check_memory(self, x: Any, name: str = "x") -> None:
        """``TypeError``/``ValueError`` unless a transport can address ``x``'s memory.

        Part of ``dtype_name``; called on its own for kinds of arrays already seen,
        since two arrays of one type and dtype may live on different devices."""

    def check_writable(self, x: Any, name: str = "x") -> None:
        """``ValueError`` unless ``x`` may be overwritten in place."""

    def check_array(self, x: Any, in_place: bool, name: str = "x") -> None:
        """The checks of one array of a kind that passed before (its memory, and for an
        in-place call that it may be overwritten), in that order; errors call it ``name``."""
        if self.checks_memory:
            self.check_memory(x, name)
        if in_place:
            self.check_writable(x, name)

    def host_view(self, x: Any, in_place: bool) -> Any:
        """:meth:`check_array`, returning ``x``'s memory as a C-contiguous numpy array when
        ``x`` is host memory of that layout and dtype (a transport may pass it as it is),
        else ``None``. What the fast paths of the call path start from."""
        self.check_array(x, in_place)
        return None

    def is_contiguous(self, x: Any) -> bool:
        return bool(x.flags.c_contiguous)

    def empty(self, like: Any, shape: tuple[int, ...], dtype: str | None = None) -> Any:
        """A new uninitialized array of ``like``'s kind and device, of ``like``'s dtype
        or the one named ``dtype``."""
        raise NotImplementedError

    def copy_(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst`` (same shape), casting to ``dst``'s dtype (integers wrap)."""
        dst[...] = src

    def view(self, x: Any, dtype: str) -> Any:
        """``x``'s memory seen as the dtype named ``dtype`` (of the same width)."""
        raise NotImplementedError

    def cast(self, x: Any, dtype: str | None) -> Any:
        """A new C-contiguous copy of ``x`` in the dtype named ``dtype`` (``None``: x's own)."""
        raise NotImplementedError


def _numpy_dtype_table(np: Any) -> dict[Any, str]:
    table = {np.dtype(name): name for name in DTYPES if name != "bfloat16"}
    try:  # ml_dtypes' bfloat16, when the caller uses it
        import ml_dtypes  # noqa: PLC0415

        table[np.dtype(ml_dtypes.bfloat16)] = "bfloat16"
    except ImportError:
        pass
    return table


class NumpyAdapter(ArrayAdapter):
    name = "numpy"
    _table: dict[Any, str] | None = None
    _by_name: dict[str, Any] | None = None

    def _dtype_names(self) -> dict[Any, str]:
        if self._table is None:
            self._table = _numpy_dtype_table(sys.modules["numpy"])
        return self._table

    def dtype_of(self, name: str) -> Any:
        """The numpy dtype named ``name`` (bfloat16: ml_dtypes' where installed)."""
        if self._by_name is None:
            self._by_name = {dtype_name: dtype for dtype, dtype_name in self._dtype_names().items()}
        return self._by_name[name]

    def view(self, x: Any, dtype: str) -> Any:
        return x.view(self.dtype_of(dtype))

    def cast(self, x: Any, dtype: str | None) -> Any:
        return x.astype(x.dtype if dtype is None else self.dtype_of(dtype), order="C", copy=True)

    def check_writable(self, x: Any, name: str = "x") -> None:
        if not x.flags.writeable:
            raise ValueError(
                f"{name} is a read-only numpy array; in-place collectives (all_reduce, broadcast) "
                f"need a writable array: pass {name}.copy()"
            )
        if _overlapping(x.shape, x.strides):
            raise ValueError(_OVERLAPPING.format(name=name, kind="numpy array", strides=x.strides,
                                                 copy=f"{name}.copy()"))

    host_view = numpy_host_view  # (collectives/host_views.py: compiled with the call path)

    def empty(self, like: Any, shape: tuple[int, ...], dtype: str | None = None) -> Any:
        return sys.modules["numpy"].empty(shape, dtype=like.dtype if dtype is None else self.dtype_of(dtype))


class CupyAdapter(NumpyAdapter):
    name = "cupy"

    def is_cuda(self, x: Any) -> bool:
        return True

    def device_index(self, x: Any) -> int | None:
        return int(x.device.id)

    def check_writable(self, x: Any, name: str = "x") -> None:
        # CuPy arrays have no read-only flag; zero strides as for numpy.
        if _overlapping(x.shape, x.strides):
            raise ValueError(_OVERLAPPING.format(name=name, kind="cupy array", strides=x.strides,
                                                 copy=f"{name}.copy()"))

    host_view = ArrayAdapter.host_view  # device memory: never a host view

    def empty(self, like: Any, shape: tuple[int, ...], dtype: str | None = None) -> Any:
        cupy = sys.modules["cupy"]
        with like.device:
            return cupy.empty(shape, dtype=like.dtype if dtype is None else self.dtype_of(dtype))

    def copy_(self, dst: Any, src: Any) -> None:
        sys.modules["cupy"].copyto(dst, src, casting="unsafe")  # wrapping, for int32 -> int16


class TorchAdapter(ArrayAdapter):
    name = "torch"
    _table: dict[Any, str] | None = None

    def _dtype_names(self) -> dict[Any, str]:
        if self._table is None:
            torch = sys.modules["torch"]
            self._table = {getattr(torch, name): name for name in DTYPES}
        return self._table

    checks_memory = True

    def dtype_name(self, x: Any) -> str:
        name = super().dtype_name(x)
        self.check_memory(x)
        return name

    def check_memory(self, x: Any, name: str = "x") -> None:
        # Memory a transport can address: CPU or CUDA, dense. (meta, mps, xpu... and
        # sparse layouts would fail halfway inside a backend otherwise.)
        if not (x.is_cpu or x.is_cuda):
            raise ValueError(f"{name} is a torch tensor on device {x.device}; collectives take "
                             f"CPU or CUDA tensors: move it with {name}.to('cpu') or {name}.to('cuda')")
        if x.layout != sys.modules["torch"].strided:
            raise TypeError(f"{name} is a torch tensor with layout {x.layout}; collectives take "
                            f"dense (torch.strided) tensors: pass {name}.to_dense()")
        if x.is_nested:  # layout torch.strided too: the check above misses it
            raise TypeError(f"{name} is a nested torch tensor; collectives take dense tensors of one "
                            f"shape: pass {name}.to_padded_tensor(0), or each component separately")
        if x.is_neg():  # transports read the raw memory: the lazy negation would be lost
            raise ValueError(f"{name} is a torch tensor with its negative bit set (a lazy view such as "
                             f"{name}._neg_view() or torch.conj of a real view); pass "
                             f"{name}.resolve_neg() and use the tensor it returns")

    def is_cuda(self, x: Any) -> bool:
        return bool(x.is_cuda)

    def device_index(self, x: Any) -> int | None:
        return x.device.index if x.is_cuda else None

    def check_writable(self, x: Any, name: str = "x") -> None:
        if x.requires_grad:
            raise ValueError(
                f"{name} requires grad; in-place collectives (all_reduce, broadcast) would break "
                f"autograd: pass {name}.detach() (it shares memory) or a tensor that does not require grad"
            )
        if _overlapping(x.shape, x.stride()):
            raise ValueError(_OVERLAPPING.format(name=name, kind="torch tensor", strides=tuple(x.stride()),
                                                 copy=f"{name}.clone()"))

    host_view = tensor_host_view  # (collectives/host_views.py: compiled with the call path)

    def is_contiguous(self, x: Any) -> bool:
        return bool(x.is_contiguous())

    def empty(self, like: Any, shape: tuple[int, ...], dtype: str | None = None) -> Any:
        torch = sys.modules["torch"]
        return torch.empty(size=shape, dtype=like.dtype if dtype is None else getattr(torch, dtype),
                           device=like.device)

    def copy_(self, dst: Any, src: Any) -> None:
        dst.copy_(src)  # casts (wrapping, for int32 -> int16)

    def view(self, x: Any, dtype: str) -> Any:
        return x.view(getattr(sys.modules["torch"], dtype))

    def cast(self, x: Any, dtype: str | None) -> Any:
        return self.empty(x, tuple(x.shape), dtype).copy_(x)


# In-place results need one memory location per element; read-only inputs may overlap.
_OVERLAPPING = ("{name} is a {kind} with a zero stride (strides {strides}: several elements share "
                "one memory location, e.g. from expand/broadcast_to/as_strided); in-place "
                "collectives (all_reduce, broadcast, reduce, recv) cannot write a result into "
                "it: pass {copy}")

def _overlapping(shape: Any, strides: Any) -> bool:
    """Whether a dimension longer than 1 has stride 0 (its elements share one location).
    A zero stride on a dimension of length 1 (``x[None]``), or in an empty array, shares
    nothing."""
    return 0 in strides and 0 not in shape and any(n > 1 and s == 0
                                                   for n, s in zip(shape, strides))


NUMPY = NumpyAdapter()
TORCH = TorchAdapter()
CUPY = CupyAdapter()

# type(x) -> adapter; filled on first sight of each type so the call path is one lookup.
_BY_TYPE: dict[type, ArrayAdapter] = {}


def type_name(cls: type) -> str:
    """``module.Name`` of a class, through the shortest module path that exports it: numpy 1.x
    defines MaskedArray in ``numpy.ma.core``, numpy 2 says ``numpy.ma``; both give
    ``numpy.ma.MaskedArray``, the name users write."""
    parts = cls.__module__.split(".")
    for end in range(1, len(parts)):
        module = ".".join(parts[:end])
        if getattr(sys.modules.get(module), cls.__qualname__, None) is cls:
            return f"{module}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def adapter_for(x: Any) -> ArrayAdapter:
    """The adapter for ``x``; ``TypeError`` naming the supported array types otherwise."""
    try:
        return _BY_TYPE[type(x)]
    except KeyError:
        pass
    adapter = _find_adapter(x)
    if adapter is not None and adapter is not TORCH and type(x).__name__ != "ndarray":
        raise TypeError(
            f"x is a {type_name(type(x))}, a subclass of ndarray; "
            "collectives take plain arrays (a subclass's extra state, such as a mask, would "
            f"not travel): pass {adapter.name}.asarray(x)"
            + (" (its data) and reduce the mask separately" if hasattr(x, "mask") else ""))
    if adapter is None:
        raise TypeError(
            f"x of type {type_name(type(x))} is not supported; "
            "pass a torch.Tensor (CPU or CUDA), numpy.ndarray or cupy.ndarray"
        )
    _BY_TYPE[type(x)] = adapter
    return adapter


def _find_adapter(x: Any) -> ArrayAdapter | None:
    # Only libraries the caller already imported can have made x.
    for module, cls, adapter in (("torch", "Tensor", TORCH), ("numpy", "ndarray", NUMPY),
                                 ("cupy", "ndarray", CUPY)):
        lib = sys.modules.get(module)
        if lib is not None and isinstance(x, getattr(lib, cls)):
            return adapter
    return None
