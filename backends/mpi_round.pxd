# The types of backends/mpi_round.py's compiled form (collectives.backends._round_c, setup.py's
# COMPILED): Cython reads this file beside the .py it compiles; the Python form never does.
#
# What other compiled modules cimport (`from collectives.backends._round_c cimport Round, ...`):
# the Round's C fields and methods (run: the round with a word; agree: the counts' round after
# set_row; row_value; start_staged / staged: a staged request run) and the inline accessors
# below (payload_at, own_payload, row_at, room, held_buffer over PyObject_GetBuffer).
# The `cdef inline` functions here are the C forms of the helpers mpi_round.py defines for its
# Python form under `if not cython.compiled:` (the same names: the compiled module uses these).

cimport cython
from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_CheckBuffer,
    PyObject_GetBuffer,
)
from libc.stdint cimport int64_t
from libc.string cimport memcpy

cdef extern from "<dlfcn.h>" nogil:
    void *dlsym(void *handle, const char *symbol)
    void *dlopen(const char *filename, int flag)
    int dlclose(void *handle)
    void *RTLD_DEFAULT
    int RTLD_NOLOAD
    int RTLD_LAZY

# MPI_Start and MPI_Test, called on a persistent request's handle where mpi4py keeps it (by
# address: MPICH's MPI_Request is an int, Open MPI's a pointer; either is passed by its address).
ctypedef int (*mpi_start_fn)(void *request) noexcept nogil
ctypedef int (*mpi_test_fn)(void *request, int *flag, void *status) noexcept nogil

# A direct MPI_Test is about 4 times cheaper than mpi4py's: as many more, for the same spin.
cdef enum:
    DIRECT_POLLS_PER_POLL = 4
    # Room for an MPI_Status of any library (20 bytes in MPICH and Intel MPI, 24 in Open MPI).
    STATUS_ROOM = 256


# Bit 63 of a word and the rest (mpi_round.py's _MARK and _WORD: INT64_MIN and INT64_MAX).
cdef int64_t _MARK, _WORD


cdef class Round:
    # (the Python form's attributes, as they are there)
    cdef public object _comm, _wait, _start, _exception, _addressof
    cdef public object block, payload, blocks, words, payloads, request, args, memory, _heads
    cdef public list requests, _geometries
    cdef public tuple rooms
    cdef public bint gathers, want, persistent, direct, everyone_fast
    cdef public int geometry, read, streak, size, rank, polls
    cdef public Py_ssize_t payload_offset, want_slot, small_bytes, carry_bytes, stride
    cdef public Py_ssize_t small_room, large_room
    # (the compiled form's alone: the blocks' memory, MPI_Start and MPI_Test where bound, and the
    # handles of the requests last started directly)
    cdef char *block_at
    cdef char *memory_at
    cdef mpi_start_fn mpi_start
    cdef mpi_test_fn mpi_test
    cdef object handle_of, staged_of
    cdef void *handle
    cdef void *staged_handle

    @cython.locals(done=bint, switching=bint, everyone=bint, reduced=int64_t)
    cpdef int64_t run(self, int64_t word, object waiting=*) except? -1
    cpdef int64_t agree_word(self, int64_t word, object waiting=*) except? -1
    cpdef void wants(self, Py_ssize_t nbytes) noexcept
    cpdef set_row(self, Py_ssize_t i, int64_t value)
    cpdef int64_t row_value(self, Py_ssize_t rank, Py_ssize_t i) except? -1
    cpdef int64_t agree(self, int64_t word, object view) except? -1
    @cython.locals(n=Py_ssize_t, i=Py_ssize_t, k=Py_ssize_t, reduced=int64_t, rows=list, counts=list)
    cpdef tuple agree_counts(self, int64_t word, list row, object view)
    cpdef rows_into(self, object got, object counts, Py_ssize_t row, int rank=*)
    cpdef bint start_staged(self, object request) except -1
    cpdef staged(self, object request, object src, object stage, object dst)
    cpdef object start(self)
    cpdef read_geometry(self, int geometry)
    cpdef write_geometry(self, int geometry)
    cdef void _read_views(self, int geometry) except *
    cdef void _write_views(self, int geometry) except *


# -- the accessors other compiled modules use (C only) ----------------------------------------

cdef inline const char *payload_at(Round r, Py_ssize_t rank) noexcept:
    """Rank ``rank``'s payload in the last round's blocks."""
    return r.memory_at + rank * r.stride + r.payload_offset


cdef inline char *own_payload(Round r) noexcept:
    """This rank's payload in its block (the next round's)."""
    return r.block_at + r.payload_offset


cdef inline const int64_t *row_at(Round r, Py_ssize_t rank) noexcept:
    """Rank ``rank``'s row (after its word) in the last round's blocks."""
    return <const int64_t *>(r.memory_at + rank * r.stride) + 1


cdef inline Py_ssize_t room(Round r) noexcept:
    """The next round's payload bytes: what its writers may fill."""
    return r.carry_bytes


cdef inline bint held_buffer(object x, Py_buffer *view, bint writable) except -1:
    """``x``'s bytes (C-contiguous; writable where asked) held in ``view`` (release it): False
    where x has no such buffer (nothing held, no error). An object without the buffer protocol
    is told apart first: a failed request raising each call costs as much as the copy."""
    if not PyObject_CheckBuffer(x):
        return False
    try:
        PyObject_GetBuffer(x, view, PyBUF_C_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0))
    except (BufferError, ValueError, TypeError):
        return False
    return True


# -- the C forms of mpi_round.py's helpers --------------------------------------------------

cdef inline void *mpi_symbol(object MPI, const char *name) except? NULL:
    """``name`` (MPI_Start, MPI_Test) as the process resolves it: its global symbol first (a PMPI
    tool preloaded with LD_PRELOAD defines it and sees the round's calls as it sees mpi4py's),
    else in the library of mpi4py's module (which links libmpi: mpi4py loads it RTLD_LOCAL);
    NULL where neither has it."""
    cdef void *found = dlsym(RTLD_DEFAULT, name)
    cdef void *library
    if found != NULL:
        return found
    path = getattr(MPI, "__file__", None)
    if not isinstance(path, str):
        return NULL
    encoded = (<str>path).encode()
    library = dlopen(encoded, RTLD_NOLOAD | RTLD_LAZY)  # (mpi4py loaded it)
    if library == NULL:
        return NULL
    found = dlsym(library, name)
    dlclose(library)  # (a reference more of a library that stays loaded with mpi4py)
    return found


cdef bint polled(Round r, object request) except -1


cdef inline bint bind_mpi(Round r, object MPI) except -1:
    """MPI_Start and MPI_Test bound for ``r``'s direct calls (where ``r`` is not None); whether
    both were found."""
    cdef void *start = mpi_symbol(MPI, b"MPI_Start")
    cdef void *test = mpi_symbol(MPI, b"MPI_Test")
    if start == NULL or test == NULL:
        return False
    if r is not None:
        r._exception, r._addressof = MPI.Exception, MPI._addressof
        r.mpi_start, r.mpi_test = <mpi_start_fn>start, <mpi_test_fn>test
    return True


cdef inline void bind_memory(Round r) except *:
    r.block_at = <char *><size_t>r.block.ctypes.data
    r.memory_at = <char *><size_t>r.memory.ctypes.data if r.memory is not None else NULL


cdef inline bint made(Round r) noexcept:
    return r.block_at != NULL


cdef inline void put(Round r, Py_ssize_t slot, int64_t value) noexcept:
    (<int64_t *>r.block_at)[slot] = value


cdef inline int64_t words_and(Round r) noexcept:
    cdef int64_t reduced = -1, each
    cdef Py_ssize_t k
    if not r.gathers:
        return (<int64_t *>r.block_at)[0]
    for k in range(r.size):
        memcpy(&each, r.memory_at + k * r.stride, 8)
        reduced &= each
    return reduced


cdef inline bint everyone_wants(Round r) noexcept:
    cdef int64_t want
    cdef Py_ssize_t k, at = r.want_slot * 8
    for k in range(r.size):
        memcpy(&want, r.memory_at + k * r.stride + at, 8)
        if want != 1:
            return False
    return True


cdef inline int64_t row_item(Round r, Py_ssize_t rank, Py_ssize_t i) noexcept:
    return row_at(r, rank)[i]


cdef inline int copy_rows(Round r, object got, Py_ssize_t at, Py_ssize_t rank, Py_ssize_t start,
                          Py_ssize_t n) except -1:
    """Bytes [start, start + n) of rank ``rank``'s payload (the last round's) into got's bytes
    from ``at``."""
    cdef Py_buffer into
    if not 0 <= rank < r.size or start < 0 or n < 0 or start + n > r.stride - r.payload_offset:
        raise ValueError("rows past a rank's payload")
    PyObject_GetBuffer(got, &into, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    try:
        if at < 0 or at + n > into.len:
            raise ValueError("rows past the result's bytes")
        memcpy(<char *>into.buf + at, payload_at(r, rank) + start, n)
    finally:
        PyBuffer_Release(&into)
    return 0


cdef inline int raise_mpi(Round r, int code) except -1:
    raise r._exception(code)


cdef inline void *handle_of(Round r, object request, bint staged) except NULL:
    """The address of ``request``'s handle (MPI._addressof), kept with the request it is of."""
    if staged:
        if request is not r.staged_of:
            r.staged_handle = <void *><size_t>r._addressof(request)
            r.staged_of = request
        return r.staged_handle
    if request is not r.handle_of:
        r.handle = <void *><size_t>r._addressof(request)
        r.handle_of = request
    return r.handle


cdef inline int tested_direct(mpi_test_fn mpi_test, void *handle, int polls, object exception) except -1:
    """The request at ``handle`` tested by MPI_Test itself, ``polls`` times DIRECT_POLLS_PER_POLL
    (the fast polls, each cheaper than mpi4py's): 1 where it completed, else 0; an error code raised
    as ``exception`` (mpi4py's MPI.Exception). The fast paths' direct calls take it too
    (backends/mpi_moves.pxd)."""
    cdef int code, flag = 0, i
    cdef char status[STATUS_ROOM]
    for i in range(polls * DIRECT_POLLS_PER_POLL):
        code = mpi_test(handle, &flag, status)
        if code != 0:
            raise exception(code)
        if flag:
            return 1
    return 0


cdef inline int start_direct(Round r, object request, bint staged) except -1:
    """``request`` started and tested by MPI_Start and MPI_Test themselves (where bound), else
    through mpi4py: 1 where it completed within the fast polls, else 0."""
    cdef void *handle
    cdef int code, i
    if not r.direct or r.mpi_start == NULL:  # (direct set where bind_mpi found none: mpi4py's)
        request.Start()
        test = request.Test
        for i in range(r.polls):
            if test():
                return 1
        return 0
    handle = handle_of(r, request, staged)
    code = r.mpi_start(handle)
    if code != 0:
        return raise_mpi(r, code)
    return tested_direct(r.mpi_test, handle, r.polls, r._exception)


cdef inline bint copy_into_payload(Round r, object view) except -1:
    """``view``'s bytes into this rank's payload (where they fit the next round's): False where
    it has no C-contiguous buffer (nothing written)."""
    cdef Py_buffer x
    if not held_buffer(view, &x, False):
        return False
    if x.len <= r.carry_bytes:
        memcpy(r.block_at + r.payload_offset, x.buf, x.len)
    PyBuffer_Release(&x)
    return True


cdef inline int copy_staged(object src, object dst, bint at_end) except -1:
    """src's bytes into the first bytes of dst (at_end False), or the last bytes of src (the
    stage) into dst (at_end True)."""
    cdef Py_buffer a, b
    cdef Py_ssize_t n
    PyObject_GetBuffer(src, &a, PyBUF_C_CONTIGUOUS)
    try:
        PyObject_GetBuffer(dst, &b, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        try:
            n = b.len if at_end else a.len
            if n > (a.len if at_end else b.len):
                raise ValueError("a staged call's data is larger than its staging array")
            memcpy(b.buf, <const char *>a.buf + (a.len - n if at_end else 0), n)
        finally:
            PyBuffer_Release(&b)
    finally:
        PyBuffer_Release(&a)
    return 0
