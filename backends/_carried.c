/* The carried call of backends/mpi_carried.py, compiled: one crossing of the Python/C boundary
 * where the pure-Python carry runs a dozen numpy and mpi4py calls.
 *
 * A Carrier is made by mpi_carried.carried_path beside its Python `carry` (the reference, and
 * this object's fallback) and called the same way: carrier(view, root, out, extra, word) ->
 * (AND of the ranks' words, result or NOT_TAKEN). It copies x's bytes into this rank's block,
 * makes the channel's round (backends/_carried_round.c: mpi4py's own Start and Test, no MPI
 * symbol linked here, so one build serves every MPI library mpi4py loads) and makes the result
 * from the gathered blocks (memcpy; reductions in C where they are plain C arithmetic, else
 * through mpi4py's MPI_Reduce_local, in the Python path's order). A view that is not one
 * contiguous buffer goes to the Python carry before anything is written.
 *
 * Optional: where it cannot be built, the Python carry runs (COLLECTIVES_COMPILED=0 too).
 * The module: Carrier, and Round (backends/_carried_round.c).
 */
#include "_carried.h"

#include <stddef.h>
#include <string.h>

enum { ALL_REDUCE, REDUCE, REDUCE_SCATTER, BROADCAST, ALL_GATHER, GATHER, SCATTER, ALL_TO_ALL, KINDS };
static const char *const KIND_NAMES[KINDS] = {
    "all_reduce", "reduce", "reduce_scatter", "broadcast", "all_gather", "gather", "scatter", "all_to_all"};

/* The kinds with a root, and those that read only the root's x. */
static int
rooted(int kind)
{
    return kind == REDUCE || kind == BROADCAST || kind == GATHER || kind == SCATTER;
}

static int
reads_root_only(int kind)
{
    return kind == BROADCAST || kind == SCATTER;
}

/* inout[i] = in[i] op inout[i], MPI_Reduce_local's order, for n items. */
typedef void (*reduce_fn)(void *inout, const void *in, Py_ssize_t n);

/* The integer ops wrap (computed unsigned, as MPI and numpy do); the float ones are the IEEE
 * operations MPI's SUM and PROD make (commutative: the order of the operands is MPI's anyway).
 * Float MIN/MAX never come here (they order NaN through keys), nor bool and float16 (mpi4py's
 * Reduce_local does those). */
#define ARITH(name, T, U, expr)                                                          \
    static void name(void *inout_, const void *in_, Py_ssize_t n)                       \
    {                                                                                    \
        T *inout = (T *)inout_;                                                          \
        const T *in = (const T *)in_;                                                    \
        for (Py_ssize_t i = 0; i < n; i++) {                                             \
            T a = in[i], b = inout[i];                                                   \
            (void)sizeof(U);                                                             \
            inout[i] = (expr);                                                           \
        }                                                                                \
    }
#define INTEGER_OPS(T, U, tag)                                                          \
    ARITH(sum_##tag, T, U, (T)((U)a + (U)b))                                             \
    ARITH(prod_##tag, T, U, (T)((U)a * (U)b))                                            \
    ARITH(min_##tag, T, U, a < b ? a : b)                                                \
    ARITH(max_##tag, T, U, a > b ? a : b)                                                \
    ARITH(band_##tag, T, U, (T)(a & b))                                                  \
    ARITH(bor_##tag, T, U, (T)(a | b))                                                   \
    ARITH(bxor_##tag, T, U, (T)(a ^ b))
INTEGER_OPS(int8_t, uint8_t, int8)
INTEGER_OPS(uint8_t, unsigned int, uint8)
INTEGER_OPS(int16_t, uint16_t, int16)
INTEGER_OPS(int32_t, uint32_t, int32)
INTEGER_OPS(int64_t, uint64_t, int64)
ARITH(sum_float32, float, float, a + b)
ARITH(prod_float32, float, float, a * b)
ARITH(sum_float64, double, double, a + b)
ARITH(prod_float64, double, double, a * b)

static const struct {
    const char *dtype, *op;
    reduce_fn fn;
    Py_ssize_t item;
} ARITHMETIC[] = {
#define INTEGER_ROWS(tag, bytes)                                                        \
    {#tag, "sum", sum_##tag, bytes}, {#tag, "prod", prod_##tag, bytes}, {#tag, "min", min_##tag, bytes}, \
    {#tag, "max", max_##tag, bytes}, {#tag, "band", band_##tag, bytes}, {#tag, "bor", bor_##tag, bytes}, \
    {#tag, "bxor", bxor_##tag, bytes},
    INTEGER_ROWS(int8, 1) INTEGER_ROWS(uint8, 1) INTEGER_ROWS(int16, 2) INTEGER_ROWS(int32, 4)
    INTEGER_ROWS(int64, 8)
    {"float32", "sum", sum_float32, 4}, {"float32", "prod", prod_float32, 4},
    {"float32", "avg", sum_float32, 4},
    {"float64", "sum", sum_float64, 8}, {"float64", "prod", prod_float64, 8},
    {"float64", "avg", sum_float64, 8},
    {NULL, NULL, NULL, 0},
};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;         /* Carrier_vectorcall */
    int kind, avg;
    Round *round;                      /* the channel's round: blocks, request, waits */
    PyObject *fallback;                /* the Python carry: the reference, for what is not handled here */
    PyObject *not_taken;               /* collectives.calls.NOT_TAKEN */
    PyObject *new_result;              /* new(view, shape, out) -> (result, its numpy view), or None */
    PyObject *local, *mpi_type;        /* MPI.Op.Reduce_local of the op and the MPI datatype, or None */
    reduce_fn arithmetic;              /* the op on the dtype in C, where it is plain C arithmetic, else NULL */
    Py_ssize_t item;                   /* the dtype's bytes, with arithmetic */
    PyObject *staged;                  /* the fast path's staged requests of this kind (a dict), or None */
    Py_ssize_t staged_bytes;           /* the most bytes of x a staged request takes */
} Carrier;

#define CARRIER_FIELDS(X) X(round) X(fallback) X(not_taken) X(new_result) X(local) X(mpi_type) X(staged)
GC_FIELDS(Carrier, CARRIER_FIELDS)

static void
Carrier_dealloc(Carrier *self)
{
    PyObject_GC_UnTrack(self);
    Carrier_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Carrier_init(Carrier *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"kind", "round", "fallback", "not_taken", "new_result", "local", "mpi_type", "avg",
                            "dtype", "op", "staged", "staged_bytes", NULL};
    const char *kind, *dtype = "", *op = "";
    PyObject *round, *fallback, *not_taken, *new_result, *local, *mpi_type, *staged = Py_None;
    int avg;
    Py_ssize_t staged_bytes = 0;
    if (self->round != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Carrier is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sO!OOOOOp|ssOn", names, &kind, &RoundType, &round, &fallback,
                                     &not_taken, &new_result, &local, &mpi_type, &avg, &dtype, &op, &staged,
                                     &staged_bytes))
        return -1;
    if (staged != Py_None && !PyDict_Check(staged)) {
        PyErr_SetString(PyExc_TypeError, "staged must be a dict or None");
        return -1;
    }
    self->staged_bytes = staged_bytes;
    self->arithmetic = NULL;
    for (int i = 0; ARITHMETIC[i].dtype != NULL; i++)
        if (strcmp(dtype, ARITHMETIC[i].dtype) == 0 && strcmp(op, ARITHMETIC[i].op) == 0) {
            self->arithmetic = ARITHMETIC[i].fn;
            self->item = ARITHMETIC[i].item;
        }
    self->kind = -1;
    for (int k = 0; k < KINDS; k++)
        if (strcmp(kind, KIND_NAMES[k]) == 0) self->kind = k;
    if (self->kind < 0) {
        PyErr_Format(PyExc_ValueError, "kind must be one of all_reduce, reduce, reduce_scatter, "
                     "broadcast, all_gather, gather, scatter, all_to_all; got %s", kind);
        return -1;
    }
    self->avg = avg;
#define KEEP(field, value) do { Py_INCREF(value); self->field = value; } while (0)
    KEEP(round, (Round *)round);
    KEEP(fallback, fallback);
    KEEP(not_taken, not_taken);
    KEEP(new_result, new_result);
    KEEP(local, local);
    KEEP(mpi_type, mpi_type);
    KEEP(staged, staged);
#undef KEEP
    return 0;
}

static const char *
payload_of(Carrier *self, int k)
{
    return round_payload(self->round, k);
}

/* reduce_local([rank k's payload of n bytes, T], [target, T]) */
static int
reduce_into(Carrier *self, int k, Py_ssize_t skip, Py_ssize_t n, PyObject *target, char *to)
{
    if (self->arithmetic != NULL) {
        self->arithmetic(to, payload_of(self, k) + skip, n / self->item);
        return 0;
    }
    PyObject *source = PyMemoryView_FromMemory((char *)payload_of(self, k) + skip, n, PyBUF_READ);
    if (source == NULL) return -1;
    PyObject *in = PyList_New(2), *inout = PyList_New(2);
    if (in == NULL || inout == NULL) {
        Py_DECREF(source); Py_XDECREF(in); Py_XDECREF(inout);
        return -1;
    }
    PyList_SET_ITEM(in, 0, source);
    Py_INCREF(self->mpi_type);
    PyList_SET_ITEM(in, 1, self->mpi_type);
    Py_INCREF(target);
    PyList_SET_ITEM(inout, 0, target);
    Py_INCREF(self->mpi_type);
    PyList_SET_ITEM(inout, 1, self->mpi_type);
    PyObject *r = PyObject_CallFunctionObjArgs(self->local, in, inout, NULL);
    Py_DECREF(in);
    Py_DECREF(inout);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* The reduction of every rank's bytes [skip, skip + n) of its payload into target (of buffer
 * `to`), rank 0's first; at 2 ranks where target holds this rank's own already (`own`), the
 * peer's reduced into it. Then AVG's division. */
static int
reduction(Carrier *self, PyObject *target, char *to, Py_ssize_t skip, Py_ssize_t n, int own)
{
    if (self->round->size == 2 && own) {
        if (reduce_into(self, 1 - self->round->rank, skip, n, target, to) < 0) return -1;
    } else {
        memcpy(to, payload_of(self, 0) + skip, n);
        for (int k = 1; k < self->round->size; k++)
            if (reduce_into(self, k, skip, n, target, to) < 0) return -1;
    }
    if (self->avg) {
        PyObject *size = PyLong_FromLong(self->round->size);
        if (size == NULL) return -1;
        PyObject *r = PyNumber_InPlaceTrueDivide(target, size);
        Py_DECREF(size);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

static PyObject *s_data_ptr, *s_nbytes, *s_timeout, *s_shape;

PyObject *
tensor_memory(PyObject *tensor)
{
    PyObject *address = PyObject_CallMethodNoArgs(tensor, s_data_ptr);
    if (address == NULL) return NULL;
    PyObject *nbytes = PyObject_GetAttr(tensor, s_nbytes);
    void *at = PyLong_AsVoidPtr(address);
    Py_DECREF(address);
    if (nbytes == NULL) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(nbytes);
    Py_DECREF(nbytes);
    if (PyErr_Occurred()) return NULL;
    return PyMemoryView_FromMemory(n ? (char *)at : (char *)&s_data_ptr, n, PyBUF_WRITE);
}

/* A shape tuple: (lead, *dims[:ndim]), or dims[:ndim] alone where lead < 0. */
static PyObject *
shape_tuple(Py_ssize_t lead, const Py_ssize_t *dims, int ndim)
{
    int first = lead >= 0;
    PyObject *shape = PyTuple_New(first + ndim);
    for (int i = 0; shape != NULL && i < first + ndim; i++) {
        PyObject *n = PyLong_FromSsize_t(first && i == 0 ? lead : dims[i - first]);
        if (n == NULL) Py_CLEAR(shape);
        else PyTuple_SET_ITEM(shape, i, n);
    }
    return shape;
}

/* new_result(view, shape, out) -> (result, recv), recv's buffer (writable, `need` bytes) in *got;
 * the result's shape is shape_tuple(lead, dims, ndim). An out= (checked by the call path: x's
 * kind, dtype and device, C-contiguous, writable, the result's shape) is written as it is: a numpy
 * array through its buffer, a tensor by address (new's out.numpy() costs 0.7 us; but for AVG,
 * whose division takes the numpy view). */
static PyObject *
new_result(Carrier *self, PyObject *view, Py_ssize_t lead, const Py_ssize_t *dims, int ndim, PyObject *out,
           PyObject **recv, Py_buffer *got, Py_ssize_t need)
{
    int buffer = out != Py_None && PyObject_CheckBuffer(out);
    if (out != Py_None && (buffer || !self->avg)) {
        PyObject *memory = buffer ? Py_NewRef(out) : tensor_memory(out);
        if (memory == NULL) return NULL;
        if (PyObject_GetBuffer(memory, got, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(memory);
            return NULL;
        }
        if (got->len != need) {
            PyBuffer_Release(got);
            Py_DECREF(memory);
            PyErr_Format(PyExc_ValueError, "out holds %zd bytes; the result has %zd", got->len, need);
            return NULL;
        }
        *recv = memory;
        return Py_NewRef(out);
    }
    PyObject *shape = shape_tuple(lead, dims, ndim);
    if (shape == NULL) return NULL;
    PyObject *pair = PyObject_CallFunctionObjArgs(self->new_result, view, shape, out, NULL);
    Py_DECREF(shape);
    if (pair == NULL) return NULL;
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        Py_DECREF(pair);
        PyErr_SetString(PyExc_TypeError, "new_result must return (result, its numpy view)");
        return NULL;
    }
    PyObject *result = PyTuple_GET_ITEM(pair, 0);
    *recv = PyTuple_GET_ITEM(pair, 1);
    Py_INCREF(result);
    Py_INCREF(*recv);
    Py_DECREF(pair);
    if (PyObject_GetBuffer(*recv, got, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(result);
        Py_CLEAR(*recv);
        return NULL;
    }
    return result;
}

/* The result of the call from the gathered blocks (x's bytes in `x`, of n bytes). */
static PyObject *
make(Carrier *self, PyObject *view, Py_buffer *x, int root, PyObject *out)
{
    const Py_ssize_t n = x->len;
    const int size = self->round->size, rank = self->round->rank;
    PyObject *recv = NULL, *result = NULL;
    Py_buffer got;
    switch (self->kind) {
    case BROADCAST:
        if (root != rank) memcpy(x->buf, payload_of(self, root), n);
        Py_INCREF(view);
        return view;
    case ALL_REDUCE:
    case REDUCE:
        if (self->kind == REDUCE && root != rank) {
            Py_INCREF(view);
            return view;
        }
        if (reduction(self, view, x->buf, 0, n, 1) < 0) return NULL;
        Py_INCREF(view);
        return view;
    case REDUCE_SCATTER: {
        if (x->ndim < 1) break;
        Py_ssize_t rows = x->shape[0] / size, part = n / size;
        result = new_result(self, view, rows, x->shape + 1, x->ndim - 1, out, &recv, &got, part);
        if (result == NULL) return NULL;
        int failed = reduction(self, recv, got.buf, (Py_ssize_t)rank * part, part, 0);
        PyBuffer_Release(&got);
        Py_DECREF(recv);
        if (failed < 0) Py_CLEAR(result);
        return result;
    }
    case ALL_GATHER:
    case GATHER:
        if (self->kind == GATHER && root != rank) Py_RETURN_NONE;
        result = new_result(self, view, size, x->shape, x->ndim, out, &recv, &got, size * n);
        if (result == NULL) return NULL;
        for (int k = 0; k < size; k++) memcpy((char *)got.buf + (Py_ssize_t)k * n, payload_of(self, k), n);
        break;
    case SCATTER: {
        if (x->ndim < 1) break;
        Py_ssize_t part = n / size;
        result = new_result(self, view, -1, x->shape + 1, x->ndim - 1, out, &recv, &got, part);
        if (result == NULL) return NULL;
        memcpy(got.buf, payload_of(self, root) + (Py_ssize_t)rank * part, part);
        break;
    }
    case ALL_TO_ALL: {
        if (x->ndim < 1) break;
        Py_ssize_t part = n / size;
        result = new_result(self, view, -1, x->shape, x->ndim, out, &recv, &got, n);
        if (result == NULL) return NULL;
        for (int k = 0; k < size; k++)
            memcpy((char *)got.buf + (Py_ssize_t)k * part, payload_of(self, k) + (Py_ssize_t)rank * part, part);
        break;
    }
    }
    if (result == NULL) {
        PyErr_SetString(PyExc_ValueError, "a carried call of this kind needs x with a first dimension");
        return NULL;
    }
    PyBuffer_Release(&got);
    Py_DECREF(recv);
    return result;
}

/* The call after its check's round, where x is larger than the block: through the fast path's
 * staged request of its shape (and root) where there is one, as backends/mpi_staged.py runs it;
 * NOT_TAKEN where there is none yet (the fast path makes it), under no timeout, or for AVG. */
static PyObject *
staged_call(Carrier *self, PyObject *view, Py_buffer *x, int root, PyObject *out)
{
    Round *round = self->round;
    const int size = round->size, rank = round->rank, kind = self->kind;
    if (self->staged == Py_None || self->avg || x->len == 0 || x->len > self->staged_bytes)
        return Py_NewRef(self->not_taken);
    PyObject *timeout = PyObject_GetAttr(round->channel, s_timeout), *key, *result = NULL, *recv = NULL;
    if (timeout == NULL) return NULL;
    Py_DECREF(timeout);
    if (timeout == Py_None || (key = PyObject_GetAttr(view, s_shape)) == NULL)
        return timeout == Py_None ? Py_NewRef(self->not_taken) : NULL;
    if (rooted(kind)) {
        PyObject *r = PyLong_FromLong(root);
        Py_SETREF(key, r ? PyTuple_Pack(2, key, r) : NULL);
        Py_XDECREF(r);
        if (key == NULL) return NULL;
    }
    PyObject *entry = PyDict_GetItemWithError(self->staged, key);
    Py_DECREF(key);
    if (entry == NULL || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2)
        return PyErr_Occurred() ? NULL : Py_NewRef(self->not_taken);
    Py_INCREF(entry);  /* (held while it runs) */
    Py_buffer stage, got;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(entry, 1), &stage, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(entry);
        return NULL;
    }
    const int mine = !rooted(kind) || root == rank;
    const int sends = reads_root_only(kind) ? mine : 1;
    const int gets = kind == REDUCE || kind == GATHER ? mine : (kind == BROADCAST ? !mine : 1);
    const Py_ssize_t n = x->len;
    if (n > stage.len || (x->ndim < 1 && (kind == REDUCE_SCATTER || kind == SCATTER))) {
        PyErr_SetString(PyExc_ValueError, "a staged call's x does not fit its staging array");
        goto done;
    }
    if (sends) memcpy(stage.buf, x->buf, n);
    if (round_start_staged(round, PyTuple_GET_ITEM(entry, 0)) < 0) goto done;
    const char *end = (const char *)stage.buf + stage.len;
    switch (kind) {
    case ALL_REDUCE:
    case REDUCE:
    case BROADCAST:  /* (x is the result) */
        if (gets) memcpy(x->buf, end - n, n);
        result = Py_NewRef(view);
        goto done;
    case REDUCE_SCATTER:
        result = new_result(self, view, x->shape[0] / size, x->shape + 1, x->ndim - 1, out, &recv, &got, n / size);
        break;
    case ALL_GATHER:
    case GATHER:
        if (!gets) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        result = new_result(self, view, size, x->shape, x->ndim, out, &recv, &got, size * n);
        break;
    case SCATTER:
        result = new_result(self, view, -1, x->shape + 1, x->ndim - 1, out, &recv, &got, n / size);
        break;
    default:  /* ALL_TO_ALL */
        result = new_result(self, view, -1, x->shape, x->ndim, out, &recv, &got, n);
    }
    if (result != NULL) {
        if (got.len <= stage.len) {
            memcpy(got.buf, end - got.len, got.len);
        } else {
            Py_CLEAR(result);
            PyErr_SetString(PyExc_ValueError, "a staged call's result is past its staging array");
        }
        PyBuffer_Release(&got);
        Py_DECREF(recv);
    }
done:
    PyBuffer_Release(&stage);
    Py_DECREF(entry);
    return result;
}

static int
writes_x(Carrier *self)
{
    return self->kind == ALL_REDUCE || self->kind == REDUCE || self->kind == BROADCAST;
}

static PyObject *
Carrier_call(Carrier *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 5 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "carry(view, root, out, extra, word) takes 5 positional arguments");
        return NULL;
    }
    if (self->round == NULL || self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the carried path is gone");
        return NULL;
    }
    PyObject *view = args[0], *root_arg = args[1], *out = args[2];
    long long word = PyLong_AsLongLong(args[4]);
    if (word == -1 && PyErr_Occurred()) return NULL;
    int root = 0;
    if (root_arg != Py_None) {
        long value = PyLong_AsLong(root_arg);
        if (value == -1 && PyErr_Occurred()) return NULL;
        root = (int)value;
    }
    Py_buffer x;
    int flags = PyBUF_C_CONTIGUOUS | (writes_x(self) ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(view, &x, flags) < 0) {
        PyErr_Clear();   /* not the common case: the Python carry, before anything is written */
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    }
    if (rooted(self->kind) && (root < 0 || root >= self->round->size)) {
        PyBuffer_Release(&x);
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    }
    /* x larger than the block: the round of the word alone (every rank of this call has x of
     * the same size: the word hashes its shape and dtype), the call then runs as usual */
    int fits = x.len <= round_write_room(self->round);
    round_wants(self->round, x.len);
    if (fits && (!reads_root_only(self->kind) || root == self->round->rank))
        memcpy(round_own_payload(self->round), x.buf, x.len);
    int64_t reduced;
    int failed = round_run(self->round, (int64_t)word | CARRIED_BIT, Py_None, &reduced);
    PyObject *result = NULL, *got = NULL;
    if (failed < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (reduced >= 0 || (reduced & WORD_BITS) != word) {  /* a rank off the fast path, or another call */
        PyBuffer_Release(&x);
        got = PyLong_FromLongLong(reduced & WORD_BITS);
        Py_INCREF(self->not_taken);
        result = self->not_taken;
    } else {
        result = fits ? make(self, view, &x, root, out) : staged_call(self, view, &x, root, out);
        PyBuffer_Release(&x);
        if (result == NULL) return NULL;
        got = PyLong_FromLongLong(word);
    }
    if (got == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    PyObject *pair = PyTuple_Pack(2, got, result);
    Py_DECREF(got);
    Py_DECREF(result);
    return pair;
}

PyObject *
Carrier_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return Carrier_call((Carrier *)self, args, nargsf, kwnames);
}

static PyObject *
Carrier_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Carrier *self = (Carrier *)type->tp_alloc(type, 0);
    if (self != NULL) self->vectorcall = Carrier_vectorcall;
    return (PyObject *)self;
}

PyTypeObject CarrierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.backends._carried.Carrier",
    .tp_doc = PyDoc_STR("carry(view, root, out, extra, word) -> (AND of the ranks' words, result or NOT_TAKEN):\n"
                        "backends/mpi_carried.py's carry, compiled"),
    .tp_basicsize = sizeof(Carrier),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Carrier_traverse,
    .tp_clear = (inquiry)Carrier_clear,
    .tp_vectorcall_offset = offsetof(Carrier, vectorcall),
    .tp_new = Carrier_new,
    .tp_init = (initproc)Carrier_init,
    .tp_dealloc = (destructor)Carrier_dealloc,
    .tp_call = PyVectorcall_Call,  /* (a call with keywords, or through tp_call) */
};

static PyMethodDef module_functions[] = {
    {"bind_mpi", bind_mpi, METH_O,
     PyDoc_STR("bind_mpi(MPI) -> whether the round calls MPI_Start and MPI_Test itself (the process's, else mpi4py's library's)")},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "collectives.backends._carried",
    PyDoc_STR("backends/mpi_carried.py's carried call, compiled (optional)"), -1, module_functions,
};

PyMODINIT_FUNC
PyInit__carried(void)
{
    if ((s_data_ptr = PyUnicode_InternFromString("data_ptr")) == NULL ||
        (s_nbytes = PyUnicode_InternFromString("nbytes")) == NULL ||
        (s_timeout = PyUnicode_InternFromString("timeout")) == NULL ||
        (s_shape = PyUnicode_InternFromString("shape")) == NULL || PyType_Ready(&CarrierType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
#ifdef Py_GIL_DISABLED
    /* (free-threaded CPython: it needs the GIL, which loading it turns on) */
    if (PyUnstable_Module_SetGIL(m, Py_MOD_GIL_USED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    if (round_types_ready(m) < 0 || check_types_ready(m) < 0 || p2p_types_ready(m) < 0 ||
        uneven_types_ready(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CarrierType);
    if (PyModule_AddIntConstant(m, "VERSION", CARRIED_VERSION) < 0 ||
        PyModule_AddObject(m, "Carrier", (PyObject *)&CarrierType) < 0) {
        Py_DECREF(&CarrierType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
