# The types of backends/mpi_p2p.py's compiled form (collectives.backends._p2p_c, setup.py's
# COMPILED): Cython reads this file beside the .py it compiles; the Python form never does.

cimport cython


cdef class PointToPoint:
    cdef readonly bint receives
    cdef readonly Py_ssize_t most
    cdef readonly int polls
    cdef readonly object channel, blocking, start, byte, status, dtype

    @cython.locals(nbytes=Py_ssize_t, got=Py_ssize_t, done=bint)
    cpdef run(self, buf, peer, out, tag)
