# The types of backends/mpi_carried.py's compiled form (collectives.backends._carried_c, setup.py's
# COMPILED): Cython reads this file beside the .py it compiles; the Python form never does. The
# `cdef inline` functions here are the C forms of the helpers mpi_carried.py defines for its
# Python form under `if not cython.compiled:` (the same names): x's bytes held as a buffer, copied
# with memcpy, reduced in C where the op is plain C arithmetic (mpi_carried.ARITHMETIC's codes).

cimport cython
from cpython.buffer cimport PyBuffer_Release, PyObject_CheckBuffer
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

from collectives.backends._round_c cimport Round, held_buffer, own_payload, payload_at

from collectives.calls import NOT_TAKEN


cdef class Carrier:
    cdef readonly Round round
    cdef readonly int size, rank, kind, arith
    cdef readonly Py_ssize_t start, item
    cdef readonly bint avg, on_root, writes_x, rooted
    cdef public object mpi_type, local, new, make, channel
    cdef public dict places, shapes, staged
    cdef public Py_ssize_t staged_bytes
    cdef public bint held
    cdef Py_buffer x

    @cython.locals(n=Py_ssize_t, reduced=int64_t)
    cpdef tuple run(self, object view, object root, object out, object extra, int64_t word)
    cpdef place_numpy(self, object view)
    cpdef made_numpy(self, object view, object root, object out)


cdef extern from "<stdint.h>":
    const int64_t INT64_MIN, INT64_MAX


cdef inline int64_t marked(int64_t word) noexcept:
    """``word`` with bit 63 (mpi_carried.CARRIED): this rank's x travels in its block."""
    return word | INT64_MIN


cdef inline int64_t unmarked(int64_t word) noexcept:
    """``word`` less bit 63 (mpi_carried.WORD_BITS)."""
    return word & INT64_MAX


# The kinds (mpi_carried.KINDS).
cdef enum:
    ALL_REDUCE, REDUCE, REDUCE_SCATTER, BROADCAST, ALL_GATHER, GATHER, SCATTER, ALL_TO_ALL


cdef inline Py_ssize_t hold(Carrier c, object view) except -1:
    """x's bytes: its buffer held (C-contiguous; writable where x is the result), else (no such
    buffer: the numpy forms below run) its nbytes."""
    c.held = held_buffer(view, &c.x, c.writes_x)
    return c.x.len if c.held else view.nbytes


cdef inline void release(Carrier c) noexcept:
    if c.held:
        c.held = False
        PyBuffer_Release(&c.x)


cdef inline int place(Carrier c, object view) except -1:
    if not c.held:
        c.place_numpy(view)
        return 0
    memcpy(own_payload(c.round), c.x.buf, c.x.len)
    return 0


# -- the reductions in C: inout[i] = in[i] op inout[i] (MPI_Reduce_local's order) -------------
# (integers computed unsigned: they wrap, as MPI and numpy do, with no signed overflow)

ctypedef fused integer:
    int8_t
    uint8_t
    int16_t
    int32_t
    int64_t

ctypedef fused real:
    float
    double


cdef inline void reduce_integers(integer *inout, const integer *src, Py_ssize_t n, int op) noexcept nogil:
    cdef Py_ssize_t i
    cdef integer a, b
    for i in range(n):
        a = src[i]
        b = inout[i]
        if op == 0:
            inout[i] = <integer>(<uint64_t>a + <uint64_t>b)
        elif op == 1:
            inout[i] = <integer>(<uint64_t>a * <uint64_t>b)
        elif op == 2:
            inout[i] = a if a < b else b
        elif op == 3:
            inout[i] = a if a > b else b
        elif op == 4:
            inout[i] = a & b
        elif op == 5:
            inout[i] = a | b
        else:
            inout[i] = a ^ b


cdef inline void reduce_reals(real *inout, const real *src, Py_ssize_t n, int op) noexcept nogil:
    cdef Py_ssize_t i
    if op == 1:
        for i in range(n):
            inout[i] = src[i] * inout[i]
    else:  # (SUM, and AVG's sum)
        for i in range(n):
            inout[i] = src[i] + inout[i]


cdef inline void arithmetic(int code, char *inout, const char *src, Py_ssize_t n) noexcept nogil:
    """The C reduction of ``code`` (mpi_carried.ARITHMETIC: 10 * dtype + op) over n bytes."""
    cdef int t = code // 10, op = code % 10
    if t == 0:
        reduce_integers(<int8_t *>inout, <const int8_t *>src, n, op)
    elif t == 1:
        reduce_integers(<uint8_t *>inout, <const uint8_t *>src, n, op)
    elif t == 2:
        reduce_integers(<int16_t *>inout, <const int16_t *>src, n // 2, op)
    elif t == 3:
        reduce_integers(<int32_t *>inout, <const int32_t *>src, n // 4, op)
    elif t == 4:
        reduce_integers(<int64_t *>inout, <const int64_t *>src, n // 8, op)
    elif t == 5:
        reduce_reals(<float *>inout, <const float *>src, n // 4, op)
    else:
        reduce_reals(<double *>inout, <const double *>src, n // 8, op)


cdef inline int reduce_into(Carrier c, Py_ssize_t k, Py_ssize_t skip, Py_ssize_t n, object target,
                            char *to) except -1:
    """Rank k's payload bytes [skip, skip + n) reduced into target (whose bytes are ``to``)."""
    if c.arith >= 0:
        arithmetic(c.arith, to, payload_at(c.round, k) + skip, n)
        return 0
    c.local([c.round.payloads[k, skip:skip + n], c.mpi_type], [target, c.mpi_type])
    return 0


cdef inline int reduction(Carrier c, object target, char *to, Py_ssize_t skip, Py_ssize_t n,
                          bint own) except -1:
    """Every rank's bytes [skip, skip + n) of its payload reduced into target, rank 0's first; at
    2 ranks where target holds this rank's own already (``own``), the peer's reduced into it.
    Then AVG's division."""
    cdef Py_ssize_t k
    if c.size == 2 and own:
        reduce_into(c, 1 - c.rank, skip, n, target, to)
    else:
        memcpy(to, payload_at(c.round, 0) + skip, n)
        for k in range(1, c.size):
            reduce_into(c, k, skip, n, target, to)
    if c.avg:
        target /= c.size
    return 0


cdef inline tuple new_into(Carrier c, object view, tuple shape, object out, Py_ssize_t need, char **to):
    """The call's new result of ``shape`` (``out`` where given) and the object its reduction
    writes (None where it needs none): (result, target); in ``*to``, where its ``need`` bytes go.
    An out= (checked by the call path: x's kind, dtype and device, C-contiguous, writable, the
    result's shape) is written as it is: a numpy array through its buffer, a tensor at its
    address (its numpy view costs 0.7 us), but for AVG, whose division takes the numpy view."""
    cdef Py_buffer got
    if out is not None and not c.avg:
        if PyObject_CheckBuffer(out):
            target = out
        elif c.arith >= 0 or c.kind != REDUCE_SCATTER:  # a CPU tensor: written at its address
            _fits(out.nbytes, need)
            to[0] = <char *><size_t>out.data_ptr()
            return out, None
        else:
            target = out.numpy()
        result = out
    else:
        result, target = c.new(view, shape, out)
    if not held_buffer(target, &got, True):
        raise ValueError("a carried call's result must be one C-contiguous writable buffer")
    PyBuffer_Release(&got)  # (the result keeps its memory)
    _fits(got.len, need)
    to[0] = <char *>got.buf
    return result, target


cdef inline int _fits(Py_ssize_t holds, Py_ssize_t need) except -1:
    if holds != need:
        raise ValueError(f"out holds {holds} bytes; the result has {need}")
    return 0


cdef inline object made(Carrier c, object view, object root, object out):
    """The call's result from every rank's x in the round's blocks (C: memcpy, the reductions)."""
    cdef Py_ssize_t n = c.x.len, part, k
    cdef int size = c.size, rank = c.rank, at
    cdef char *to = NULL
    cdef Round r = c.round
    if not c.held:
        return c.made_numpy(view, root, out)
    kind = c.kind
    if kind == ALL_REDUCE or kind == REDUCE:
        if kind == REDUCE and root != rank:
            return view
        reduction(c, view, <char *>c.x.buf, 0, n, True)
        return view
    if kind == BROADCAST:
        at = root
        if at != rank:
            memcpy(c.x.buf, payload_at(r, at), n)
        return view
    if kind == ALL_GATHER or kind == GATHER:
        if kind == GATHER and root != rank:
            return None
        result, _ = new_into(c, view, (size,) + view.shape, out, size * n, &to)
        for k in range(size):
            memcpy(to + k * n, payload_at(r, k), n)
        return result
    if c.x.ndim < 1:
        raise ValueError("a carried call of this kind needs x with a first dimension")
    part = n // size
    shape = view.shape
    if kind == SCATTER:
        at = root
        result, _ = new_into(c, view, shape[1:], out, part, &to)
        memcpy(to, payload_at(r, at) + rank * part, part)
        return result
    if kind == ALL_TO_ALL:
        result, _ = new_into(c, view, shape, out, n, &to)
        for k in range(size):
            memcpy(to + k * part, payload_at(r, k) + rank * part, part)
        return result
    # REDUCE_SCATTER
    result, target = new_into(c, view, (shape[0] // size,) + shape[1:], out, part, &to)
    reduction(c, target, to, rank * part, part, False)
    return result


cdef inline object staged_call(Carrier c, object view, object root, object out):
    """The call after its round (x past the payload, every rank on its fast path) through the fast
    path's staged request of its shape (and root), as backends/mpi_staged.py runs it: x into the
    stage's first bytes, the request started and completed (the Round's start_staged), the result
    out of its last bytes. NOT_TAKEN where there is none yet (the fast path makes it), under no
    timeout, or for AVG."""
    cdef Py_buffer stage
    cdef Py_ssize_t n = c.x.len, need
    cdef char *to = NULL
    cdef const char *end
    cdef bint mine, sends, gets
    cdef int kind = c.kind, size = c.size
    if c.staged is None or c.avg or not c.held or n == 0 or n > c.staged_bytes or c.channel.timeout is None:
        return NOT_TAKEN
    shape = view.shape
    entry = c.staged.get((shape, root) if c.rooted else shape)
    if entry is None:
        return NOT_TAKEN
    request, array = entry
    mine = not c.rooted or root == c.rank
    sends = mine if c.on_root else True
    gets = mine if kind == REDUCE or kind == GATHER else (not mine if kind == BROADCAST else True)
    if (kind == REDUCE_SCATTER or kind == SCATTER) and c.x.ndim < 1:
        return NOT_TAKEN
    if not held_buffer(array, &stage, True):
        raise ValueError("a staged call's stage must be one C-contiguous writable buffer")
    try:
        if n > stage.len:
            raise ValueError("a staged call's x does not fit its staging array")
        if sends:
            memcpy(stage.buf, c.x.buf, n)
        c.round.start_staged(request)
        end = <const char *>stage.buf + stage.len
        if kind == ALL_REDUCE or kind == REDUCE or kind == BROADCAST:  # (x is the result)
            if gets:
                memcpy(c.x.buf, end - n, n)
            return view
        if kind == REDUCE_SCATTER:
            need = n // size
            result, _ = new_into(c, view, (shape[0] // size,) + shape[1:], out, need, &to)
        elif kind == ALL_GATHER or kind == GATHER:
            if not gets:
                return None
            need = size * n
            result, _ = new_into(c, view, (size,) + shape, out, need, &to)
        elif kind == SCATTER:
            need = n // size
            result, _ = new_into(c, view, shape[1:], out, need, &to)
        else:  # ALL_TO_ALL
            need = n
            result, _ = new_into(c, view, shape, out, need, &to)
        if need > stage.len:
            raise ValueError("a staged call's result is past its staging array")
        memcpy(to, end - need, need)
        return result
    finally:
        PyBuffer_Release(&stage)
