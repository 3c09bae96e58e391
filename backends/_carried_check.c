/* CallCheck.carry (collectives/reliability.py) for the compiled Carrier, compiled: the call's
 * check word from its kind's hash and sequence number, the carried call, the words' agreement.
 * What is not the common case (another checks level, a communicator's first call, a kind of
 * call not hashed yet, a carry that is not a Carrier) runs CallCheck.carry itself, the reference.
 * The word is wire.check_word's (tested against it through check_word below). */
#include "_carried.h"

#include <stddef.h>

static PyObject *s_seq, *s_level, *s_shape;

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
    PyObject *level = PyObject_GetAttr(self->call_check, s_level);
    if (level == NULL) return NULL;
    int usual = PyObject_RichCompareBool(level, self->default_level, Py_EQ);
    Py_DECREF(level);
    if (usual < 0) return NULL;
    PyObject *seq_obj = PyObject_GetAttr(self->comm, s_seq);
    if (seq_obj == NULL) return NULL;
    long long seq = PyLong_AsLongLong(seq_obj);
    Py_DECREF(seq_obj);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    if (!usual || seq == 1) return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *shape = PyObject_GetAttr(view, s_shape);
    if (shape == NULL) return NULL;
    PyObject *key = PyTuple_Pack(5, call, dtype, reduce_op, root, shape);
    PyObject *hash = key ? PyDict_GetItemWithError(self->hashes, key) : NULL;  /* (borrowed) */
    Py_XDECREF(key);
    if (hash == NULL) {
        Py_DECREF(shape);
        if (PyErr_Occurred()) return NULL;
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);  /* a new kind: hashed there */
    }
    unsigned long long h = PyLong_AsUnsignedLongLongMask(hash);  /* (its low 31 bits count) */
    if (h == (unsigned long long)-1 && PyErr_Occurred()) {
        Py_DECREF(shape);
        return NULL;
    }
    PyObject *word = PyLong_FromLongLong(word_of((int64_t)h, seq));
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
    PyObject *hashes = PyObject_GetAttrString(call_check, "_hashes");
    if (hashes == NULL) return NULL;
    if (!PyDict_Check(hashes)) {
        Py_DECREF(hashes);
        PyErr_SetString(PyExc_TypeError, "call_check._hashes must be a dict");
        return NULL;
    }
    PyObject *fallback = PyObject_GetAttrString(call_check, "carry");
    PyObject *disagreed = fallback ? PyObject_GetAttrString(call_check, "_disagreed") : NULL;
    CheckedCarry *self = disagreed ? (CheckedCarry *)type->tp_alloc(type, 0) : NULL;
    if (self == NULL) {
        Py_DECREF(hashes);
        Py_XDECREF(fallback);
        Py_XDECREF(disagreed);
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
        (s_shape = PyUnicode_InternFromString("shape")) == NULL)
        return -1;
    if (PyType_Ready(&CheckedCarryType) < 0 || PyModule_AddFunctions(module, functions) < 0) return -1;
    Py_INCREF(&CheckedCarryType);
    if (PyModule_AddObject(module, "CheckedCarry", (PyObject *)&CheckedCarryType) < 0) {
        Py_DECREF(&CheckedCarryType);
        return -1;
    }
    return 0;
}
