"""The per-array checks of host arrays on the call path's fast path (``NumpyAdapter.host_view``,
``TorchAdapter.host_view``), in a module of its own so that they are compiled as the call path is:
setup.py's ``COMPILED`` builds it as it stands into ``collectives._host_views_c``, and a compiled
communicator's call path runs that form (:mod:`collectives.front`; the Python form otherwise). No
import of the package: the adapter is an argument."""

from __future__ import annotations

from typing import Any

try:
    import cython
except ImportError:  # (the Python form where Cython is not installed)
    from types import SimpleNamespace

    cython = SimpleNamespace(compiled=False)


def numpy_host_view(adapter: Any, x: Any, in_place: bool) -> Any:
    """``adapter.check_array``'s checks of the numpy array ``x`` (their errors raised), returning
    ``x`` itself when it is C-contiguous (and writable where ``in_place``), else ``None``."""
    # One read of x's flags: a C-contiguous array has no zero stride on a dimension longer than
    # 1, so a writable one passes check_writable (and numpy arrays have no memory check).
    if c_contiguous(x, in_place):
        return x
    adapter.check_array(x, in_place)
    return None


#: The shapes of a result that :func:`out_fits` knows, by the rule of collectives/calls.py that
#: makes it from x's shape (``Call.out_shape``): ``(size, *shape)`` (all_gather, gather), a block
#: of ``shape[0] // size`` rows (reduce_scatter), one row (scatter), x's shape (all_to_all); and
#: rows of x's trailing shape (the uneven all_gather_v and all_to_all with splits, whose number of
#: rows is checked once the counts have travelled: ``CallCheck.check_counts``). A torch tensor's
#: form has the bit ``TENSOR`` set besides (a numpy array's has not).
STACKED, BLOCK_OF_ROWS, ONE_ROW, SAME_SHAPE, ROWS_LATER = 1, 2, 3, 4, 5
TENSOR = 8


def out_fits(out: Any, x: Any, form: int, size: int) -> bool:
    """Whether ``out=`` passes ``ArgumentChecks.check_out`` for ``x`` as it stands: an array of x's
    type and dtype (and a tensor of x's device and layout), contiguous (C order) and writable,
    without a negative bit and not requiring grad, of the result's shape (``form``: one of the
    rules above, over ``size`` ranks). False leaves the call to check_out, which names the fault:
    what it accepts at once, in a few reads (a numpy array's flags and both shapes:
    ``shape_fits``; a tensor's attributes: :func:`tensor_out_fits`)."""
    if type(out) is not type(x):
        return False
    if form & TENSOR:
        return tensor_out_fits(out, x, form ^ TENSOR, size)
    dtype = out.dtype
    if dtype is not x.dtype and dtype != x.dtype:
        return False
    return shape_fits(out, x, form, size)


def tensor_out_fits(out: Any, x: Any, form: int, size: int) -> bool:
    """:func:`out_fits` of the tensor ``out`` (of x's type): :func:`tensor_out_usable`, then its
    shape by ``form``."""
    if not tensor_out_usable(out, x):
        return False
    try:  # (a nested tensor's shape raises: check_out names it)
        return shapes_fit(out.shape, x.shape, form, size)
    except RuntimeError:
        return False


def tensor_out_usable(out: Any, x: Any) -> bool:
    """Whether the tensor ``out`` is what an ``out=`` for the tensor ``x`` must be but for its
    shape: of x's dtype, layout and device, contiguous, without a negative bit and not requiring
    grad. ``ArgumentChecks.check_out``'s own first test of a tensor and :func:`tensor_out_fits`'s,
    in reads of its attributes (torch's dtypes and layouts are one object each; two CPU tensors
    are on the one CPU device). False leaves the fault to check_out's checks, which name it."""
    if out.dtype is not x.dtype or out.requires_grad or out.is_neg() or out.layout is not x.layout:
        return False
    try:  # (a CSR tensor's is_contiguous raises)
        return bool(out.is_contiguous() and (out.is_cpu and x.is_cpu or out.device == x.device))
    except RuntimeError:
        return False


def shapes_fit(shape: tuple[int, ...], x_shape: tuple[int, ...], form: int, size: int) -> bool:
    """Whether ``shape`` is the result's shape of an x of ``x_shape`` by ``form`` over ``size``
    ranks (a torch.Size is a tuple: its slices and comparisons are a tuple's)."""
    if form == STACKED:
        return len(shape) == len(x_shape) + 1 and shape[0] == size and shape[1:] == x_shape
    if form == BLOCK_OF_ROWS:
        return len(x_shape) > 0 and len(shape) == len(x_shape) and shape[0] == x_shape[0] // size \
            and shape[1:] == x_shape[1:]
    if form == ONE_ROW:
        return shape == x_shape[1:]
    if form == ROWS_LATER:
        return len(shape) == len(x_shape) and shape[1:] == x_shape[1:]
    return form == SAME_SHAPE and shape == x_shape


if not cython.compiled:  # the Python form of the .pxd's C helpers (the compiled module has those)
    def c_contiguous(x: Any, writable: bool) -> bool:
        """Whether the numpy array ``x`` is C-contiguous (and writable where asked): its flags."""
        flags = x.flags
        return bool(flags.c_contiguous and (flags.writeable or not writable))

    def shape_fits(out: Any, x: Any, form: int, size: int) -> bool:
        """Whether the numpy ``out`` is C-contiguous and writable, of the result's shape of ``x``
        by ``form`` over ``size`` ranks."""
        return c_contiguous(out, True) and shapes_fit(out.shape, x.shape, form, size)


#: The numpy views of the last tensors :func:`tensor_host_view` took: ``(id(x), view, x's data
#: pointer, dtype, shape)``, newest first. A view keeps its tensor's memory alive, so a tensor of
#: that id whose data pointer, dtype and shape are the view's (and that is still contiguous, without
#: a negative bit and not requiring grad) is that memory, as the view shows it: a new tensor at a
#: freed one's address included. (Every kept view was made under the GIL, which both forms need.)
_views: list[tuple[int, Any, int, Any, Any]] = []
_KEPT_VIEWS = 4


def tensor_host_view(adapter: Any, x: Any, in_place: bool) -> Any:
    """``adapter.check_array``'s checks of the torch tensor ``x`` (their errors raised), returning
    its numpy view when it is a C-contiguous CPU tensor that ``x.numpy()`` takes, else ``None``
    (one of the last few views made, where it still shows x: see ``_views``)."""
    key = id(x)
    for kept in _views:
        if kept[0] == key:
            if kept[3] is x.dtype and kept[2] == x.data_ptr() and kept[4] == x.shape and x.is_contiguous() \
                    and not x.requires_grad and not x.is_neg():
                return kept[1]
            _views.remove(kept)
            break
    # x.numpy() refuses every tensor that check_memory or check_writable refuses (non-CPU,
    # sparse/mkldnn/nested, negative bit, requires grad; tests/collective_calls/test_call_path.py checks
    # each) and bfloat16; those get the checks (and their errors) and the general path.
    try:
        view = x.numpy()
    except (RuntimeError, TypeError):
        view = None
    else:  # a zero stride on a dimension longer than 1 leaves the view non-contiguous
        if view.flags.c_contiguous:
            _views.insert(0, (key, view, x.data_ptr(), x.dtype, x.shape))
            del _views[_KEPT_VIEWS:]
            return view
    adapter.check_array(x, in_place)
    return None
