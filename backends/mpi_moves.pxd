# The types of backends/mpi_moves.py's compiled form (collectives.backends._moves_c, setup.py's
# COMPILED): Cython reads this file beside the .py it compiles; the Python form never does.

cimport cython

# The kinds of Move (mpi_moves.py's, there as Python ints): C ints here, compared in C.
cdef int ALL_REDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, STACKED, ALL_TO_ALL, GATHER, SCATTER


cdef class Move:
    cdef public object staged
    cdef readonly int kind, rank, polls
    cdef readonly Py_ssize_t most, size
    cdef readonly bint numpy, avg
    cdef readonly object channel, blocking, start, new, spec, op, byte, in_place

    @cython.locals(kind=int, nbytes=Py_ssize_t, block=Py_ssize_t)
    cpdef run(self, buf, root, out, extra)
    cpdef tuple result_shape(self, tuple shape)
    cdef complete(self, tuple args)
