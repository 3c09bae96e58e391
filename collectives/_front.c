/* Communicator._run, compiled: the one call path's steps for a call whose kind has a plan, in
 * one crossing of the Python/C boundary where the Python form interprets some 150 bytecodes.
 *
 * A Front is made per communicator by collectives/front.py and set as the communicator's `_run`
 * (an instance attribute over the class's method). It runs the same steps, in the same order,
 * with the same calls into the communicator's parts as Communicator._run (collectives/
 * communicator.py), which is the reference: the steps are C, every part they call (the plan's
 * check, fast path, carried path, the check, the flight recorder's ring, the hooks, the
 * transport's method, the error mapping) is the same Python (or compiled) callable.
 *
 * What it does not take, it hands to Communicator._run before any step has run: keyword
 * arguments, a call's own timeout=, an async_op that is not a bool, a communicator that is
 * closed, unusable or used from another thread (the Python form raises or lets it pass), and
 * a kind of x with no plan yet (the Python form makes it; the next call of the kind comes here).
 *
 * The communicator's state is read from its __dict__ on every call (the same attributes the
 * Python form reads: `_gate`, `_plans`, `_seq`, `_ring`, `_checking`, ...), so what the other
 * parts set there is seen here.
 *
 * Optional: where it cannot be built, Communicator._run runs (COLLECTIVES_COMPILED=0 too).
 */
#include "_front.h"

#include <structmember.h>

/* Interned attribute names. */
PyObject *s_gate, *s_plans, *s_dtype, *s_checks, *s_check_rank, *s_check_out, *s_shape,
    *s_pending, *s_reap, *s_seq, *s_operation, *s_ring, *s_append, *s_checking,
    *s_carry_call, *s_check_call, *s_debug, *s_p2p, *s_run, *s_x, *s_root, *s_out,
    *s_async_op, *s_extra, *s_carried, *s_view, *s_hooks, *s_call_hooks, *s_keep, *s_handles, *s_keep_p2p,
    *s_raise_failed, *s_name, *s_check, *s_in_place, *s_collective, *s_counted, *s_out_shape, *s_numpy,
    *s_posting, *s_stream_ordered, *s_post_call;
PyObject *front_zero, *front_one;

#define FRONT_FIELDS(X) X(comm) X(dict) X(python_run) X(not_taken) X(started) X(posted) \
    X(work_type) X(clock) X(counted) X(host_view) X(numpy) X(rows) X(out_shapes) X(torch_host_view) X(torch)

static int
Front_traverse(Front *self, visitproc visit, void *arg)
{
#define VISIT(field) Py_VISIT(self->field);
    FRONT_FIELDS(VISIT)
#undef VISIT
    return front_views_traverse(self, visit, arg);
}

static int
Front_clear(Front *self)
{
#define CLEAR(field) Py_CLEAR(self->field);
    FRONT_FIELDS(CLEAR)
#undef CLEAR
    front_views_clear(self);
    return 0;
}

static void
Front_dealloc(Front *self)
{
    PyObject_GC_UnTrack(self);
    Front_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void
row_free(PyObject *capsule)
{
    Row *row = PyCapsule_GetPointer(capsule, NULL);
    if (row == NULL) return;
    Py_XDECREF(row->name);
    Py_XDECREF(row->root);
    Py_XDECREF(row->check);
    PyMem_Free(row);
}

static int
flag(PyObject *call, PyObject *name, int *out)
{
    PyObject *value = PyObject_GetAttr(call, name);
    if (value == NULL) return -1;
    *out = PyObject_IsTrue(value);
    Py_DECREF(value);
    return *out < 0 ? -1 : 0;
}

/* The row of `call` (its fields read the first time), or NULL with an error. */
Row *
row_of(Front *self, PyObject *call)
{
    PyObject *capsule = PyDict_GetItemWithError(self->rows, call);
    if (capsule != NULL) return PyCapsule_GetPointer(capsule, NULL);
    if (PyErr_Occurred()) return NULL;
    Row *row = PyMem_Calloc(1, sizeof(Row));
    if (row == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    capsule = PyCapsule_New(row, NULL, row_free);
    if (capsule == NULL) {
        PyMem_Free(row);
        return NULL;
    }
    PyObject *out_shape = PyObject_GetAttr(call, s_out_shape);
    for (Py_ssize_t i = 0; out_shape != NULL && i < PyTuple_GET_SIZE(self->out_shapes); i++)
        if (PyTuple_GET_ITEM(self->out_shapes, i) == out_shape) row->out_kind = (int)i + 1;
    Py_XDECREF(out_shape);
    if (out_shape == NULL ||
        (row->name = PyObject_GetAttr(call, s_name)) == NULL || (row->root = PyObject_GetAttr(call, s_root)) == NULL ||
        (row->check = PyObject_GetAttr(call, s_check)) == NULL || flag(call, s_in_place, &row->in_place) < 0 ||
        flag(call, s_collective, &row->collective) < 0 || flag(call, s_counted, &row->counted) < 0 ||
        PyDict_SetItem(self->rows, call, capsule) < 0) {
        Py_DECREF(capsule);
        return NULL;
    }
    if (row->counted) row->out_kind = OUT_ROWS;
    PyObject *any_root = PyObject_GetAttrString(call, "any_root");
    row->any_root = any_root == Py_True;
    Py_XDECREF(any_root);
    PyErr_Clear();
    PyObject *below = PyObject_GetAttrString(row->check, "tags_below");
    row->tags_below = below != NULL && PyLong_CheckExact(below) ? PyLong_AsLong(below) : -1;
    Py_XDECREF(below);
    PyErr_Clear();  /* (a check without one, or None: it is called) */
    Py_DECREF(capsule); /* (the dict keeps it) */
    return row;
}

static PyObject *
Front_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Front *self = (Front *)type->tp_alloc(type, 0);
    if (self != NULL) self->vectorcall = Front_call;
    return (PyObject *)self;
}

static int
Front_init(Front *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"comm", "python_run", "not_taken", "started", "posted", "end", "state",
                             "work_type", "clock", "counted", "host_view", "numpy", "out_shapes",
                             "torch_host_view", "torch", NULL};
    PyObject *comm, *python_run, *not_taken, *started, *posted, *work_type, *clock, *counted, *host_view, *numpy,
        *out_shapes, *torch_host_view, *torch, *size;
    Py_ssize_t end, state_index;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOnnOOOOOO!OO", kwlist, &comm, &python_run, &not_taken,
                                     &started, &posted, &end, &state_index, &work_type, &clock, &counted, &host_view,
                                     &numpy, &PyTuple_Type, &out_shapes, &torch_host_view, &torch))
        return -1;
    if (!PyType_Check(work_type)) {
        PyErr_SetString(PyExc_TypeError, "work_type must be a type");
        return -1;
    }
    PyObject *dict = PyObject_GenericGetDict(comm, NULL);
    if (dict == NULL) return -1;
    if ((size = PyObject_GetAttrString(comm, "size")) == NULL) {
        Py_DECREF(dict);
        return -1;
    }
    self->size = PyLong_AsLong(size);
    Py_DECREF(size);
    PyObject *rank = self->size == -1 && PyErr_Occurred() ? NULL : PyObject_GetAttrString(comm, "rank");
    self->rank = rank ? PyLong_AsLong(rank) : -1;
    Py_XDECREF(rank);
    if (PyErr_Occurred()) {
        Py_DECREF(dict);
        return -1;
    }
    PyObject *rows = PyDict_New();
    if (rows == NULL) {
        Py_DECREF(dict);
        return -1;
    }
    Front_clear(self);
    self->comm = Py_NewRef(comm);
    self->dict = dict;
    self->python_run = Py_NewRef(python_run);
    self->not_taken = Py_NewRef(not_taken);
    self->started = Py_NewRef(started);
    self->posted = Py_NewRef(posted);
    self->work_type = Py_NewRef(work_type);
    self->clock = Py_NewRef(clock);
    self->counted = Py_NewRef(counted);
    self->host_view = Py_NewRef(host_view);
    self->numpy = Py_NewRef(numpy);
    self->out_shapes = Py_NewRef(out_shapes);
    self->torch_host_view = Py_NewRef(torch_host_view);
    self->torch = Py_NewRef(torch);
    self->rows = rows;
    self->end = end;
    self->state = state_index;
    return 0;
}

/* Bound like the method it stands for: comm._run is the front itself. */
static PyObject *
Front_repr(Front *self)
{
    return PyUnicode_FromFormat("<compiled Communicator._run of %R>", self->comm);
}

static PyMemberDef Front_members[] = {
    {"taken", T_PYSSIZET, offsetof(Front, taken), READONLY, "the calls it ran itself (not handed over)"},
    {"viewed", T_PYSSIZET, offsetof(Front, viewed), READONLY, "the CPU tensors' views it took from its kept ones"},
    {NULL},
};

static PyTypeObject FrontType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._front.Front",
    .tp_doc = PyDoc_STR("Front(comm, python_run, ...)(call, x, op, root, out, async_op, extra=None, timeout=None):\n"
                        "Communicator._run of comm, compiled (collectives/front.py)"),
    .tp_basicsize = sizeof(Front),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Front_traverse,
    .tp_clear = (inquiry)Front_clear,
    .tp_vectorcall_offset = offsetof(Front, vectorcall),
    .tp_new = Front_new,
    .tp_init = (initproc)Front_init,
    .tp_dealloc = (destructor)Front_dealloc,
    .tp_call = PyVectorcall_Call,  /* (a call with keywords, or through tp_call) */
    .tp_repr = (reprfunc)Front_repr,
    .tp_members = Front_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "collectives._front",
    PyDoc_STR("Communicator._run, compiled (optional; collectives/front.py)"), -1, NULL,
};

static int
intern_all(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_gate, "_gate"}, {&s_plans, "_plans"}, {&s_dtype, "dtype"}, {&s_checks, "_checks"},
        {&s_check_rank, "check_rank"}, {&s_check_out, "check_out"}, {&s_shape, "shape"},
        {&s_pending, "_pending"}, {&s_reap, "_reap"}, {&s_seq, "_seq"}, {&s_operation, "_operation"},
        {&s_ring, "_ring"}, {&s_append, "append"}, {&s_checking, "_checking"},
        {&s_carry_call, "_carry_call"}, {&s_check_call, "_check_call"},
        {&s_debug, "debug"}, {&s_p2p, "_p2p"}, {&s_run, "run"}, {&s_x, "x"}, {&s_root, "root"}, {&s_out, "out"},
        {&s_async_op, "async_op"}, {&s_extra, "extra"}, {&s_carried, "carried"}, {&s_view, "view"}, {&s_hooks, "_hooks"},
        {&s_call_hooks, "_call_hooks"}, {&s_keep, "_keep"}, {&s_handles, "_handles"}, {&s_keep_p2p, "keep_p2p"},
        {&s_raise_failed, "_raise_failed"}, {&s_name, "name"}, {&s_check, "check"}, {&s_in_place, "in_place"},
        {&s_collective, "collective"}, {&s_counted, "counted"}, {&s_out_shape, "out_shape"}, {&s_numpy, "numpy"},
        {&s_posting, "_posting"}, {&s_stream_ordered, "_stream_ordered"}, {&s_post_call, "_post_call"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) return -1;
    if ((front_one = PyLong_FromLong(1)) == NULL) return -1;
    return (front_zero = PyFloat_FromDouble(0.0)) == NULL ? -1 : 0;
}

PyMODINIT_FUNC
PyInit__front(void)
{
    if (intern_all() < 0 || front_views_ready() < 0 || PyType_Ready(&FrontType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
#ifdef Py_GIL_DISABLED
    /* (free-threaded CPython: it needs the GIL, which loading it turns on) */
    if (PyUnstable_Module_SetGIL(m, Py_MOD_GIL_USED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    if (method_type_ready(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&FrontType);
    if (PyModule_AddIntConstant(m, "VERSION", FRONT_VERSION) < 0 ||
        PyModule_AddObject(m, "Front", (PyObject *)&FrontType) < 0) {
        Py_DECREF(&FrontType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
