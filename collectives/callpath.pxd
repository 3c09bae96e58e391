# The types of collectives/callpath.py's compiled form (collectives._callpath_c, setup.py's COMPILED):
# Cython reads this file beside the .py it compiles; the Python form never does. A field or local
# named here is one C read where the Python form reads an attribute.

cimport cython
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


# The recorder's clock (time.monotonic: CLOCK_MONOTONIC's seconds) read in C, without a call of
# the time module's; the compiled planned calls cimport it (backends/cupy_fast.pxd).
cdef inline double _clock() noexcept:
    cdef timespec now
    clock_gettime(CLOCK_MONOTONIC, &now)
    return <double>now.tv_sec + <double>now.tv_nsec * 1e-9


cdef class Plan:
    cdef readonly object check, fast, carry, adapter, dtype, reduce_op, request, method
    cdef readonly object name, root, row_check
    cdef readonly bint in_place, collective, any_root, counted
    cdef readonly int out_form


cdef class Collectives:
    cpdef _run(self, call, x, op, root, out, async_op, extra=*, timeout=*)


cdef class CallPath(Collectives):
    cdef readonly object comm, checks, call_check, context, pending, reap, keep, handles
    cdef readonly object check_call, carry_call, check_counts, raise_failed, p2p, stream_ordered, post_call
    cdef readonly object out_fits
    cdef readonly dict plans, twins
    cdef readonly list hooks
    cdef readonly Py_ssize_t size, running
    cdef readonly bint debug, posting, all_ordered
    cdef public object gate, ring, operation
    cdef public object kept, kept_call, kept_type, kept_dtype, kept_op
    cdef public bint checking

    @cython.locals(plan=Plan, in_place=bint, collective=bint, remembered=bint)
    cpdef _run(self, call, x, op, root, out, async_op, extra=*, timeout=*)
