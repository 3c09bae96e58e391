/* The uneven collectives' method after their counts' round, compiled: Uneven(...)(r) is
 * MPITransport._all_gather_v or _all_to_all_v (whose Python bodies are the reference and run
 * where this was not built or COLLECTIVES_COMPILED=0). Where r.carried says every rank's x went
 * with the counts (mpi_carried.carried_uneven): the result from the round's payloads, or, where
 * not every rank's x is in them, through the staged request of padded blocks
 * (mpi_staged.staged_uneven). Else the v-collective on x's and the result's memory, as
 * MPITransport._move_bytes makes it (MPI_Allgatherv or MPI_Alltoallv through mpi4py: blocking
 * with no timeout, else nonblocking, its fast polls, then the channel's _wait). An asynchronous
 * call, arrays other than contiguous numpy arrays or CPU tensors, or more than 2**31-1 bytes a
 * message run the Python method it was made with. */
#include "_carried.h"

#include <stddef.h>
#include <string.h>

static PyObject *s_x, *s_extra, *s_out, *s_carried, *s_async_op, *s_adapter, *s_numpy, *s_view, *s_timeout,
    *s_Test, *s_wait;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int gathered;             /* all_gather_v (else the uneven all_to_all) */
    Py_ssize_t least_block;   /* mpi_staged.LEAST_BLOCK */
    PyObject *round, *fallback, *numpy_adapter, *torch_adapter, *new_numpy, *new_tensor, *stage_of;
    PyObject *tables, *kind;  /* the channel's _staged_tables, and the key of stage_of's table there */
    PyObject *blocking, *nonblocking, *byte;  /* comm.Allgatherv and comm.Iallgatherv (or Alltoallv), MPI.BYTE */
} Uneven;

#define UNEVEN_FIELDS(X) X(round) X(fallback) X(numpy_adapter) X(torch_adapter) X(new_numpy) X(new_tensor) \
    X(stage_of) X(tables) X(kind) X(blocking) X(nonblocking) X(byte)
GC_FIELDS(Uneven, UNEVEN_FIELDS)

static void
Uneven_dealloc(Uneven *self)
{
    PyObject_GC_UnTrack(self);
    Uneven_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* mpi_staged.uneven_block: the block of a staged request for `need` bytes. */
static Py_ssize_t
uneven_block(Py_ssize_t need, Py_ssize_t least)
{
    if (need <= least) return least;
    int bits = 0;
    for (Py_ssize_t v = need - 1; v != 0; v >>= 1) bits++;
    Py_ssize_t step = (Py_ssize_t)1 << (bits > 3 ? bits - 3 : 0);
    return (need + step - 1) / step * step;
}

/* stage_of(block): the staged request of blocks of `block` bytes and its staging array, a new
 * reference; looked up here in its table where it is made (mpi_staged.uneven_stage's lookup, without
 * the Python call: about 0.3 us), else stage_of makes it (collective) or says None. */
static PyObject *
stage_entry(Uneven *self, Py_ssize_t block)
{
    PyObject *b = PyLong_FromSsize_t(block), *entry = NULL;
    if (b == NULL) return NULL;
    PyObject *table = PyDict_GetItemWithError(self->tables, self->kind);
    if (table != NULL && PyDict_CheckExact(table)) entry = PyDict_GetItemWithError(table, b);
    if (entry != NULL) Py_INCREF(entry);
    else if (!PyErr_Occurred()) entry = PyObject_CallOneArg(self->stage_of, b);
    Py_DECREF(b);
    return entry;
}

/* The item `i` of list `list` as a Py_ssize_t of at least 0, -1 on an error (raised). */
static Py_ssize_t
count_at(PyObject *list, Py_ssize_t i)
{
    if (!PyList_Check(list) || i >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_ValueError, "counts must be a list of an int per rank");
        return -1;
    }
    Py_ssize_t n = PyLong_AsSsize_t(PyList_GET_ITEM(list, i));
    if (n < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a count is negative");
    return n < 0 ? -1 : n;
}

/* The counts the round agreed on, read once: per rank k, the rows it sends in all (sent[k]),
 * the rows this rank gets from it (got[k]) and the rows before those in its x (skip[k]); the
 * most rows of a block (a rank's x, or a pair's share). 0, or -1 on an error (raised). */
typedef struct {
    Py_ssize_t sent[ROUND_ROW_MAX], got[ROUND_ROW_MAX], skip[ROUND_ROW_MAX], mine[ROUND_ROW_MAX];
    Py_ssize_t most_sent, most_block, total;
} Counts;

static int
read_counts(Counts *c, PyObject *counts, int gathered, int size, int rank)
{
    if (size > ROUND_ROW_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many ranks");
        return -1;
    }
    c->most_sent = c->most_block = c->total = 0;
    for (int k = 0; k < size; k++) {
        if (gathered) {
            Py_ssize_t n = count_at(counts, k);
            if (n < 0) return -1;
            c->sent[k] = c->got[k] = n;
            c->skip[k] = 0;
            if (n > c->most_block) c->most_block = n;
        } else {
            PyObject *splits = PyList_Check(counts) && k < PyList_GET_SIZE(counts) ? PyList_GET_ITEM(counts, k) : NULL;
            if (splits == NULL) {
                PyErr_SetString(PyExc_ValueError, "splits must be a list per rank");
                return -1;
            }
            Py_ssize_t all = 0;
            for (int j = 0; j < size; j++) {
                Py_ssize_t n = count_at(splits, j);
                if (n < 0) return -1;
                if (j == rank) {
                    c->got[k] = n;
                    c->skip[k] = all;
                }
                if (k == rank) c->mine[j] = n;
                if (n > c->most_block) c->most_block = n;
                all += n;
            }
            c->sent[k] = all;
        }
        if (c->sent[k] > c->most_sent) c->most_sent = c->sent[k];
        c->total += c->got[k];
    }
    return 0;
}

/* x's rows into the staging array's blocks, the request run, every rank's rows for this one out
 * of the blocks it got, into got (mpi_staged.staged_uneven's body). 0, or -1 on an error. */
static int
run_staged(Uneven *self, const Counts *c, PyObject *entry, Py_ssize_t block, const Py_buffer *x,
           const Py_buffer *got, Py_ssize_t row)
{
    Round *round = (Round *)self->round;
    const int size = round->size;
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
        PyErr_SetString(PyExc_TypeError, "a staged request is a (request, stage) pair");
        return -1;
    }
    Py_buffer stage;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(entry, 1), &stage, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    Py_ssize_t sends = self->gathered ? block : (Py_ssize_t)size * block, at = 0;
    char *staged = stage.buf;
    int fits = sends + (Py_ssize_t)size * block <= stage.len;
    if (self->gathered) {
        fits = fits && x->len <= block;
        if (fits) memcpy(staged, x->buf, x->len);
    } else {
        for (int j = 0; j < size && fits; j++) {
            Py_ssize_t n = c->mine[j] * row;
            fits = n <= block && at + n <= x->len;
            if (fits) memcpy(staged + (Py_ssize_t)j * block, (const char *)x->buf + at, n);
            at += n;
        }
    }
    if (!fits) {
        PyBuffer_Release(&stage);
        PyErr_SetString(PyExc_ValueError, "the rows are past a block or x");
        return -1;
    }
    if (round_start_staged(round, PyTuple_GET_ITEM(entry, 0)) < 0) {
        PyBuffer_Release(&stage);
        return -1;
    }
    at = 0;
    for (int k = 0; k < size; k++) {
        Py_ssize_t n = c->got[k] * row;
        memcpy((char *)got->buf + at, staged + sends + (Py_ssize_t)k * block, n);
        at += n;
    }
    PyBuffer_Release(&stage);
    return 0;
}

/* Every rank's rows for this one out of the round's payloads, into got: 0, or -1 with an error. */
static int
rows_from_payloads(Round *round, const Counts *c, const Py_buffer *got, Py_ssize_t row)
{
    Py_ssize_t at = 0;
    for (int k = 0; k < round->size; k++) {
        Py_ssize_t n = c->got[k] * row;
        if (c->skip[k] * row + n > round->room || at + n > got->len) {
            PyErr_SetString(PyExc_ValueError, "the rows are past the payload or the result");
            return -1;
        }
        memcpy((char *)got->buf + at, round_payload(round, k) + c->skip[k] * row, n);
        at += n;
    }
    return 0;
}

int
payload_rows_into(Round *round, PyObject *counts, int rank, const Py_buffer *got, Py_ssize_t row)
{
    Counts c;
    if (read_counts(&c, counts, rank < 0, round->size, rank) < 0) return -1;
    return rows_from_payloads(round, &c, got, row);
}

/* A list of the bytes of `rows` (n of them), rows of `row` bytes: an MPI count each (a list: mpi4py
 * reads a tuple of two as counts and displacements). NULL with an error, or (no error) where one
 * is past a C int (the Python method says so). */
static PyObject *
byte_counts(const Py_ssize_t *rows, int n, Py_ssize_t row)
{
    PyObject *sizes = PyList_New(n);
    for (int k = 0; sizes != NULL && k < n; k++) {
        if (rows[k] * row > INT32_MAX) {
            Py_DECREF(sizes);
            return NULL;
        }
        PyObject *size = PyLong_FromSsize_t(rows[k] * row);
        if (size == NULL) Py_CLEAR(sizes);
        else PyList_SET_ITEM(sizes, k, size);
    }
    return sizes;
}

/* The v-collective of x's bytes into got's (MPITransport._move_bytes): 1 done, 0 not taken
 * (nothing moved: a message past a C int), -1 on an error (raised). */
static int
run_plain(Uneven *self, const Counts *c, PyObject *view, PyObject *got, Py_ssize_t row)
{
    Round *round = (Round *)self->round;
    PyObject *sent = NULL, *gets = NULL, *send = NULL, *recv = NULL, *timeout = NULL, *request = NULL, *r;
    int done = -1;
    if ((gets = byte_counts(c->got, round->size, row)) == NULL ||
        (!self->gathered && (sent = byte_counts(c->mine, round->size, row)) == NULL)) {
        done = PyErr_Occurred() ? -1 : 0;
        goto finished;
    }
    if (!self->gathered && c->sent[round->rank] * row > INT32_MAX) {
        done = 0;
        goto finished;
    }
    send = self->gathered ? PyList_New(2) : PyList_New(3);
    recv = PyList_New(3);
    if (send == NULL || recv == NULL) goto finished;
    PyList_SET_ITEM(send, 0, Py_NewRef(view));
    if (self->gathered) {
        PyList_SET_ITEM(send, 1, Py_NewRef(self->byte));
    } else {
        PyList_SET_ITEM(send, 1, Py_NewRef(sent));
        PyList_SET_ITEM(send, 2, Py_NewRef(self->byte));
    }
    PyList_SET_ITEM(recv, 0, Py_NewRef(got));
    PyList_SET_ITEM(recv, 1, Py_NewRef(gets));
    PyList_SET_ITEM(recv, 2, Py_NewRef(self->byte));
    if ((timeout = PyObject_GetAttr(round->channel, s_timeout)) == NULL) goto finished;
    PyObject *a[2] = {send, recv};
    if (timeout == Py_None) {
        if ((r = PyObject_Vectorcall(self->blocking, a, 2, NULL)) == NULL) goto finished;
        Py_DECREF(r);
        done = 1;
        goto finished;
    }
    if ((request = PyObject_Vectorcall(self->nonblocking, a, 2, NULL)) == NULL) goto finished;
    int complete = 0;
    for (int i = 0; i < round->polls && !complete; i++) {
        if ((r = PyObject_CallMethodNoArgs(request, s_Test)) == NULL) goto finished;
        complete = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (complete < 0) goto finished;
    }
    if (!complete) {
        if ((r = PyObject_CallMethodOneArg(round->channel, s_wait, request)) == NULL) goto finished;
        Py_DECREF(r);
    }
    done = 1;
finished:
    Py_XDECREF(sent);
    Py_XDECREF(gets);
    Py_XDECREF(send);
    Py_XDECREF(recv);
    Py_XDECREF(timeout);
    Py_XDECREF(request);
    return done;
}

/* uneven(r) -> the method's result */
static PyObject *
Uneven_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Uneven *self = (Uneven *)op;
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the method is gone");
        return NULL;
    }
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *r = args[0], *carried = NULL, *async_op = NULL, *adapter = NULL, *x = NULL, *counts = NULL,
             *out = NULL, *view = NULL, *shape = NULL, *made = NULL, *entry = NULL, *result = NULL, *new;
    Py_buffer xb = {0}, gotb = {0};
    Round *round = (Round *)self->round;
    const int size = round->size;
    Counts c;
    if ((carried = PyObject_GetAttr(r, s_carried)) == NULL || (async_op = PyObject_GetAttr(r, s_async_op)) == NULL ||
        (adapter = PyObject_GetAttr(r, s_adapter)) == NULL)
        goto finished;
    if (async_op != Py_False) goto fallback;
    if (adapter == self->numpy_adapter) {
        new = self->new_numpy;
    } else if (adapter == self->torch_adapter) {
        new = self->new_tensor;
    } else {
        goto fallback;
    }
    if ((x = PyObject_GetAttr(r, s_x)) == NULL || (counts = PyObject_GetAttr(r, s_extra)) == NULL ||
        (out = PyObject_GetAttr(r, s_out)) == NULL)
        goto finished;
    if ((view = PyObject_GetAttr(r, s_view)) == NULL) goto finished;  /* (the call path's host view) */
    if (view == Py_None) {
        Py_SETREF(view, new == self->new_numpy ? Py_NewRef(x) : PyObject_CallMethodNoArgs(x, s_numpy));
    }
    if (view == NULL || PyObject_GetBuffer(view, &xb, PyBUF_C_CONTIGUOUS) < 0) {
        if (carried != Py_None) goto finished;  /* (it marked the round: a C-contiguous host view) */
        PyErr_Clear();  /* (not one contiguous host buffer: the Python method) */
        goto fallback;
    }
    if (xb.ndim < 1) {
        PyErr_SetString(PyExc_ValueError, "an uneven call's x has rows");
        goto finished;
    }
    Py_ssize_t row = xb.itemsize;
    for (int d = 1; d < xb.ndim; d++) row *= xb.shape[d];
    if (read_counts(&c, counts, self->gathered, size, round->rank) < 0) goto finished;
    /* carried: the rows from the payloads; staged: a staged request; else the v-collective */
    int staged = carried != Py_None && c.most_sent * row > round->room, plain = carried == Py_None;
    Py_ssize_t block = 0;
    if (staged) {  /* the staged request of its block: found, or made now (collective), or none */
        block = uneven_block(c.most_block * row, self->least_block);
        if ((entry = stage_entry(self, block)) == NULL) goto finished;
        if (entry == Py_None) staged = 0, plain = 1;
    }
    if ((shape = PyTuple_New(xb.ndim)) == NULL) goto finished;
    for (int d = 0; d < xb.ndim; d++) {
        PyObject *n = PyLong_FromSsize_t(d == 0 ? c.total : xb.shape[d]);
        if (n == NULL) goto finished;
        PyTuple_SET_ITEM(shape, d, n);
    }
    if (new == self->new_tensor && out != Py_None) {  /* a tensor out= (checked: CPU, contiguous, writable) by address */
        PyObject *memory = tensor_memory(out);
        made = memory ? Py_BuildValue("(ON)", out, memory) : NULL;
    } else {
        PyObject *a[3] = {view, shape, out};
        made = PyObject_Vectorcall(new, a, 3, NULL);
    }
    if (made == NULL) goto finished;
    if (!PyTuple_Check(made) || PyTuple_GET_SIZE(made) != 2) {
        PyErr_SetString(PyExc_TypeError, "new_result gives (result, its numpy view)");
        goto finished;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(made, 1), &gotb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto finished;
    if (gotb.len < c.total * row) {
        PyErr_SetString(PyExc_ValueError, "the result is smaller than the rows");
        goto finished;
    }
    if (plain) {
        PyBuffer_Release(&gotb);  /* (mpi4py takes its own) */
        int moved = run_plain(self, &c, view, PyTuple_GET_ITEM(made, 1), row);
        if (moved < 0) goto finished;
        if (moved == 0) goto fallback;
    } else if (staged) {
        if (run_staged(self, &c, entry, block, &xb, &gotb, row) < 0) goto finished;
    } else if (rows_from_payloads(round, &c, &gotb, row) < 0) {
        goto finished;
    }
    PyObject *got = PyTuple_GET_ITEM(made, 0);
    result = self->gathered ? PyTuple_Pack(2, got, counts) : Py_NewRef(got);
    goto finished;
fallback:
    result = PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
finished:
    if (xb.obj) PyBuffer_Release(&xb);
    if (gotb.obj) PyBuffer_Release(&gotb);
    Py_XDECREF(carried);
    Py_XDECREF(async_op);
    Py_XDECREF(adapter);
    Py_XDECREF(x);
    Py_XDECREF(counts);
    Py_XDECREF(out);
    Py_XDECREF(view);
    Py_XDECREF(shape);
    Py_XDECREF(made);
    Py_XDECREF(entry);
    return result;
}

static PyObject *
Uneven_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"round", "fallback", "gathered", "numpy_adapter", "torch_adapter", "new_numpy",
                            "new_tensor", "stage_of", "tables", "kind", "least_block", "blocking", "nonblocking",
                            "byte", NULL};
    PyObject *round, *fallback, *numpy_adapter, *torch_adapter, *new_numpy, *new_tensor, *stage_of, *tables, *kind,
             *blocking, *nonblocking, *byte;
    int gathered;
    Py_ssize_t least_block;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OpOOOOOO!OnOOO", names, &RoundType, &round, &fallback, &gathered,
                                     &numpy_adapter, &torch_adapter, &new_numpy, &new_tensor, &stage_of,
                                     &PyDict_Type, &tables, &kind, &least_block, &blocking, &nonblocking, &byte))
        return NULL;
    if (least_block < 1) {
        PyErr_SetString(PyExc_ValueError, "least_block must be positive");
        return NULL;
    }
    Uneven *self = (Uneven *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = Uneven_call;
    self->gathered = gathered;
    self->least_block = least_block;
    self->round = Py_NewRef(round);
    self->fallback = Py_NewRef(fallback);
    self->numpy_adapter = Py_NewRef(numpy_adapter);
    self->torch_adapter = Py_NewRef(torch_adapter);
    self->new_numpy = Py_NewRef(new_numpy);
    self->new_tensor = Py_NewRef(new_tensor);
    self->stage_of = Py_NewRef(stage_of);
    self->tables = Py_NewRef(tables);
    self->kind = Py_NewRef(kind);
    self->blocking = Py_NewRef(blocking);
    self->nonblocking = Py_NewRef(nonblocking);
    self->byte = Py_NewRef(byte);
    return (PyObject *)self;
}

static PyTypeObject UnevenType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.backends._carried.Uneven",
    .tp_doc = PyDoc_STR("Uneven(round, fallback, gathered, numpy_adapter, torch_adapter, new_numpy, new_tensor, "
                        "stage_of, tables, kind, least_block, blocking, nonblocking, byte): uneven(r) -> "
                        "MPITransport._all_gather_v or _all_to_all_v, compiled"),
    .tp_basicsize = sizeof(Uneven),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Uneven, vectorcall),
    .tp_new = Uneven_new,
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)Uneven_dealloc,
    .tp_traverse = (traverseproc)Uneven_traverse,
    .tp_clear = (inquiry)Uneven_clear,
};

int
uneven_types_ready(PyObject *module)
{
    if ((s_x = PyUnicode_InternFromString("x")) == NULL || (s_extra = PyUnicode_InternFromString("extra")) == NULL ||
        (s_out = PyUnicode_InternFromString("out")) == NULL ||
        (s_carried = PyUnicode_InternFromString("carried")) == NULL ||
        (s_async_op = PyUnicode_InternFromString("async_op")) == NULL ||
        (s_adapter = PyUnicode_InternFromString("adapter")) == NULL ||
        (s_numpy = PyUnicode_InternFromString("numpy")) == NULL || (s_view = PyUnicode_InternFromString("view")) == NULL ||
        (s_timeout = PyUnicode_InternFromString("timeout")) == NULL ||
        (s_Test = PyUnicode_InternFromString("Test")) == NULL || (s_wait = PyUnicode_InternFromString("_wait")) == NULL)
        return -1;
    if (PyType_Ready(&UnevenType) < 0) return -1;
    Py_INCREF(&UnevenType);
    if (PyModule_AddObject(module, "Uneven", (PyObject *)&UnevenType) < 0) {
        Py_DECREF(&UnevenType);
        return -1;
    }
    return 0;
}
