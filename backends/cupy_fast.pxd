# The types of backends/cupy_fast.py's compiled form (collectives.backends._cupy_fast_c, setup.py's
# COMPILED): Cython reads this file beside the .py it compiles; the Python form never does. The
# planned calls' fields are C reads; their methods are called from the call path without a frame.

cimport cython

from collectives._callpath_c cimport _clock


cdef class ArrayCheck:
    cdef readonly object adapter, check_array, check_device, tensor, strided
    cdef readonly bint cupy_arrays
    cdef readonly Py_ssize_t device

    cpdef check(self, x, bint in_place)


cdef class PlannedCall:
    cdef readonly object transport, launch, library, open_groups, fallback, current_stream, context, inflight
    cdef readonly object operation, comm
    cdef readonly list free
    cdef readonly Py_ssize_t nccl_type, width, nccl_op
    cdef readonly bint rooted, cupy_arrays

    cpdef fast(self, x, root, out, extra)
    cpdef method(self, r)
    cpdef enqueue(self, x, root)
    cdef open_watch(self)


cpdef watch_post(inflight, list free, library, stream, operation, seq, double seconds)

@cython.locals(entry=list)
cpdef list watch_entry(inflight, list free, library, event, operation, seq, double seconds)

@cython.locals(pool=list)
cdef pooled_event(library, stream)
