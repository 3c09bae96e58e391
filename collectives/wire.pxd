# The types of collectives/wire.py's compiled form (collectives._wire_c, setup.py's COMPILED):
# Cython reads this file beside the .py it compiles; the Python form never does. The check word's
# two functions are C functions here, which the compiled checks cimport
# (`from collectives._wire_c cimport check_word, words_agree`: collectives/reliability.pxd) and
# call in C; from Python they are the same functions as wire.py's.

cimport cython
from libc.stdint cimport int64_t, uint64_t

cdef int64_t _LOW


@cython.locals(h=int64_t)
cpdef int64_t check_word(uint64_t call_hash, int64_t seq) noexcept

cpdef bint words_agree(int64_t reduced) noexcept
