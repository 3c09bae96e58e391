# The types of backends/mpi_moves.py's compiled form (collectives.backends._moves_c, setup.py's
# COMPILED): Cython reads this file beside the .py it compiles; the Python form never does.
#
# The `cdef inline` functions below are the C forms of the helpers mpi_moves.py defines for its
# Python form under `if not cython.compiled:` (the same names): bind_direct binds the kind's MPI
# calls (MPI_Gather and MPI_Igather, ...) and MPI_Test as the process resolves them (the Round's
# mpi_symbol: a PMPI tool preloaded sees them), with the handles of the communicator, datatypes and
# op read from mpi4py (MPI._handleof) once; call_direct makes the call on the buffers' memory.
#
# The handles are passed as intptr_t: MPICH's and Intel MPI's are ints, Open MPI's (and the MPI-5
# ABI's) pointers. Where the C calling convention passes an int argument in the low bytes of a
# 64-bit register or stack slot (64-bit little-endian Linux: x86-64, aarch64, ppc64le) an int and
# an intptr_t of its value are the same argument; bind_direct binds nothing elsewhere (mpi4py's
# calls then, as in the Python form).

cimport cython
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport intptr_t

from collectives.backends._round_c cimport mpi_symbol, mpi_test_fn, tested_direct

# The kinds of Move (mpi_moves.py's, there as Python ints): C ints here, compared in C.
cdef int ALL_REDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, STACKED, ALL_TO_ALL, GATHER, SCATTER

# The MPI calls, blocking and nonblocking (the last argument: the request), handles as intptr_t.
ctypedef int (*allreduce_fn)(const void *send, void *recv, int count, intptr_t datatype, intptr_t op,
                             intptr_t comm) noexcept nogil
ctypedef int (*iallreduce_fn)(const void *send, void *recv, int count, intptr_t datatype, intptr_t op,
                              intptr_t comm, void *request) noexcept nogil
ctypedef int (*bcast_fn)(void *buf, int count, intptr_t datatype, int root, intptr_t comm) noexcept nogil
ctypedef int (*ibcast_fn)(void *buf, int count, intptr_t datatype, int root, intptr_t comm,
                          void *request) noexcept nogil
ctypedef int (*reduce_fn)(const void *send, void *recv, int count, intptr_t datatype, intptr_t op, int root,
                          intptr_t comm) noexcept nogil
ctypedef int (*ireduce_fn)(const void *send, void *recv, int count, intptr_t datatype, intptr_t op, int root,
                           intptr_t comm, void *request) noexcept nogil
ctypedef int (*reduce_scatter_fn)(const void *send, void *recv, const int *counts, intptr_t datatype,
                                  intptr_t op, intptr_t comm) noexcept nogil
ctypedef int (*ireduce_scatter_fn)(const void *send, void *recv, const int *counts, intptr_t datatype,
                                   intptr_t op, intptr_t comm, void *request) noexcept nogil
ctypedef int (*exchange_fn)(const void *send, int send_count, intptr_t send_type, void *recv, int recv_count,
                            intptr_t recv_type, intptr_t comm) noexcept nogil
ctypedef int (*iexchange_fn)(const void *send, int send_count, intptr_t send_type, void *recv, int recv_count,
                             intptr_t recv_type, intptr_t comm, void *request) noexcept nogil
ctypedef int (*rooted_fn)(const void *send, int send_count, intptr_t send_type, void *recv, int recv_count,
                          intptr_t recv_type, int root, intptr_t comm) noexcept nogil
ctypedef int (*irooted_fn)(const void *send, int send_count, intptr_t send_type, void *recv, int recv_count,
                           intptr_t recv_type, int root, intptr_t comm, void *request) noexcept nogil


cdef class Move:
    cdef public object staged, request
    cdef readonly int kind, rank, polls
    cdef readonly Py_ssize_t most, size
    cdef readonly bint numpy, avg, direct
    cdef readonly object channel, blocking, start, new, spec, op, byte, in_place
    # (the compiled form's alone: the MPI calls where bound, the handles, the request's address,
    # reduce_scatter's counts)
    cdef void *call_blocking
    cdef void *call_start
    cdef mpi_test_fn mpi_test
    cdef intptr_t comm_handle, type_handle, byte_handle, op_handle
    cdef void *in_place_at
    cdef void *request_at
    cdef Py_ssize_t itemsize
    cdef object exception, addressof, counts
    cdef int *counts_at

    @cython.locals(kind=int, nbytes=Py_ssize_t)
    cpdef run(self, buf, root, out, extra)
    cpdef tuple result_shape(self, tuple shape)
    cdef complete(self, send, recv, root)
    cpdef tuple arguments(self, send, recv, root)
    cpdef waited(self)


cdef inline bint bind_direct(Move m, object MPI) except -1:
    """The kind's MPI calls (the names of m.blocking and m.start) and MPI_Test bound for m's
    direct calls, with the handles; whether all were found (64-bit little-endian Linux only)."""
    import sys
    cdef void *blocking
    cdef void *start
    cdef void *test
    if not sys.platform.startswith("linux") or sys.byteorder != "little" or sizeof(void *) != 8:
        return False
    try:  # (mpi4py's handle helpers, as mpi4py 3.1 and 4 have them; an mpi4py without: its calls)
        sizes = {MPI._sizeof(MPI.Comm), MPI._sizeof(MPI.Datatype), MPI._sizeof(MPI.Op), MPI._sizeof(MPI.Request)}
        handles = (handle(MPI, m.channel._comm), handle(MPI, m.byte),
                   handle(MPI, m.spec) if m.spec is not None else 0, handle(MPI, m.op) if m.op is not None else 0,
                   int(m.in_place) & 0xFFFFFFFFFFFFFFFF, MPI._addressof(m.request))
        blocking_name = ("MPI_" + m.blocking.__name__).encode()
        start_name = ("MPI_" + m.start.__name__).encode()
    except (AttributeError, TypeError, ValueError, OverflowError):
        return False
    if not sizes <= {4, 8}:
        return False
    blocking = mpi_symbol(MPI, blocking_name)
    start = mpi_symbol(MPI, start_name)
    test = mpi_symbol(MPI, b"MPI_Test")
    if blocking == NULL or start == NULL or test == NULL:
        return False
    m.call_blocking, m.call_start, m.mpi_test = blocking, start, <mpi_test_fn>test
    m.comm_handle, m.byte_handle = handles[0], handles[1]
    m.type_handle = handles[2] if m.spec is not None else m.byte_handle
    m.itemsize = m.spec.Get_size() if m.spec is not None else 1
    m.op_handle = handles[3]
    m.in_place_at = <void *><size_t>handles[4]
    m.request_at = <void *><size_t>handles[5]
    m.exception, m.addressof = MPI.Exception, MPI._addressof
    if m.kind == REDUCE_SCATTER:
        from array import array
        m.counts = array("i", [0] * m.size)
        m.counts_at = <int *><size_t>m.counts.buffer_info()[0]
    return True


cdef inline intptr_t handle(object MPI, object x) except? 0:
    """x's MPI handle (mpi4py gives an int handle sign-extended, as an unsigned 64-bit int)."""
    return <intptr_t><size_t>(MPI._handleof(x) & 0xFFFFFFFFFFFFFFFF)


cdef inline void rebind_request(Move m) except *:
    m.request_at = <void *><size_t>m.addressof(m.request)


cdef inline int call_direct(Move m, object send, object recv, object root, bint blocking) except -1:
    """The kind's one MPI call from send's memory into recv's (None: none; in place where the kind
    reduces into recv), blocking (without the GIL) or started, tested directly (the Round's
    tested_direct: its fast polls), then :meth:`Move.waited`. MPI's error code raised as mpi4py's exception."""
    cdef Py_buffer s, r
    cdef bint has_send = False, has_recv = False
    cdef const void *send_at = NULL
    cdef void *recv_at = NULL
    cdef Py_ssize_t send_len = 0, recv_len = 0
    cdef int code = 0, at = -1 if root is None else <int>root
    if send is not None:
        PyObject_GetBuffer(send, &s, PyBUF_C_CONTIGUOUS)
        has_send = True
    try:
        if recv is not None:
            PyObject_GetBuffer(recv, &r, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
            has_recv = True
        if has_send:
            send_at, send_len = s.buf, s.len
        if has_recv:
            recv_at, recv_len = r.buf, r.len
        code = start_call(m, send_at, send_len, recv_at, recv_len, at, blocking)
    finally:
        if has_recv:
            PyBuffer_Release(&r)
        if has_send:
            PyBuffer_Release(&s)
    if code != 0:
        raise m.exception(code)
    if not blocking and not tested_direct(m.mpi_test, m.request_at, m.polls, m.exception):
        m.waited()
    return 0


cdef inline int start_call(Move m, const void *send, Py_ssize_t send_len, void *recv, Py_ssize_t recv_len,
                           int root, bint blocking) except? -1:
    """The call of m's kind on the memory given (the MPI error code): blocking without the GIL, else
    its nonblocking form writing m's request."""
    cdef int kind = m.kind, code, count, k
    cdef intptr_t comm = m.comm_handle, byte = m.byte_handle, dtype = m.type_handle, op = m.op_handle
    cdef void *request = m.request_at
    cdef void *fn = m.call_blocking if blocking else m.call_start
    cdef const void *in_place = m.in_place_at
    if kind == ALL_REDUCE:
        count = <int>(recv_len // m.itemsize)
        if blocking:
            with nogil:
                code = (<allreduce_fn>fn)(in_place, recv, count, dtype, op, comm)
            return code
        return (<iallreduce_fn>fn)(in_place, recv, count, dtype, op, comm, request)
    if kind == BROADCAST:
        count = <int>recv_len
        if blocking:
            with nogil:
                code = (<bcast_fn>fn)(recv, count, byte, root, comm)
            return code
        return (<ibcast_fn>fn)(recv, count, byte, root, comm, request)
    if kind == REDUCE:
        if recv != NULL:  # (the root: in place)
            count = <int>(recv_len // m.itemsize)
            send = in_place
        else:
            count = <int>(send_len // m.itemsize)
        if blocking:
            with nogil:
                code = (<reduce_fn>fn)(send, recv, count, dtype, op, root, comm)
            return code
        return (<ireduce_fn>fn)(send, recv, count, dtype, op, root, comm, request)
    if kind == REDUCE_SCATTER:
        count = <int>(send_len // m.itemsize // m.size)
        for k in range(m.size):
            m.counts_at[k] = count
        if blocking:
            with nogil:
                code = (<reduce_scatter_fn>fn)(send, recv, m.counts_at, dtype, op, comm)
            return code
        return (<ireduce_scatter_fn>fn)(send, recv, m.counts_at, dtype, op, comm, request)
    if kind == STACKED or kind == ALL_TO_ALL:
        count = <int>(send_len if kind == STACKED else send_len // m.size)
        if blocking:
            with nogil:
                code = (<exchange_fn>fn)(send, count, byte, recv, count, byte, comm)
            return code
        return (<iexchange_fn>fn)(send, count, byte, recv, count, byte, comm, request)
    # GATHER and SCATTER: a rank's one block (gather's x, scatter's result), the root's of every rank
    count = <int>(send_len if kind == GATHER else recv_len)
    if blocking:
        with nogil:
            code = (<rooted_fn>fn)(send, count, byte, recv, count, byte, root, comm)
        return code
    return (<irooted_fn>fn)(send, count, byte, recv, count, byte, root, comm, request)
