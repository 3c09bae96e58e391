# The types of collectives/reliability.py's compiled form (collectives._reliability_c, setup.py's
# COMPILED): Cython reads this file beside the .py it compiles; the Python form never does. The
# checks that run on every call (CallCheck.check, carry, check_counts) are cpdef methods over typed
# fields, and call wire.py's check word in C (collectives._wire_c, cimported).

cimport cython
from libc.stdint cimport int64_t

from collectives._wire_c cimport check_word, words_agree

cdef int _CHECKS_DEFAULT


cdef class CallCheck:
    cdef readonly object _transport, _context, _comm
    cdef public int level
    cdef public bint first_checked, carries, posts
    cdef public dict hashes
    cdef public int64_t fast_bit
    cdef object _kept_call, _kept_dtype, _kept_op, _kept_root, _kept_shape, _kept_kind
    cdef dict _kinds
    cdef int64_t _kept_hash
    cdef Py_ssize_t _uneven_fixed

    @cython.locals(seq=int64_t, h=int64_t)
    cpdef check(self, call, reduce_op, root, dtype, shape, waiting=*, fast=*)

    @cython.locals(seq=int64_t, h=int64_t)
    cpdef carry(self, carry, call, reduce_op, root, dtype, view, out, extra, shape)

    @cython.locals(seq=int64_t, h=int64_t, gathered=bint, total=int64_t, size=Py_ssize_t, rank=Py_ssize_t,
                   outs=int64_t, limit=Py_ssize_t, row=list, rows=list, got=list)
    cpdef bint check_counts(self, r) except -1

    @cython.locals(hashes=dict, key=tuple)
    cdef int64_t _call_hash(self, call, reduce_op, root, dtype, shape) except? -1
