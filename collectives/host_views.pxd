# The types of collectives/host_views.py's compiled form (collectives._host_views_c, setup.py's
# COMPILED): Cython reads this file beside the .py it compiles; the Python form never does.
#
# The `cdef inline` functions below are the C forms of the helpers host_views.py defines for its
# Python form under `if not cython.compiled:` (the same names): a numpy array's flags and shape read
# through the buffer protocol, with no flags object or shape tuple made. numpy grants a buffer
# that is asked to be C-contiguous (and writable) exactly where its flags say the array is; the
# buffer's shape is the array's own dimensions. A request it refuses (or an object without the
# protocol) reads as "no": the caller's full check then runs, which names any fault.

cimport cython
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_STRIDES, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer

# The result shapes' rules (host_views.py's, there as Python ints): C ints here, compared in C.
cdef int STACKED, BLOCK_OF_ROWS, ONE_ROW, SAME_SHAPE, ROWS_LATER, TENSOR

# A tensor out='s attributes (host_views.py's): called in C by tensor_out_fits, and from Python by
# ArgumentChecks.check_out.
cpdef bint tensor_out_usable(object out, object x) except -1


cdef inline bint c_contiguous(object x, bint writable) except -1:
    """Whether ``x`` gives a C-contiguous buffer (and a writable one where asked)."""
    cdef Py_buffer view
    try:
        PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0))
    except (BufferError, ValueError, TypeError):
        return False
    PyBuffer_Release(&view)
    return True


cdef inline bint shape_fits(object out, object x, int form, Py_ssize_t size) except -1:
    """Whether ``out`` gives a C-contiguous, writable buffer of the result's shape of ``x`` by
    ``form`` over ``size`` ranks (x's shape from its strided buffer)."""
    cdef Py_buffer o, v
    cdef Py_ssize_t k, n, at, first
    cdef bint fits
    try:
        PyObject_GetBuffer(out, &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    except (BufferError, ValueError, TypeError):
        return False
    try:
        try:
            PyObject_GetBuffer(x, &v, PyBUF_STRIDES)
        except (BufferError, ValueError, TypeError):
            return False
        n = v.ndim
        # out's dimensions from ``at`` against x's from ``first``, where their numbers agree
        if form == STACKED:
            fits, at, first = o.ndim == n + 1 and o.shape[0] == size, 1, 0
        elif form == BLOCK_OF_ROWS:
            fits, at, first = n > 0 and o.ndim == n and o.shape[0] == v.shape[0] // size, 1, 1
        elif form == ONE_ROW:  # (x's shape past its first dimension: () for a 0-d x)
            fits, at, first = o.ndim == (n - 1 if n > 0 else 0), 0, 1
        elif form == ROWS_LATER:  # (any number of rows: checked once the counts have travelled)
            fits, at, first = o.ndim == n, 1, 1
        else:
            fits, at, first = form == SAME_SHAPE and o.ndim == n, 0, 0
        if fits:
            for k in range(first, n):
                if o.shape[at + k - first] != v.shape[k]:
                    fits = False
                    break
        PyBuffer_Release(&v)
        return fits
    finally:
        PyBuffer_Release(&o)
