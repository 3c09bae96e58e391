/* What backends/_carried.c (the carried calls), backends/_carried_round.c (the check's round),
 * backends/_carried_check.c (CallCheck.carry) and backends/_carried_uneven.c (the uneven calls)
 * share: the Round, which makes the round of an MPIChannel, the Carrier's call, and the bits of a
 * check word. */
#ifndef COLLECTIVES_CARRIED_H
#define COLLECTIVES_CARRIED_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The module's interface, as backends/mpi_carried.py expects it (COMPILED_VERSION there): a
 * build left from an older checkout is not used. */
#define CARRIED_VERSION 11

/* Bit 63 of a check word (collectives.wire.FAST_BIT): this rank's x travels in its block. */
#define CARRIED_BIT INT64_MIN  /* (not (int64_t)1 << 63: a shift into the sign bit is undefined) */
#define WORD_BITS (~CARRIED_BIT)

/* The round of one MPIChannel (see MPIChannel._round): the blocks it gathers and how it waits.
 * Two sizes of block (backends/mpi_round.py): the small one, and a large one that every rank
 * switches to together where the last rounds say every rank's call wanted it (round_run). */
typedef struct {
    PyObject_HEAD
    int size, rank, polls;
    char direct;                       /* whether its persistent request is started and tested directly */
    Py_ssize_t stride, offset, room;   /* the last round's: a block's bytes; where its payload starts;
                                          the payload's bytes (what the round's readers take) */
    Py_ssize_t strides[2], rooms[2];   /* of the small and the large block (0: no large one) */
    int geometry, read_geometry;       /* the next round's block (0 small, 1 large); the last round's */
    int streak;                        /* rounds in a row that asked to switch (see round_run) */
    int64_t want;                      /* what this rank says in the next round: 1 (its x wants the large block) */
    Py_buffer block, blocks;           /* this rank's block (written), every rank's (read) */
    PyObject *channel;                 /* the MPIChannel: _wait_saying, _wait, timeout, _everyone_fast */
    PyObject *state;                   /* the Python Round (backends/mpi_round.py): request, start(), the views */
    PyObject *payloads;                /* the channel's _payloads: every rank's payload, as numpy bytes */
    PyObject *request;                 /* the persistent request last started directly, and */
    void *handle;                      /* where mpi4py keeps its handle (see bind_mpi) */
    PyObject *staged;                  /* the same of the fast path's staged request last started */
    void *staged_handle;
} Round;

extern PyTypeObject RoundType;

/* The round with `word` in this rank's block: MPI_Start (or the channel's nonblocking start where
 * it keeps no persistent request), the fast polls, else the channel's _wait_saying(request,
 * waiting); *reduced: the AND of every rank's word; the channel's _everyone_fast set. -1 on an
 * error (raised), else 0. */
int round_run(Round *self, int64_t word, PyObject *waiting, int64_t *reduced);

/* A staged persistent request of the channel's fast paths (MPIChannel._staged) started and
 * completed: MPI_Start and the fast polls (directly where bound, else through mpi4py), then the
 * channel's _wait. -1 on an error (raised), else 0. */
int round_start_staged(Round *self, PyObject *request);

/* The row of int64 after rank `rank`'s word in its block (the uneven calls' counts). */
static inline const int64_t *
round_row(Round *self, int rank)
{
    return (const int64_t *)((const char *)self->blocks.buf + (Py_ssize_t)rank * self->stride) + 1;
}

/* The most int64 of a row round_agree takes. */
#define ROUND_ROW_MAX 64

/* MPIChannel._agree_counts's round: this rank's row `values` (n of them) after its word, and
 * view's bytes in its payload where view is not None and fits there (with view, bit 63 of the
 * word set: a larger one is marked alone, see MPIChannel._uneven_bytes); *reduced: the AND of
 * every rank's word (bit 63 included). 1 where the row does not fit the block or view is not
 * one C-contiguous buffer (nothing written: the Python body runs), -1 on an error (raised),
 * else 0. */
int round_agree(Round *self, int64_t word, const int64_t *values, Py_ssize_t n, PyObject *view,
                int64_t *reduced);

/* Where a block's want sits (after the word and the row): its last int64 before the payload. */
static inline Py_ssize_t
round_want_slot(Round *self)
{
    return self->offset / 8 - 1;
}

/* The next round's payload bytes: what its writers may fill. */
static inline Py_ssize_t
round_write_room(Round *self)
{
    return self->rooms[self->geometry];
}

/* The large block wanted by a call whose x has n bytes (set before round_run, which sends it). */
static inline void
round_wants(Round *self, Py_ssize_t n)
{
    self->want = n > self->rooms[0] && n <= self->rooms[1];
}

static inline const char *
round_payload(Round *self, int rank)
{
    return (const char *)self->blocks.buf + (Py_ssize_t)rank * self->stride + self->offset;
}

static inline char *
round_own_payload(Round *self)
{
    return (char *)self->block.buf + self->offset;
}

int round_types_ready(PyObject *module);

/* Round.rows_into's copy (backends/_carried_uneven.c): every rank's rows for `rank` (-1:
 * all_gather_v, counts every rank's rows; else the splits) out of the round's payloads, back to
 * back into got, rows of `row` bytes; 0, or -1 with an error. */
int payload_rows_into(Round *round, PyObject *counts, int rank, const Py_buffer *got, Py_ssize_t row);

/* A tensor's memory, by address, as a writable memoryview (its data_ptr() and nbytes;
 * backends/_carried.c). */
PyObject *tensor_memory(PyObject *tensor);

/* bind_mpi(MPI): MPI_Start and MPI_Test looked up in the process's global symbols first (a PMPI
 * tool's), else in the library of mpi4py's module MPI, for the round's direct calls; whether they
 * were found. */
PyObject *bind_mpi(PyObject *module, PyObject *MPI);

/* A type's tp_traverse and tp_clear (Type_traverse, Type_clear) from the list of its object
 * fields, FIELDS(X) calling X(field) for each: one list per type, so none is forgotten in one. */
#define GC_VISIT_FIELD(field) Py_VISIT(self->field);
#define GC_CLEAR_FIELD(field) Py_CLEAR(self->field);
#define GC_FIELDS(Type, FIELDS)                                                          \
    static int Type##_traverse(Type *self, visitproc visit, void *arg)                 \
    {                                                                                    \
        FIELDS(GC_VISIT_FIELD)                                                           \
        return 0;                                                                        \
    }                                                                                    \
    static int Type##_clear(Type *self)                                                  \
    {                                                                                    \
        FIELDS(GC_CLEAR_FIELD)                                                           \
        return 0;                                                                        \
    }

/* The carried call (backends/_carried.c): carrier(view, root, out, extra, word). */
extern PyTypeObject CarrierType;
PyObject *Carrier_vectorcall(PyObject *carrier, PyObject *const *args, size_t nargsf, PyObject *kwnames);

/* The check that carries (backends/_carried_check.c). */
int check_types_ready(PyObject *module);

/* send's and recv's fast paths (backends/_carried_p2p.c). */
int p2p_types_ready(PyObject *module);

/* The uneven collectives' method after their counts' round (backends/_carried_uneven.c). */
int uneven_types_ready(PyObject *module);

#endif
