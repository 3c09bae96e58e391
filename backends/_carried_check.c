/* CallCheck.carry (collectives/reliability.py) for the compiled Carrier, compiled: the call's
 * check word from its kind's hash and sequence number, the carried call, the words' agreement.
 * What is not the common case (another checks level, a communicator's first call, a kind of
 * call not hashed yet, a carry that is not a Carrier) runs CallCheck.carry itself, the reference.
 * The word is wire.check_word's (tested against it through check_word below). Below it,
 * CallCheck.check_counts (the uneven calls' check and counts) compiled the same way. */
#include "_carried.h"

#include <stddef.h>

static PyObject *s_seq, *s_level, *s_shape, *s_carries, *s_call, *s_x, *s_dtype, *s_extra, *s_out,
    *s_carried, *s_view, *s_nbytes, *s_minus_one, *s_no_shape, *s_counted;

/* wire.check_word(call_hash, seq) */
static int64_t
word_of(int64_t call_hash, int64_t seq)
{
    int64_t h = (call_hash ^ seq) & 0x7FFFFFFF;
    return (h << 32) | (h ^ 0xFFFFFFFF);
}

/* wire.words_agree(reduced) */
static int
words_agree(int64_t reduced)
{
    return (((reduced >> 32) | reduced) & 0xFFFFFFFF) == 0xFFFFFFFF;
}

/* comm._seq, the running call's number, in *seq: 0, or -1 with an error. */
static int
seq_of(PyObject *comm, long long *seq)
{
    PyObject *value = PyObject_GetAttr(comm, s_seq);
    if (value == NULL) return -1;
    *seq = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return *seq == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The check word of the kind of call `key` (CallCheck.hashes' key; stolen) at number `seq`, in
 * *word: 1, or 0 where the kind is not hashed yet (the Python hashes it), -1 with an error. */
static int
word_for(PyObject *hashes, PyObject *key, long long seq, int64_t *word)
{
    if (key == NULL) return -1;
    PyObject *hash = PyDict_GetItemWithError(hashes, key);  /* (borrowed) */
    unsigned long long h = hash ? PyLong_AsUnsignedLongLongMask(hash) : 0;  /* (its low 31 bits count) */
    Py_DECREF(key);
    if (PyErr_Occurred()) return -1;
    if (hash == NULL) return 0;
    *word = word_of((int64_t)h, seq);
    return 1;
}

/* Whether the check is the default one on a call past a communicator's first (the common case
 * the compiled checks take; the others go to the Python): 1, 0, or -1 with an error; its number in
 * *seq. */
static int
usual_check(PyObject *call_check, PyObject *default_level, PyObject *comm, long long *seq)
{
    PyObject *level = PyObject_GetAttr(call_check, s_level);
    if (level == NULL) return -1;
    int usual = PyObject_RichCompareBool(level, default_level, Py_EQ);
    Py_DECREF(level);
    if (usual < 0 || seq_of(comm, seq) < 0) return -1;
    return usual && *seq != 1;
}

/* call_check.hashes, the dict of the kinds of call hashed so far (a new reference). */
static PyObject *
hashes_of(PyObject *call_check)
{
    PyObject *hashes = PyObject_GetAttrString(call_check, "hashes");
    if (hashes != NULL && !PyDict_Check(hashes)) {
        Py_DECREF(hashes);
        PyErr_SetString(PyExc_TypeError, "call_check.hashes must be a dict");
        return NULL;
    }
    return hashes;
}

/* What a compiled check of call_check holds (new references): its hashes, the method it stands
 * for (`method`, its fallback) and disagreed; 0, or -1 with an error (none held). */
static int
check_parts(PyObject *call_check, const char *method, PyObject **hashes, PyObject **fallback, PyObject **disagreed)
{
    *hashes = hashes_of(call_check);
    *fallback = *hashes ? PyObject_GetAttrString(call_check, method) : NULL;
    *disagreed = *fallback ? PyObject_GetAttrString(call_check, "disagreed") : NULL;
    if (*disagreed != NULL) return 0;
    Py_CLEAR(*hashes);
    Py_CLEAR(*fallback);
    return -1;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *call_check, *comm, *hashes, *fallback, *disagreed, *default_level;
} CheckedCarry;

#define CHECKED_CARRY_FIELDS(X) X(call_check) X(comm) X(hashes) X(fallback) X(disagreed) X(default_level)
GC_FIELDS(CheckedCarry, CHECKED_CARRY_FIELDS)

static void
CheckedCarry_dealloc(CheckedCarry *self)
{
    PyObject_GC_UnTrack(self);
    CheckedCarry_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* check(carry, call, reduce_op, root, dtype, view, out, extra) -> result or NOT_TAKEN */
static PyObject *
CheckedCarry_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    CheckedCarry *self = (CheckedCarry *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the check is gone");
        return NULL;
    }
    if (nargs != 8 || kwnames != NULL || Py_TYPE(args[0]) != &CarrierType)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *carry = args[0], *call = args[1], *reduce_op = args[2], *root = args[3], *dtype = args[4],
             *view = args[5];
    long long seq;
    int usual = usual_check(self->call_check, self->default_level, self->comm, &seq);
    if (usual < 0) return NULL;
    if (!usual) return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *shape = PyObject_GetAttr(view, s_shape);
    if (shape == NULL) return NULL;
    int64_t w;
    int found = word_for(self->hashes, PyTuple_Pack(5, call, dtype, reduce_op, root, shape), seq, &w);
    if (found <= 0) {
        Py_DECREF(shape);
        return found < 0 ? NULL : PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);  /* (a new kind) */
    }
    PyObject *word = PyLong_FromLongLong(w);
    if (word == NULL) {
        Py_DECREF(shape);
        return NULL;
    }
    PyObject *carried[5] = {view, root, args[6], args[7], word};
    PyObject *pair = Carrier_vectorcall(carry, carried, 5, NULL);
    Py_DECREF(word);
    if (pair == NULL) {
        Py_DECREF(shape);
        return NULL;
    }
    long long reduced = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 0));
    PyObject *result = PyTuple_GET_ITEM(pair, 1);
    Py_INCREF(result);
    Py_DECREF(pair);
    if (reduced == -1 && PyErr_Occurred()) goto failed;
    if (!words_agree(reduced)) {  /* another call on some rank: CollectiveMismatch, raised there */
        PyObject *r = PyObject_CallFunctionObjArgs(self->disagreed, reduce_op, root, dtype, shape, NULL);
        if (r == NULL) goto failed;
        Py_DECREF(r);
    }
    Py_DECREF(shape);
    return result;
failed:
    Py_DECREF(shape);
    Py_DECREF(result);
    return NULL;
}

static PyObject *
CheckedCarry_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"call_check", "comm", "default_level", NULL};
    PyObject *call_check, *comm, *default_level;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO", names, &call_check, &comm, &default_level)) return NULL;
    PyObject *hashes, *fallback, *disagreed;
    if (check_parts(call_check, "carry", &hashes, &fallback, &disagreed) < 0) return NULL;
    CheckedCarry *self = (CheckedCarry *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(hashes);
        Py_DECREF(fallback);
        Py_DECREF(disagreed);
        return NULL;
    }
    self->vectorcall = CheckedCarry_call;
    Py_INCREF(call_check);
    self->call_check = call_check;
    Py_INCREF(comm);
    self->comm = comm;
    Py_INCREF(default_level);
    self->default_level = default_level;
    self->hashes = hashes;
    self->fallback = fallback;
    self->disagreed = disagreed;
    return (PyObject *)self;
}

static PyTypeObject CheckedCarryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.backends._carried.CheckedCarry",
    .tp_doc = PyDoc_STR("CheckedCarry(call_check, comm, default_level): call_check.carry, compiled for Carriers"),
    .tp_basicsize = sizeof(CheckedCarry),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(CheckedCarry, vectorcall),
    .tp_new = CheckedCarry_new,
    .tp_call = PyVectorcall_Call,  /* (a call with keywords, or through tp_call) */
    .tp_dealloc = (destructor)CheckedCarry_dealloc,
    .tp_traverse = (traverseproc)CheckedCarry_traverse,
    .tp_clear = (inquiry)CheckedCarry_clear,
};

/* CallCheck.check, compiled for the channel's Round: the default check of a call that carries
 * nothing in it (a barrier, a split, an asynchronous or device x): its kind's word (bit 63 where
 * it runs on the fast path) in one round, the words' agreement. What is not the common case
 * (another checks level, a communicator's first call, an uneven call, a kind of call not hashed
 * yet) runs CallCheck.check itself, the reference. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int64_t fast_bit;
    int carries;  /* call_check.carries: an uneven call's check is its counts' round (check_counts) */
    PyObject *call_check, *comm, *hashes, *fallback, *disagreed, *default_level, *round;
} CheckedWord;

#define CHECKED_WORD_FIELDS(X) \
    X(call_check) X(comm) X(hashes) X(fallback) X(disagreed) X(default_level) X(round)
GC_FIELDS(CheckedWord, CHECKED_WORD_FIELDS)

static void
CheckedWord_dealloc(CheckedWord *self)
{
    PyObject_GC_UnTrack(self);
    CheckedWord_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* check(call, reduce_op, root, dtype, shape, waiting=None, fast=False) -> None */
static PyObject *
CheckedWord_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    CheckedWord *self = (CheckedWord *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the check is gone");
        return NULL;
    }
    if (nargs < 5 || nargs > 7 || kwnames != NULL)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *call = args[0], *reduce_op = args[1], *root = args[2], *dtype = args[3], *shape = args[4];
    PyObject *waiting = nargs > 5 ? args[5] : Py_None;
    int fast = nargs > 6 ? PyObject_IsTrue(args[6]) : 0;
    if (fast < 0) return NULL;
    long long seq;
    int usual = usual_check(self->call_check, self->default_level, self->comm, &seq);
    PyObject *counted = usual > 0 ? PyObject_GetAttr(call, s_counted) : NULL;
    int uneven = counted ? PyObject_IsTrue(counted) : 0;
    Py_XDECREF(counted);
    if (usual < 0 || (usual && counted == NULL) || uneven < 0) return NULL;
    if (usual && uneven && self->carries) Py_RETURN_NONE;  /* (checked with its counts, which follow) */
    if (!usual || uneven) return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    int64_t w, reduced;
    int found = word_for(self->hashes, PyTuple_Pack(5, call, dtype, reduce_op, root, shape), seq, &w);
    if (found <= 0)
        return found < 0 ? NULL : PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);  /* (a new kind) */
    if (round_run((Round *)self->round, w | (fast ? self->fast_bit : 0), waiting, &reduced) < 0) return NULL;
    if (!words_agree(reduced & WORD_BITS))  /* another call on some rank: CollectiveMismatch, raised there */
        return PyObject_CallFunctionObjArgs(self->disagreed, reduce_op, root, dtype, shape, NULL);
    Py_RETURN_NONE;
}

static PyObject *
CheckedWord_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"call_check", "comm", "round", "default_level", "fast_bit", NULL};
    PyObject *call_check, *comm, *round, *default_level;
    long long fast_bit;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!OL", names, &call_check, &comm, &RoundType, &round,
                                     &default_level, &fast_bit))
        return NULL;
    PyObject *hashes, *fallback, *disagreed;
    if (check_parts(call_check, "check", &hashes, &fallback, &disagreed) < 0) return NULL;
    CheckedWord *self = (CheckedWord *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(hashes);
        Py_DECREF(fallback);
        Py_DECREF(disagreed);
        return NULL;
    }
    self->vectorcall = CheckedWord_call;
    self->fast_bit = (int64_t)fast_bit;
    self->call_check = Py_NewRef(call_check);
    self->comm = Py_NewRef(comm);
    self->round = Py_NewRef(round);
    self->default_level = Py_NewRef(default_level);
    self->hashes = hashes;
    self->fallback = fallback;
    self->disagreed = disagreed;
    PyObject *carries = PyObject_GetAttr(call_check, s_carries);
    self->carries = carries ? PyObject_IsTrue(carries) : -1;
    Py_XDECREF(carries);
    if (self->carries < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyTypeObject CheckedWordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.backends._carried.CheckedWord",
    .tp_doc = PyDoc_STR("CheckedWord(call_check, comm, round, default_level, fast_bit): call_check.check, "
                        "compiled for a Round"),
    .tp_basicsize = sizeof(CheckedWord),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(CheckedWord, vectorcall),
    .tp_new = CheckedWord_new,
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)CheckedWord_dealloc,
    .tp_traverse = (traverseproc)CheckedWord_traverse,
    .tp_clear = (inquiry)CheckedWord_clear,
};

/* CallCheck.check_counts, compiled: an uneven call's check word (its kind's hash, x.shape[1:], the
 * sequence number) and its counts in one round of the channel's Round, x's bytes with them where x
 * is at most view_bytes of host memory. What is not the common case (the Round cannot take the
 * row or x, a kind not hashed yet, splits that are not a list or tuple of ints) runs
 * CallCheck.check_counts itself, the reference, before anything is written. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_ssize_t view_bytes;
    PyObject *call_check, *comm, *hashes, *fallback, *compare, *round, *gathered_call;
} CheckedCounts;

#define CHECKED_COUNTS_FIELDS(X) X(call_check) X(comm) X(hashes) X(fallback) X(compare) X(round) X(gathered_call)
GC_FIELDS(CheckedCounts, CHECKED_COUNTS_FIELDS)

static void
CheckedCounts_dealloc(CheckedCounts *self)
{
    PyObject_GC_UnTrack(self);
    CheckedCounts_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An int of a shape or a splits list as int64 (-1 and no error where it is not an int). */
static int64_t
int_of(PyObject *item)
{
    if (item == NULL || !PyLong_Check(item)) return -1;
    long long value = PyLong_AsLongLong(item);
    if (value == -1) PyErr_Clear();
    return value;
}

/* What the round says: r.extra (every rank's rows, or the splits) and r.carried; Py_True, or
 * Py_False where an out has other rows than its rank's result (the call path's own counts
 * exchange then says which). */
static PyObject *
counts_agreed(CheckedCounts *self, PyObject *r, int gathered, Py_ssize_t n, int carrying, int64_t reduced)
{
    Round *round = (Round *)self->round;
    const int size = round->size;
    PyObject *extra = PyList_New(size);
    if (extra == NULL) return NULL;
    int64_t total = 0;
    for (int k = 0; k < size; k++) {
        const int64_t *theirs = round_row(round, k);
        PyObject *item;
        if (gathered) {
            item = PyLong_FromLongLong(theirs[0]);
            total += theirs[0];
        } else {
            item = PyList_New(n - 1);
            for (Py_ssize_t i = 0; item != NULL && i < n - 1; i++) {
                PyObject *value = PyLong_FromLongLong(theirs[i]);
                if (value == NULL) Py_CLEAR(item);
                else PyList_SET_ITEM(item, i, value);
            }
        }
        if (item == NULL) {
            Py_DECREF(extra);
            return NULL;
        }
        PyList_SET_ITEM(extra, k, item);
    }
    for (int k = 0; k < size; k++) {  /* each rank's out rows (-1: none) against its result's */
        int64_t rows = round_row(round, k)[n - 1], expected = total;
        if (!gathered) {
            expected = 0;
            for (int j = 0; j < size; j++) expected += round_row(round, j)[k];
        }
        if (rows != -1 && rows != expected) {
            Py_DECREF(extra);
            Py_RETURN_FALSE;
        }
    }
    PyObject *carried = carrying && reduced < 0 ? round->payloads : Py_None;
    if (PyObject_SetAttr(r, s_extra, extra) < 0 || PyObject_SetAttr(r, s_carried, carried) < 0) {
        Py_DECREF(extra);
        return NULL;
    }
    Py_DECREF(extra);
    Py_RETURN_TRUE;
}

/* check_counts(r) -> bool */
static PyObject *
CheckedCounts_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    CheckedCounts *self = (CheckedCounts *)op;
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the check is gone");
        return NULL;
    }
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *r = args[0];
    PyObject *carries = PyObject_GetAttr(self->call_check, s_carries);
    if (carries == NULL) return NULL;
    int on = PyObject_IsTrue(carries);
    Py_DECREF(carries);
    if (on <= 0) return on < 0 ? NULL : Py_NewRef(Py_False);
    long long seq;
    if (seq_of(self->comm, &seq) < 0) return NULL;
    if (seq == 1) Py_RETURN_FALSE;
    /* r's fields, x's shape, the kind's key; then the row; then x's view */
    PyObject *call = NULL, *x = NULL, *dtype = NULL, *out = NULL, *extra = NULL, *shape = NULL,
             *view = NULL, *result = NULL;
    int64_t values[ROUND_ROW_MAX], reduced, word;
    Py_ssize_t n = 0;
    if ((call = PyObject_GetAttr(r, s_call)) == NULL || (x = PyObject_GetAttr(r, s_x)) == NULL ||
        (dtype = PyObject_GetAttr(r, s_dtype)) == NULL || (out = PyObject_GetAttr(r, s_out)) == NULL ||
        (extra = PyObject_GetAttr(r, s_extra)) == NULL ||
        (shape = PyObject_GetAttr(x, s_shape)) == NULL)
        goto finished;
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) < 1) goto fallback;  /* (a torch.Size is a tuple) */
    PyObject *rest = PyTuple_GetSlice(shape, 1, PyTuple_GET_SIZE(shape));
    if (rest == NULL) goto finished;
    int found = word_for(self->hashes, PyTuple_Pack(5, call, dtype, Py_None, s_minus_one, rest), seq, &word);
    Py_DECREF(rest);
    if (found < 0) goto finished;
    if (found == 0) goto fallback;  /* a new kind: hashed there */
    int gathered = call == self->gathered_call;
    if (gathered) {
        values[n++] = int_of(PyTuple_GET_ITEM(shape, 0));
    } else {  /* the splits, as given (checked by the call's row: an int per rank) */
        if (!PyList_Check(extra) && !PyTuple_Check(extra)) goto fallback;
        Py_ssize_t m = PySequence_Fast_GET_SIZE(extra);
        if (m + 1 > ROUND_ROW_MAX) goto fallback;
        for (Py_ssize_t i = 0; i < m; i++) values[n++] = int_of(PySequence_Fast_GET_ITEM(extra, i));
    }
    if (out == Py_None) {
        values[n++] = -1;
    } else {
        PyObject *out_shape = PyObject_GetAttr(out, s_shape);
        if (out_shape == NULL) goto finished;
        values[n++] = PyTuple_Check(out_shape) && PyTuple_GET_SIZE(out_shape) > 0 ?
            int_of(PyTuple_GET_ITEM(out_shape, 0)) : -1;
        int unusual = values[n - 1] < 0;
        Py_DECREF(out_shape);
        if (unusual) goto fallback;
    }
    for (Py_ssize_t i = 0; i < n - 1; i++)
        if (values[i] < 0) goto fallback;
    PyObject *nbytes = PyObject_GetAttr(x, s_nbytes);
    if (nbytes == NULL) goto finished;
    Py_ssize_t bytes = PyLong_AsSsize_t(nbytes);
    Py_DECREF(nbytes);
    if (bytes == -1 && PyErr_Occurred()) goto finished;
    view = bytes <= self->view_bytes ? PyObject_GetAttr(r, s_view) : Py_NewRef(Py_None);  /* (the call path's) */
    if (view == NULL) goto finished;
    int agreed = round_agree((Round *)self->round, word, values, n, view, &reduced);
    if (agreed < 0) goto finished;
    if (agreed > 0) goto fallback;  /* (nothing was written) */
    if (!words_agree(reduced & WORD_BITS)) {  /* another call: the mismatch, raised there */
        result = PyObject_CallFunction(self->compare, "OiOO", Py_None, -1, Py_None, s_no_shape);
        if (result != NULL) Py_SETREF(result, Py_NewRef(Py_False));
        goto finished;
    }
    result = counts_agreed(self, r, gathered, n, view != Py_None, reduced);
    goto finished;
fallback:
    result = PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
finished:
    Py_XDECREF(call);
    Py_XDECREF(x);
    Py_XDECREF(dtype);
    Py_XDECREF(out);
    Py_XDECREF(extra);
    Py_XDECREF(shape);
    Py_XDECREF(view);
    return result;
}

static PyObject *
CheckedCounts_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"call_check", "comm", "round", "view_bytes", "gathered_call", NULL};
    PyObject *call_check, *comm, *round, *gathered_call;
    Py_ssize_t view_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!nO", names, &call_check, &comm, &RoundType, &round,
                                     &view_bytes, &gathered_call))
        return NULL;
    PyObject *hashes = hashes_of(call_check);
    if (hashes == NULL) return NULL;
    PyObject *fallback = PyObject_GetAttrString(call_check, "check_counts");
    PyObject *compare = fallback ? PyObject_GetAttrString(call_check, "compare_fingerprints") : NULL;
    CheckedCounts *self = compare ? (CheckedCounts *)type->tp_alloc(type, 0) : NULL;
    if (self == NULL) {
        Py_DECREF(hashes);
        Py_XDECREF(fallback);
        Py_XDECREF(compare);
        return NULL;
    }
    self->vectorcall = CheckedCounts_call;
    self->view_bytes = view_bytes;
    self->call_check = Py_NewRef(call_check);
    self->comm = Py_NewRef(comm);
    self->round = Py_NewRef(round);
    self->gathered_call = Py_NewRef(gathered_call);
    self->hashes = hashes;
    self->fallback = fallback;
    self->compare = compare;
    return (PyObject *)self;
}

static PyTypeObject CheckedCountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.backends._carried.CheckedCounts",
    .tp_doc = PyDoc_STR("CheckedCounts(call_check, comm, round, view_bytes, gathered_call): "
                        "call_check.check_counts, compiled"),
    .tp_basicsize = sizeof(CheckedCounts),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(CheckedCounts, vectorcall),
    .tp_new = CheckedCounts_new,
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)CheckedCounts_dealloc,
    .tp_traverse = (traverseproc)CheckedCounts_traverse,
    .tp_clear = (inquiry)CheckedCounts_clear,
};

/* check_word(call_hash, seq): the word this module makes (the tests hold it to wire.check_word). */
static PyObject *
check_word(PyObject *module, PyObject *args)
{
    unsigned long long call_hash;
    long long seq;
    if (!PyArg_ParseTuple(args, "KL", &call_hash, &seq)) return NULL;
    return PyLong_FromLongLong(word_of(call_hash, seq));
}

static PyMethodDef functions[] = {
    {"check_word", check_word, METH_VARARGS, PyDoc_STR("check_word(call_hash, seq): wire.check_word, compiled")},
    {NULL},
};

int
check_types_ready(PyObject *module)
{
    if ((s_seq = PyUnicode_InternFromString("_seq")) == NULL ||
        (s_level = PyUnicode_InternFromString("level")) == NULL ||
        (s_shape = PyUnicode_InternFromString("shape")) == NULL ||
        (s_carries = PyUnicode_InternFromString("carries")) == NULL ||
        (s_call = PyUnicode_InternFromString("call")) == NULL ||
        (s_x = PyUnicode_InternFromString("x")) == NULL ||
        (s_dtype = PyUnicode_InternFromString("dtype")) == NULL ||
        (s_extra = PyUnicode_InternFromString("extra")) == NULL ||
        (s_out = PyUnicode_InternFromString("out")) == NULL ||
        (s_carried = PyUnicode_InternFromString("carried")) == NULL ||
        (s_view = PyUnicode_InternFromString("view")) == NULL ||
        (s_nbytes = PyUnicode_InternFromString("nbytes")) == NULL ||
        (s_minus_one = PyLong_FromLong(-1)) == NULL ||
        (s_no_shape = PyTuple_New(0)) == NULL || (s_counted = PyUnicode_InternFromString("counted")) == NULL)
        return -1;
    if (PyType_Ready(&CheckedCarryType) < 0 || PyType_Ready(&CheckedCountsType) < 0 ||
        PyType_Ready(&CheckedWordType) < 0 ||
        PyModule_AddFunctions(module, functions) < 0)
        return -1;
    Py_INCREF(&CheckedCarryType);
    if (PyModule_AddObject(module, "CheckedCarry", (PyObject *)&CheckedCarryType) < 0) {
        Py_DECREF(&CheckedCarryType);
        return -1;
    }
    Py_INCREF(&CheckedWordType);
    if (PyModule_AddObject(module, "CheckedWord", (PyObject *)&CheckedWordType) < 0) {
        Py_DECREF(&CheckedWordType);
        return -1;
    }
    Py_INCREF(&CheckedCountsType);
    if (PyModule_AddObject(module, "CheckedCounts", (PyObject *)&CheckedCountsType) < 0) {
        Py_DECREF(&CheckedCountsType);
        return -1;
    }
    return 0;
}
