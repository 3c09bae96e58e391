/* send's and recv's fast paths (MPITransport._fast_point_to_point, backends/mpi.py), compiled: under
 * a timeout the nonblocking call on x's memory and its fast polls, then the channel's own wait.
 * The Python closures are the reference and run where this was not built, COLLECTIVES_COMPILED=0,
 * and for what is not the common case here (no timeout: the blocking call; x not one contiguous
 * buffer, or past MAX_COUNT bytes: NOT_TAKEN there). */
#include "_carried.h"

#include <stddef.h>

static PyObject *s_timeout, *s_Test, *s_wait, *s_complete_request, *s_context, *s_call, *s_Get_count, *s_shape;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int receives, polls;     /* recv (else send); the tests before the channel's wait */
    Py_ssize_t most;         /* the bytes a call takes at most (MAX_COUNT) */
    PyObject *start;         /* comm.Irecv or comm.Isend */
    PyObject *byte;          /* MPI.BYTE */
    PyObject *channel;       /* the MPIChannel: timeout, _wait, _complete_request, context */
    PyObject *status;        /* recv: the MPI.Status its tests fill */
    PyObject *fallback;      /* the Python closure */
    PyObject *short_message; /* recv: short_message(src, tag, got, holds, shape) -> the error */
} PointToPoint;

#define P2P_FIELDS(X) X(start) X(byte) X(channel) X(status) X(fallback) X(short_message)
GC_FIELDS(PointToPoint, P2P_FIELDS)

static void
PointToPoint_dealloc(PointToPoint *self)
{
    PyObject_GC_UnTrack(self);
    PointToPoint_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The request complete: its fast polls, else the channel's wait (timeout, farewells). */
static int
complete(PointToPoint *self, PyObject *request)
{
    PyObject *test = PyObject_GetAttr(request, s_Test), *r;
    if (test == NULL) return -1;
    int done = 0;
    for (int i = 0; i < self->polls && !done; i++) {
        r = self->receives ? PyObject_CallOneArg(test, self->status) : PyObject_CallNoArgs(test);
        done = r == NULL ? -1 : PyObject_IsTrue(r);
        Py_XDECREF(r);
    }
    Py_DECREF(test);
    if (done) return done < 0 ? -1 : 0;
    if (!self->receives) {
        r = PyObject_CallMethodOneArg(self->channel, s_wait, request);
    } else {
        PyObject *context = PyObject_GetAttr(self->channel, s_context);
        PyObject *call = context ? PyObject_GetAttr(context, s_call) : NULL;
        Py_XDECREF(context);
        r = call ? PyObject_CallMethodObjArgs(self->channel, s_complete_request, request, call, self->status, NULL)
                 : NULL;
        Py_XDECREF(call);
    }
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* p2p(buf, peer, out, tag) -> None (send), buf (recv), or the closure's answer */
static PyObject *
PointToPoint_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PointToPoint *self = (PointToPoint *)op;
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the fast path is gone");
        return NULL;
    }
    if (PyVectorcall_NARGS(nargsf) != 4 || kwnames != NULL)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *buf = args[0], *peer = args[1], *tag = args[3];
    PyObject *timeout = PyObject_GetAttr(self->channel, s_timeout);
    if (timeout == NULL) return NULL;
    int blocking = timeout == Py_None;
    Py_DECREF(timeout);
    Py_buffer view;
    if (blocking || PyObject_GetBuffer(buf, &view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    }
    Py_ssize_t holds = view.len;
    PyBuffer_Release(&view);
    if (holds > self->most) return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *spec = PyList_New(2);
    if (spec == NULL) return NULL;
    PyList_SET_ITEM(spec, 0, Py_NewRef(buf));
    PyList_SET_ITEM(spec, 1, Py_NewRef(self->byte));
    PyObject *start_args[3] = {spec, peer, tag};
    PyObject *request = PyObject_Vectorcall(self->start, start_args, 3, NULL);
    Py_DECREF(spec);
    if (request == NULL) return NULL;
    int failed = complete(self, request);
    Py_DECREF(request);
    if (failed) return NULL;
    if (!self->receives) Py_RETURN_NONE;
    PyObject *got = PyObject_CallMethodOneArg(self->status, s_Get_count, self->byte);
    if (got == NULL) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(got);
    if (n == -1 && PyErr_Occurred()) {
        Py_DECREF(got);
        return NULL;
    }
    if (n == holds) {
        Py_DECREF(got);
        return Py_NewRef(buf);
    }
    PyObject *shape = PyObject_GetAttr(buf, s_shape), *error = NULL, *holds_obj = PyLong_FromSsize_t(holds);
    if (shape != NULL && holds_obj != NULL)
        error = PyObject_CallFunctionObjArgs(self->short_message, peer, tag, got, holds_obj, shape, NULL);
    Py_DECREF(got);
    Py_XDECREF(shape);
    Py_XDECREF(holds_obj);
    if (error != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(error), error);
        Py_DECREF(error);
    }
    return NULL;
}

static PyObject *
PointToPoint_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"receives", "start", "byte", "channel", "status", "fallback", "short_message", "most",
                            "polls", NULL};
    int receives, polls;
    PyObject *start, *byte, *channel, *status, *fallback, *short_message;
    Py_ssize_t most;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "pOOOOOOni", names, &receives, &start, &byte, &channel, &status,
                                     &fallback, &short_message, &most, &polls))
        return NULL;
    PointToPoint *self = (PointToPoint *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = PointToPoint_call;
    self->receives = receives;
    self->polls = polls;
    self->most = most;
    self->start = Py_NewRef(start);
    self->byte = Py_NewRef(byte);
    self->channel = Py_NewRef(channel);
    self->status = Py_NewRef(status);
    self->fallback = Py_NewRef(fallback);
    self->short_message = Py_NewRef(short_message);
    return (PyObject *)self;
}

static PyTypeObject PointToPointType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives.backends._carried.PointToPoint",
    .tp_doc = PyDoc_STR("PointToPoint(receives, start, byte, channel, status, fallback, short_message, most, "
                        "polls): p2p(buf, peer, out, tag), MPITransport._fast_point_to_point's closure, compiled"),
    .tp_basicsize = sizeof(PointToPoint),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(PointToPoint, vectorcall),
    .tp_new = PointToPoint_new,
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)PointToPoint_dealloc,
    .tp_traverse = (traverseproc)PointToPoint_traverse,
    .tp_clear = (inquiry)PointToPoint_clear,
};

int
p2p_types_ready(PyObject *module)
{
    if ((s_timeout = PyUnicode_InternFromString("timeout")) == NULL ||
        (s_Test = PyUnicode_InternFromString("Test")) == NULL ||
        (s_wait = PyUnicode_InternFromString("_wait")) == NULL ||
        (s_complete_request = PyUnicode_InternFromString("_complete_request")) == NULL ||
        (s_context = PyUnicode_InternFromString("context")) == NULL ||
        (s_call = PyUnicode_InternFromString("call")) == NULL ||
        (s_Get_count = PyUnicode_InternFromString("Get_count")) == NULL ||
        (s_shape = PyUnicode_InternFromString("shape")) == NULL)
        return -1;
    if (PyType_Ready(&PointToPointType) < 0) return -1;
    Py_INCREF(&PointToPointType);
    if (PyModule_AddObject(module, "PointToPoint", (PyObject *)&PointToPointType) < 0) {
        Py_DECREF(&PointToPointType);
        return -1;
    }
    return 0;
}
