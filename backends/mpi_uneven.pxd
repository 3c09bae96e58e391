# The types of backends/mpi_uneven.py's compiled form (collectives.backends._uneven_c, setup.py's
# COMPILED): Cython reads this file beside the .py it compiles; the Python form never does. The
# counts are C integers here, and the byte copies (the .py's Python forms of host_row, payload_room,
# payload_rows, staged_rows) memcpy between the buffers' memory.

cimport cython
from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_STRIDES,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_CheckBuffer,
    PyObject_GetBuffer,
)
from libc.string cimport memcpy

from collectives.backends._round_c cimport Round


@cython.locals(bits=Py_ssize_t, left=Py_ssize_t, step=Py_ssize_t)
cpdef Py_ssize_t uneven_block(Py_ssize_t need) except -1


cdef class Uneven:
    cdef readonly object channel, call, method
    cdef readonly bint gathered
    cdef readonly Py_ssize_t size, rank
    cdef readonly Round round
    cdef object numpy_adapter, torch_adapter, kind, blocking, nonblocking, byte, empty
    cdef dict tables
    # the running call's counts (see read): per rank, and the most and the total
    cdef Py_ssize_t sent[64]
    cdef Py_ssize_t got[64]
    cdef Py_ssize_t skip[64]
    cdef Py_ssize_t mine[64]
    cdef Py_ssize_t most_sent, most_block, total
    cdef int ndim
    # the round's payloads last read: where they lie, a payload's bytes and the stride between two
    cdef object payloads
    cdef const char *payloads_at
    cdef Py_ssize_t room, stride

    @cython.locals(counts=list, entry=object, block=Py_ssize_t)
    cdef rows(self, r, view, Py_ssize_t row, carried, int kind)
    @cython.locals(size=Py_ssize_t, rank=Py_ssize_t, k=Py_ssize_t, j=Py_ssize_t, n=Py_ssize_t,
                   every=Py_ssize_t, splits=list)
    cdef int read(self, list counts) except -1
    @cython.locals(table=dict)
    cdef stage_of(self, Py_ssize_t block)
    cdef tuple new(self, r, view, tuple shape, int kind)
    @cython.locals(size=Py_ssize_t, k=Py_ssize_t, n=Py_ssize_t, gets=list, sends=list, send=list)
    cdef bint plain(self, view, got, Py_ssize_t row) except -1


cdef inline object tensor_target(object out):
    """An out= CPU tensor as the copies write it: the tensor itself, at its address (its numpy view
    costs about 0.7 us a call: see result_buffer)."""
    return out


cdef inline int result_buffer(object got, Py_buffer *into) except -1:
    """``got``'s memory in ``*into`` (buf and len): 1 where it is a writable C-contiguous buffer,
    held (release it), else 0: an out= CPU tensor at its address, nothing held."""
    if PyObject_CheckBuffer(got):
        PyObject_GetBuffer(got, into, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
        return 1
    into.buf = <void *><size_t>got.data_ptr()
    into.len = got.nbytes
    return 0


cdef inline Py_ssize_t host_row(Uneven uneven, object view) except -2:
    """The bytes of a row of ``view``, -1 where it is not one C-contiguous buffer; its dimensions
    in ``uneven.ndim``."""
    cdef Py_buffer b
    cdef Py_ssize_t row
    cdef int d
    try:
        PyObject_GetBuffer(view, &b, PyBUF_C_CONTIGUOUS)
    except (BufferError, TypeError, ValueError):
        return -1
    if b.ndim < 1:
        PyBuffer_Release(&b)
        raise ValueError("an uneven call's x has rows")
    uneven.ndim = b.ndim
    row = b.itemsize
    for d in range(1, b.ndim):
        row *= b.shape[d]
    PyBuffer_Release(&b)
    return row


cdef inline Py_ssize_t payload_room(Uneven uneven, object carried) except -1:
    """The bytes of a payload of the round's blocks (``carried``: every rank's, one row each),
    kept with where they lie (the round's views of its memory outlive calls; kept, they stay)."""
    cdef Py_buffer b
    if carried is uneven.payloads:
        return uneven.room
    PyObject_GetBuffer(carried, &b, PyBUF_STRIDES)
    try:
        if b.ndim != 2 or b.shape[0] < uneven.size:
            raise ValueError("the round's payloads are one row per rank")
        uneven.payloads_at, uneven.room, uneven.stride = <const char *>b.buf, b.shape[1], b.strides[0]
        uneven.payloads = carried
    finally:
        PyBuffer_Release(&b)
    return uneven.room


cdef inline int payload_rows(Uneven uneven, object carried, object got, Py_ssize_t row) except -1:
    """Every rank's rows for this one out of the round's payloads, back to back into ``got``."""
    cdef Py_buffer into
    cdef Py_ssize_t k, n, start, at = 0
    cdef Py_ssize_t room = payload_room(uneven, carried)
    cdef int held = result_buffer(got, &into)
    try:
        for k in range(uneven.size):
            n, start = uneven.got[k] * row, uneven.skip[k] * row
            if start + n > room or at + n > into.len:
                raise ValueError("the rows are past the payload or the result")
            memcpy(<char *>into.buf + at, uneven.payloads_at + k * uneven.stride + start, n)
            at += n
    finally:
        if held:
            PyBuffer_Release(&into)
    return 0


cdef inline int staged_rows(Uneven uneven, tuple entry, Py_ssize_t block, object view, object got,
                            Py_ssize_t row) except -1:
    """``entry``'s staged request run on x's rows, every rank's rows for this one out of the blocks
    it got, back to back into ``got`` (the staging array's, x's and got's buffers held throughout)."""
    cdef Py_buffer staged, data, into
    cdef Py_ssize_t j, k, n, at = 0
    cdef Py_ssize_t size = uneven.size
    cdef Py_ssize_t sends = block if uneven.gathered else size * block
    cdef char *stage_at
    cdef int held
    request, stage = entry
    PyObject_GetBuffer(stage, &staged, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
    try:
        PyObject_GetBuffer(view, &data, PyBUF_C_CONTIGUOUS)
        try:
            held = result_buffer(got, &into)
            try:
                stage_at = <char *>staged.buf
                if sends + size * block > staged.len:
                    raise ValueError("the blocks are past the staging array")
                if uneven.gathered:
                    if data.len > block:
                        raise ValueError("the rows are past a block")
                    memcpy(stage_at, data.buf, data.len)
                else:
                    for j in range(size):
                        n = uneven.mine[j] * row
                        if n > block or at + n > data.len:
                            raise ValueError("the rows are past a block or x")
                        memcpy(stage_at + j * block, <char *>data.buf + at, n)
                        at += n
                uneven.round.start_staged(request)
                at = 0
                for k in range(size):
                    n = uneven.got[k] * row
                    if n > block or at + n > into.len:
                        raise ValueError("the rows are past a block or the result")
                    memcpy(<char *>into.buf + at, stage_at + sends + k * block, n)
                    at += n
            finally:
                if held:
                    PyBuffer_Release(&into)
        finally:
            PyBuffer_Release(&data)
    finally:
        PyBuffer_Release(&staged)
    return 0
