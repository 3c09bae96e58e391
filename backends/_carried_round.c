/* The default check's round of an MPIChannel, compiled (see backends/_carried.h): MPIChannel._round
 * and MPIChannel._agree_counts, whose Python bodies are the reference and run where this was
 * not built or COLLECTIVES_COMPILED=0. */
#include "_carried.h"

#include <dlfcn.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>

static PyObject *s_request, *s_start, *s_Start, *s_Test, *s_wait_saying, *s_everyone_fast, *s_wait,
    *s_read_geometry, *s_write_geometry;

/* MPI_Start and MPI_Test as the process resolves them (see bind_mpi), called on a persistent
 * request's handle where mpi4py keeps it: the round's start and fast polls without mpi4py's
 * Python-level calls (0.5 us a round). NULL where not bound: mpi4py's Start and Test. */
typedef int (*mpi_start_fn)(void *request);
typedef int (*mpi_test_fn)(void *request, int *flag, void *status);
static mpi_start_fn mpi_start;
static mpi_test_fn mpi_test;
static PyObject *mpi_exception, *mpi_addressof;  /* MPI.Exception and MPI._addressof */

/* The process's global MPI_Start and MPI_Test first: a PMPI tool (mpiP, Score-P, Darshan, MUST)
 * preloaded with LD_PRELOAD defines them and sees the round's calls as it sees mpi4py's. Where
 * libmpi is not global (mpi4py's module loads it RTLD_LOCAL), those of the library mpi4py's module
 * loaded (it links libmpi). 0 where neither is found (mpi4py's Start and Test then). */
static int
find_mpi(PyObject *MPI, mpi_start_fn *start, mpi_test_fn *test)
{
    *start = (mpi_start_fn)dlsym(RTLD_DEFAULT, "MPI_Start");
    *test = (mpi_test_fn)dlsym(RTLD_DEFAULT, "MPI_Test");
    if (*start != NULL && *test != NULL) return 1;
    PyObject *file = PyObject_GetAttrString(MPI, "__file__");
    if (file == NULL) {  /* (a module without a file: mpi4py's calls) */
        PyErr_Clear();
        return 0;
    }
    const char *path = PyUnicode_AsUTF8(file);
    void *library = path ? dlopen(path, RTLD_NOLOAD | RTLD_LAZY) : NULL;  /* (mpi4py loaded it) */
    Py_DECREF(file);
    PyErr_Clear();
    if (library == NULL) return 0;
    *start = (mpi_start_fn)dlsym(library, "MPI_Start");  /* (in libmpi, which it links) */
    *test = (mpi_test_fn)dlsym(library, "MPI_Test");
    dlclose(library);  /* (a reference more of a library that stays loaded with mpi4py) */
    return *start != NULL && *test != NULL;
}

PyObject *
bind_mpi(PyObject *module, PyObject *MPI)
{
    if (mpi_start != NULL) Py_RETURN_TRUE;
    mpi_start_fn start;
    mpi_test_fn test;
    if (!find_mpi(MPI, &start, &test)) Py_RETURN_FALSE;
    PyObject *exception = PyObject_GetAttrString(MPI, "Exception");
    PyObject *addressof = exception ? PyObject_GetAttrString(MPI, "_addressof") : NULL;
    if (addressof == NULL) {
        Py_XDECREF(exception);
        return NULL;
    }
    mpi_exception = exception;
    mpi_addressof = addressof;
    mpi_start = start;
    mpi_test = test;
    Py_RETURN_TRUE;
}

/* A direct MPI_Test is about 4 times cheaper than mpi4py's: as many more, for the same spin. */
#define DIRECT_POLLS_PER_POLL 4
/* Room for an MPI_Status of any library (20 bytes in MPICH and Intel MPI, 24 in Open MPI). */
#define STATUS_ROOM 256

/* mpi4py's MPI.Exception for an MPI error code, raised; -1. */
static int
raise_mpi(int code)
{
    PyObject *error = PyObject_CallFunction(mpi_exception, "i", code);
    if (error != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(error), error);
        Py_DECREF(error);
    }
    return -1;
}

/* The address of `request`'s handle (MPI._addressof), kept with the request it is of in *kept
 * and *handle. */
static void *
handle_of(PyObject **kept, void **handle, PyObject *request)
{
    if (request != *kept) {
        PyObject *address = PyObject_CallOneArg(mpi_addressof, request);
        if (address == NULL) return NULL;
        void *at = PyLong_AsVoidPtr(address);
        Py_DECREF(address);
        if (at == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a request without a handle");
            return NULL;
        }
        Py_XSETREF(*kept, Py_NewRef(request));
        *handle = at;
    }
    return *handle;
}

/* A persistent request (the round's, or a staged one of the fast paths) started and tested
 * directly: 1 where it completed within the fast polls, 0 where not (the channel's wait goes on),
 * -1 on an error (raised). */
static int
start_direct(Round *self, PyObject *request, int staged)
{
    void *handle = staged ? handle_of(&self->staged, &self->staged_handle, request)
                          : handle_of(&self->request, &self->handle, request);
    if (handle == NULL) return -1;
    int code = mpi_start(handle), flag = 0;
    if (code != 0) return raise_mpi(code);
    _Alignas(16) char status[STATUS_ROOM];
    for (int i = 0; i < self->polls * DIRECT_POLLS_PER_POLL && !flag; i++)
        if ((code = mpi_test(handle, &flag, status)) != 0) return raise_mpi(code);
    return flag;
}

/* The round about to run on the block the last one chose (self->geometry): its readers take the
 * blocks at its stride, its payloads (the Python Round's read_geometry(g) sets its views). */
static int
round_read(Round *self)
{
    PyObject *g = PyLong_FromLong(self->geometry);
    PyObject *payloads = g ? PyObject_CallMethodOneArg(self->state, s_read_geometry, g) : NULL;
    Py_XDECREF(g);
    if (payloads == NULL) return -1;
    Py_SETREF(self->payloads, payloads);
    self->stride = self->strides[self->geometry];
    self->room = self->rooms[self->geometry];
    self->read_geometry = self->geometry;
    return 0;
}

/* Rounds in a row whose every block wanted the large one (or, on it, did not) before every rank
 * switches: a loop that alternates small and larger calls stays on the small block. */
#define ROUND_STREAK 2

/* After a round: every rank's want, read from the blocks every rank holds alike, so every rank
 * counts the same streak and switches at the same round (the next round's request and what its
 * writers may fill; the Python Round's write_geometry(g) sets its own). */
static int
round_settle(Round *self)
{
    int all = 1;
    const Py_ssize_t at = round_want_slot(self) * 8;
    for (int k = 0; k < self->size; k++) {
        int64_t want;
        memcpy(&want, (const char *)self->blocks.buf + (Py_ssize_t)k * self->stride + at, sizeof want);
        all &= want == 1;
    }
    self->streak = (self->geometry ? !all : all) ? self->streak + 1 : 0;
    if (self->streak < ROUND_STREAK) return 0;
    self->geometry ^= 1;
    self->streak = 0;
    PyObject *g = PyLong_FromLong(self->geometry);
    PyObject *r = g ? PyObject_CallMethodOneArg(self->state, s_write_geometry, g) : NULL;
    Py_XDECREF(g);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

int
round_run(Round *self, int64_t word, PyObject *waiting, int64_t *reduced)
{
    if (self->channel == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the round's channel is gone");
        return -1;
    }
    if (self->read_geometry != self->geometry && round_read(self) < 0) return -1;
    ((int64_t *)self->block.buf)[0] = word;
    ((int64_t *)self->block.buf)[round_want_slot(self)] = self->want;
    self->want = 0;
    PyObject *request = PyObject_GetAttr(self->state, s_request), *r;
    if (request == NULL) return -1;
    int done = 0, direct = request != Py_None && self->direct && mpi_start != NULL;
    if (direct) {  /* (its fast polls made: the channel's wait, if it is not complete) */
        if ((done = start_direct(self, request, 0)) < 0) goto failed;
        r = Py_NewRef(Py_None);
    } else if (request != Py_None) {
        r = PyObject_CallMethodNoArgs(request, s_Start);
    } else {  /* no persistent request (MPI < 4, or a library whose persistent all_gather fails) */
        Py_DECREF(request);
        request = PyObject_CallMethodNoArgs(self->state, s_start);  /* (the Python Round's start) */
        if (request == NULL) return -1;
        r = Py_None;
        Py_INCREF(r);
    }
    if (r == NULL) goto failed;
    Py_DECREF(r);
    if (!direct) {
        PyObject *test = PyObject_GetAttr(request, s_Test);
        if (test == NULL) goto failed;
        for (int i = 0; i < self->polls && !done; i++) {
            r = PyObject_CallNoArgs(test);
            done = r == NULL ? -1 : PyObject_IsTrue(r);
            Py_XDECREF(r);
            if (done < 0) {
                Py_DECREF(test);
                goto failed;
            }
        }
        Py_DECREF(test);
    }
    if (!done) {
        r = PyObject_CallMethodObjArgs(self->channel, s_wait_saying, request, waiting, NULL);
        if (r == NULL) goto failed;
        Py_DECREF(r);
    }
    Py_DECREF(request);
    int64_t and = -1;
    for (int k = 0; k < self->size; k++) {
        int64_t each;
        memcpy(&each, (const char *)self->blocks.buf + (Py_ssize_t)k * self->stride, sizeof each);
        and &= each;
    }
    *reduced = and;
    if (self->rooms[1] > 0 && round_settle(self) < 0) return -1;
    return PyObject_SetAttr(self->channel, s_everyone_fast, and < 0 ? Py_True : Py_False);
failed:
    Py_DECREF(request);
    return -1;
}

/* (A channel holds its Round and the Round its channel: a cycle the collector breaks.) */
#define ROUND_FIELDS(X) X(channel) X(state) X(payloads) X(request) X(staged)
GC_FIELDS(Round, ROUND_FIELDS)

static void
Round_dealloc(Round *self)
{
    PyObject_GC_UnTrack(self);
    if (self->block.obj) PyBuffer_Release(&self->block);
    if (self->blocks.obj) PyBuffer_Release(&self->blocks);
    Round_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Round_init(Round *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"channel", "block", "blocks", "payloads", "offset", "polls", "small", "state", NULL};
    PyObject *channel, *block, *blocks, *payloads, *state = NULL;
    Py_ssize_t offset, small = 0;
    int polls;
    if (self->channel != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Round is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOni|nO", names, &channel, &block, &blocks, &payloads,
                                     &offset, &polls, &small, &state))
        return -1;
    if (state == NULL) {
        PyErr_SetString(PyExc_TypeError, "Round needs state, the Python Round it runs");
        return -1;
    }
    if (PyObject_GetBuffer(block, &self->block, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (PyObject_GetBuffer(blocks, &self->blocks, PyBUF_C_CONTIGUOUS) < 0) return -1;
    PyObject *v = PyObject_GetAttrString(channel, "size");
    self->size = v ? (int)PyLong_AsLong(v) : -1;
    Py_XDECREF(v);
    v = PyObject_GetAttrString(channel, "rank");
    self->rank = v ? (int)PyLong_AsLong(v) : -1;
    Py_XDECREF(v);
    if (PyErr_Occurred()) return -1;
    if (self->size < 1 || self->blocks.len != self->block.len * self->size || offset < 16 || offset % 8 ||
        offset > self->block.len || polls < 1 || (small && (small < offset || small >= self->block.len))) {
        PyErr_SetString(PyExc_ValueError, "blocks must hold size blocks of block's bytes, its payload inside one "
                        "(small: the small block's bytes, 0 or from offset to less than block's)");
        return -1;
    }
    self->strides[0] = small ? small : self->block.len;
    self->strides[1] = small ? self->block.len : 0;
    self->rooms[0] = self->strides[0] - offset;
    self->rooms[1] = small ? self->strides[1] - offset : 0;
    self->stride = self->strides[0];
    self->offset = offset;
    self->room = self->rooms[0];
    self->polls = polls;
    self->direct = mpi_start != NULL;
    Py_INCREF(channel);
    self->channel = channel;
    self->state = Py_NewRef(state);
    Py_INCREF(payloads);
    self->payloads = payloads;
    return 0;
}

/* round(word, waiting=None) -> the AND of every rank's word (MPIChannel._round). */
static PyObject *
Round_call(Round *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"word", "waiting", NULL};
    long long word;
    PyObject *waiting = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|O", names, &word, &waiting)) return NULL;
    int64_t reduced;
    if (round_run(self, (int64_t)word, waiting, &reduced) < 0) return NULL;
    return PyLong_FromLongLong(reduced);
}

int
round_agree(Round *self, int64_t word, const int64_t *values, Py_ssize_t n, PyObject *view, int64_t *reduced)
{
    if (2 + n > self->offset / 8) return 1;  /* (the word, the row, the want) */
    if (view != Py_None) {
        Py_buffer x;
        if (PyObject_GetBuffer(view, &x, PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            return 1;
        }
        if (x.len <= round_write_room(self))  /* (past the payload: marked alone, MPIChannel._uneven_bytes) */
            memcpy(round_own_payload(self), x.buf, x.len);
        PyBuffer_Release(&x);
        word |= CARRIED_BIT;
    }
    memcpy((int64_t *)self->block.buf + 1, values, n * sizeof(int64_t));
    return round_run(self, word, Py_None, reduced);
}

/* agree_counts(word, row, view) -> (AND of the words less bit 63, every rank's row, the payloads
 * where every rank carried its x, else None); None where view is not one contiguous buffer of
 * at most the payload's bytes (the Python body runs then: nothing was written). */
static PyObject *
Round_agree_counts(Round *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "agree_counts(word, row, view) takes 3 arguments");
        return NULL;
    }
    long long word = PyLong_AsLongLong(args[0]);
    if (word == -1 && PyErr_Occurred()) return NULL;
    PyObject *row = args[1], *view = args[2];
    if (!PyList_Check(row) || 2 + PyList_GET_SIZE(row) > self->offset / 8) {
        PyErr_SetString(PyExc_ValueError, "row must be a list that fits the block");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(row);
    int64_t values[ROUND_ROW_MAX];
    if (n > ROUND_ROW_MAX) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyLong_AsLongLong(PyList_GET_ITEM(row, i));
        if (values[i] == -1 && PyErr_Occurred()) return NULL;
    }
    int64_t reduced;
    int agreed = round_agree(self, (int64_t)word, values, n, view, &reduced);
    if (agreed < 0) return NULL;
    if (agreed > 0) Py_RETURN_NONE;
    PyObject *rows = PyList_New(self->size);
    if (rows == NULL) return NULL;
    for (int k = 0; k < self->size; k++) {
        PyObject *each = PyList_New(n);
        if (each == NULL) {
            Py_DECREF(rows);
            return NULL;
        }
        PyList_SET_ITEM(rows, k, each);
        const int64_t *theirs = round_row(self, k);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *value = PyLong_FromLongLong(theirs[i]);
            if (value == NULL) {
                Py_DECREF(rows);
                return NULL;
            }
            PyList_SET_ITEM(each, i, value);
        }
    }
    PyObject *carried = view != Py_None && reduced < 0 ? self->payloads : Py_None;
    return Py_BuildValue("(LNO)", (long long)(reduced & WORD_BITS), rows, carried);
}

/* rows_into(got, counts, row, rank=-1): the uneven calls' results from the carried payloads
 * (mpi_carried.carried_uneven; payload_rows_into, backends/_carried_uneven.c): with rank -1,
 * every rank's first counts[k] rows back to back (all_gather_v); else, counts being the splits,
 * the rows each rank k sent to `rank` (counts[k][rank] of them, after its counts[k][:rank]).
 * `row`: a row's bytes; `got`: the result's bytes. */
static PyObject *
Round_rows_into(Round *self, PyObject *args)
{
    PyObject *target, *counts;
    Py_ssize_t row;
    int rank = -1;
    if (!PyArg_ParseTuple(args, "OOn|i", &target, &counts, &row, &rank)) return NULL;
    Py_buffer got;
    if (PyObject_GetBuffer(target, &got, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int done = payload_rows_into(self, counts, rank, &got, row);
    PyBuffer_Release(&got);
    if (done < 0) return NULL;
    Py_RETURN_NONE;
}

int
round_start_staged(Round *self, PyObject *request)
{
    PyObject *r;
    int done = 0;
    if (self->direct && mpi_start != NULL) {
        if ((done = start_direct(self, request, 1)) < 0) return -1;
    } else {
        if ((r = PyObject_CallMethodNoArgs(request, s_Start)) == NULL) return -1;
        Py_DECREF(r);
        if ((r = PyObject_CallMethodNoArgs(request, s_Test)) == NULL || (done = PyObject_IsTrue(r)) < 0) {
            Py_XDECREF(r);
            return -1;
        }
        Py_DECREF(r);
    }
    if (!done) {
        if ((r = PyObject_CallMethodOneArg(self->channel, s_wait, request)) == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* src's bytes into the first bytes of stage (at_end 0), or the last bytes of stage into dst
 * (at_end 1; then src is the stage): 0, or -1 with an error. */
static int
copy_staged(PyObject *src, PyObject *dst, int at_end)
{
    Py_buffer from, to;
    if (PyObject_GetBuffer(src, &from, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (PyObject_GetBuffer(dst, &to, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&from);
        return -1;
    }
    Py_ssize_t n = at_end ? to.len : from.len;
    int fits = n <= (at_end ? from.len : to.len);
    if (fits) memcpy(to.buf, (const char *)from.buf + (at_end ? from.len - n : 0), n);
    else PyErr_SetString(PyExc_ValueError, "a staged call's data is larger than its staging array");
    PyBuffer_Release(&from);
    PyBuffer_Release(&to);
    return fits ? 0 : -1;
}

/* staged(request, src, stage, dst): MPIChannel._run_staged, compiled: src's bytes into the
 * first bytes of `stage` (where src is not None), the persistent `request` started and completed
 * (MPI_Start and the fast polls, directly where bound; then the channel's _wait), the last
 * bytes of `stage` into dst (where dst is not None). */
static PyObject *
Round_staged(Round *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "staged(request, src, stage, dst) takes 4 arguments");
        return NULL;
    }
    if (self->channel == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the round's channel is gone");
        return NULL;
    }
    if (args[1] != Py_None && copy_staged(args[1], args[2], 0) < 0) return NULL;
    if (round_start_staged(self, args[0]) < 0) return NULL;
    if (args[3] != Py_None && copy_staged(args[2], args[3], 1) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMemberDef Round_members[] = {
    {"direct", T_BOOL, offsetof(Round, direct), 0,
     "whether the round's persistent request is started and tested by MPI_Start and MPI_Test themselves "
     "(bind_mpi found them), else through mpi4py"},
    {"geometry", T_INT, offsetof(Round, geometry), READONLY,
     "the next round's block: 0 the small one, 1 the large one (see backends/mpi_round.py)"},
    {NULL},
};

static PyMethodDef Round_methods[] = {
    {"staged", (PyCFunction)(void (*)(void))Round_staged, METH_FASTCALL,
     PyDoc_STR("staged(request, src, stage, dst): MPIChannel._run_staged, compiled")},
    {"rows_into", (PyCFunction)Round_rows_into, METH_VARARGS,
     PyDoc_STR("rows_into(got, counts, row, rank=-1): the uneven calls' result bytes from the carried payloads")},
    {"agree_counts", (PyCFunction)(void (*)(void))Round_agree_counts, METH_FASTCALL,
     PyDoc_STR("agree_counts(word, row, view) -> (AND of the words, rows, payloads or None), or None: "
               "MPIChannel._agree_counts")},
    {NULL},
};

PyTypeObject RoundType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.backends._carried.Round",
    .tp_doc = PyDoc_STR("Round(channel, block, blocks, payloads, offset, polls, small, state): round(word, waiting=None) -> "
                        "the AND of every rank's word: MPIChannel._round, compiled"),
    .tp_basicsize = sizeof(Round),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Round_init,
    .tp_dealloc = (destructor)Round_dealloc,
    .tp_traverse = (traverseproc)Round_traverse,
    .tp_clear = (inquiry)Round_clear,
    .tp_call = (ternaryfunc)Round_call,
    .tp_methods = Round_methods,
    .tp_members = Round_members,
};

int
round_types_ready(PyObject *module)
{
    if ((s_request = PyUnicode_InternFromString("request")) == NULL ||
        (s_start = PyUnicode_InternFromString("start")) == NULL ||
        (s_Start = PyUnicode_InternFromString("Start")) == NULL ||
        (s_Test = PyUnicode_InternFromString("Test")) == NULL ||
        (s_wait_saying = PyUnicode_InternFromString("_wait_saying")) == NULL ||
        (s_everyone_fast = PyUnicode_InternFromString("_everyone_fast")) == NULL ||
        (s_wait = PyUnicode_InternFromString("_wait")) == NULL ||
        (s_read_geometry = PyUnicode_InternFromString("read_geometry")) == NULL ||
        (s_write_geometry = PyUnicode_InternFromString("write_geometry")) == NULL)
        return -1;
    if (PyType_Ready(&RoundType) < 0) return -1;
    Py_INCREF(&RoundType);
    if (PyModule_AddObject(module, "Round", (PyObject *)&RoundType) < 0) {
        Py_DECREF(&RoundType);
        return -1;
    }
    return 0;
}
