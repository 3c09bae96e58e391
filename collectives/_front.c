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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>
#include <stddef.h>

/* The module's interface, as collectives/front.py expects it (FRONT_VERSION there). */
#define FRONT_VERSION 1

/* A Call row's fields the steps read (collectives/calls.py; its rows are frozen). */
typedef struct {
    PyObject *name, *root, *check;
    int in_place, collective, counted;
} Row;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *comm;        /* the communicator */
    PyObject *dict;        /* its __dict__: the call path's state */
    PyObject *python_run;  /* Communicator._run (the reference): what this front hands over */
    PyObject *not_taken;   /* collectives.calls.NOT_TAKEN */
    PyObject *started;     /* the recorder's STARTED and POSTED states */
    PyObject *posted;
    PyObject *work_type;   /* collectives.work.Work */
    PyObject *clock;       /* the recorder's clock */
    PyObject *counted;     /* collectives.emulations.counted */
    PyObject *rows;        /* {call: capsule of its Row}: a row's fields read once */
    Py_ssize_t end, state; /* the record's END and STATE fields */
    Py_ssize_t taken;      /* the calls it ran itself (not handed over) */
    long size;
} Front;

/* Interned attribute names. */
static PyObject *s_gate, *s_plans, *s_dtype, *s_checks, *s_check_rank, *s_check_out, *s_shape,
    *s_pending, *s_reap, *s_seq, *s_operation, *s_ring, *s_append, *s_checking, *s_nbytes,
    *s_carry_bytes, *s_carry_call, *s_check_call, *s_debug, *s_p2p, *s_run, *s_x, *s_root, *s_out,
    *s_async_op, *s_extra, *s_carried, *s_hooks, *s_call_hooks, *s_keep, *s_handles, *s_keep_p2p,
    *s_raise_failed, *s_name, *s_check, *s_in_place, *s_collective, *s_counted;
static PyObject *zero_float, *one;

#define FRONT_FIELDS(X) X(comm) X(dict) X(python_run) X(not_taken) X(started) X(posted) \
    X(work_type) X(clock) X(counted) X(rows)

static int
Front_traverse(Front *self, visitproc visit, void *arg)
{
#define VISIT(field) Py_VISIT(self->field);
    FRONT_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int
Front_clear(Front *self)
{
#define CLEAR(field) Py_CLEAR(self->field);
    FRONT_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void
Front_dealloc(Front *self)
{
    PyObject_GC_UnTrack(self);
    Front_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Communicator._run(comm, *args), as called. */
static PyObject *
hand_over(Front *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf) + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    PyObject *small[10], **stack = small;
    if (n + 1 > 10) {
        stack = PyMem_Malloc((size_t)(n + 1) * sizeof(PyObject *));
        if (stack == NULL) return PyErr_NoMemory();
    }
    stack[0] = self->comm;
    for (Py_ssize_t i = 0; i < n; i++) stack[i + 1] = args[i];
    PyObject *result = PyObject_Vectorcall(self->python_run, stack, PyVectorcall_NARGS(nargsf) + 1, kwnames);
    if (stack != small) PyMem_Free(stack);
    return result;
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
static Row *
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
    if ((row->name = PyObject_GetAttr(call, s_name)) == NULL || (row->root = PyObject_GetAttr(call, s_root)) == NULL ||
        (row->check = PyObject_GetAttr(call, s_check)) == NULL || flag(call, s_in_place, &row->in_place) < 0 ||
        flag(call, s_collective, &row->collective) < 0 || flag(call, s_counted, &row->counted) < 0 ||
        PyDict_SetItem(self->rows, call, capsule) < 0) {
        Py_DECREF(capsule);
        return NULL;
    }
    Py_DECREF(capsule); /* (the dict keeps it) */
    return row;
}

/* comm.<name>, from its __dict__ (borrowed), or NULL with AttributeError. */
static PyObject *
state(Front *self, PyObject *name)
{
    PyObject *value = PyDict_GetItemWithError(self->dict, name);
    if (value == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
    return value;
}

/* Whether the call is one this front runs: the checks at the top of Communicator._run. */
static int
takes(Front *self, Py_ssize_t nargs, PyObject *kwnames, PyObject *const *args)
{
    if (kwnames != NULL || nargs < 6 || nargs > 8) return 0;
    if (nargs == 8 && args[7] != Py_None) return 0;             /* timeout= */
    if (args[5] != Py_False && args[5] != Py_True) return 0;    /* async_op */
    PyObject *gate = PyDict_GetItem(self->dict, s_gate);         /* (borrowed; no error) */
    if (gate == NULL || !PyLong_CheckExact(gate)) return 0;
    unsigned long id = PyLong_AsUnsignedLong(gate);
    if (id == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return id == PyThread_get_thread_ident();
}

static PyObject *call0(PyObject *fn) { return PyObject_CallNoArgs(fn); }

/* The exception being handled (sys.exception()), a new reference or NULL, and setting it. */
#if PY_VERSION_HEX >= 0x030B0000
#define get_handled PyErr_GetHandledException
#define set_handled PyErr_SetHandledException
#else /* Python 3.10 */
static PyObject *
get_handled(void)
{
    PyObject *type, *value, *traceback;
    PyErr_GetExcInfo(&type, &value, &traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
}

static void
set_handled(PyObject *error)
{
    if (error == NULL || error == Py_None)
        PyErr_SetExcInfo(NULL, NULL, NULL);
    else
        PyErr_SetExcInfo(Py_NewRef((PyObject *)Py_TYPE(error)), Py_NewRef(error), PyException_GetTraceback(error));
}
#endif

/* The steps from the number to the result: Communicator._run after its plan is found. */
static PyObject *
run_planned(Front *self, Row *row, PyObject *call, PyObject *x, PyObject *op, PyObject *root, PyObject *out,
            PyObject *async_op, PyObject *extra, PyObject *plan)
{
    PyObject *check = PyTuple_GET_ITEM(plan, 0), *fast = PyTuple_GET_ITEM(plan, 1);
    PyObject *carry = PyTuple_GET_ITEM(plan, 2), *adapter = PyTuple_GET_ITEM(plan, 3);
    PyObject *dtype = PyTuple_GET_ITEM(plan, 4), *reduce_op = PyTuple_GET_ITEM(plan, 5);
    PyObject *request = PyTuple_GET_ITEM(plan, 6), *method = PyTuple_GET_ITEM(plan, 7);
    PyObject *comm = self->comm, *view = NULL, *record = NULL, *result = NULL, *got;

    /* What can differ between two arrays of one kind, checked on every call. */
    PyObject *check_args[2] = {x, row->in_place ? Py_True : Py_False};
    if ((view = PyObject_Vectorcall(check, check_args, 2, NULL)) == NULL) return NULL;
    if (row->root != Py_None) {
        long r = PyLong_CheckExact(root) ? PyLong_AsLong(root) : -1;
        if (r == -1 && PyErr_Occurred()) PyErr_Clear();
        if (!PyLong_CheckExact(root) || r < 0 || r >= self->size) {
            PyObject *checks = state(self, s_checks);
            if (checks == NULL) goto fail;
            PyObject *a[3] = {checks, root, row->root};
            if ((got = PyObject_VectorcallMethod(s_check_rank, a, 3, NULL)) == NULL)
                goto fail;
            Py_DECREF(got);
        }
    }
    if (row->check != Py_None) {
        PyObject *shape = PyObject_GetAttr(x, s_shape), *tuple;
        if (shape == NULL) goto fail;
        tuple = PySequence_Tuple(shape);
        Py_DECREF(shape);
        if (tuple == NULL) goto fail;
        PyObject *a[4] = {comm, tuple, extra, root};
        got = PyObject_Vectorcall(row->check, a, 4, NULL);
        Py_DECREF(tuple);
        if (got == NULL) goto fail;
        Py_DECREF(got);
    }
    if (out != Py_None) {
        PyObject *checks = state(self, s_checks);
        if (checks == NULL) goto fail;
        PyObject *a[7] = {checks, call, x, adapter, out, extra, root};
        if ((got = PyObject_VectorcallMethod(s_check_out, a, 7, NULL)) == NULL)
            goto fail;
        Py_DECREF(got);
    }
    PyObject *pending = state(self, s_pending);
    if (pending == NULL) goto fail;
    int truth = PyObject_IsTrue(pending);
    if (truth < 0) goto fail;
    if (truth) {
        PyObject *reap = state(self, s_reap);
        if (reap == NULL || (got = call0(reap)) == NULL) goto fail;
        Py_DECREF(got);
    }
    PyObject *seq = state(self, s_seq);
    if (seq == NULL) goto fail;
    if (row->collective) {
        PyObject *next = PyNumber_Add(seq, one);
        if (next == NULL) goto fail;
        int set = PyDict_SetItem(self->dict, s_seq, next);
        Py_DECREF(next);
        if (set < 0 || (seq = state(self, s_seq)) == NULL) goto fail;
    }
    Py_INCREF(seq); /* (the record's; the dict may change under a callee) */
    if (PyDict_SetItem(self->dict, s_operation, row->name) < 0) {
        Py_DECREF(seq);
        goto fail;
    }
    PyObject *ring = state(self, s_ring);
    if (ring == NULL) {
        Py_DECREF(seq);
        goto fail;
    }
    if (ring != Py_None) { /* the flight recorder: a call with an end time and no error has completed */
        PyObject *shape = PyObject_GetAttr(view == Py_None ? x : view, s_shape), *now;
        if (shape == NULL || (now = call0(self->clock)) == NULL) {
            Py_XDECREF(shape);
            Py_DECREF(seq);
            goto fail;
        }
        record = PyList_New(11);
        if (record == NULL) {
            Py_DECREF(shape);
            Py_DECREF(now);
            Py_DECREF(seq);
            goto fail;
        }
        PyObject *items[11] = {seq, call, dtype, shape, root, self->started, now, zero_float, Py_None, Py_None,
                               reduce_op};
        for (int i = 0; i < 11; i++) {
            if (i != 0 && i != 3 && i != 6) Py_INCREF(items[i]); /* (seq, shape and now are owned) */
            PyList_SET_ITEM(record, i, items[i]);
        }
        Py_INCREF(ring);
        PyObject *a[2] = {ring, record};
        got = PyObject_VectorcallMethod(s_append, a, 2, NULL);
        Py_DECREF(ring);
        if (got == NULL) goto fail;
        Py_DECREF(got);
    } else {
        Py_DECREF(seq);
    }

    /* The try block: an Exception raised here goes through the context's raise_failed. */
    int on_fast_path = view != Py_None && async_op == Py_False;
    PyObject *checking = state(self, s_checking);
    if (checking == NULL || (truth = PyObject_IsTrue(checking)) < 0) goto failed;
    if (truth && row->collective) {
        int carried = 0;
        if (on_fast_path && carry != Py_None) {
            PyObject *nbytes = PyObject_GetAttr(view, s_nbytes), *limit = state(self, s_carry_bytes);
            if (nbytes == NULL || limit == NULL) {
                Py_XDECREF(nbytes);
                goto failed;
            }
            carried = PyObject_RichCompareBool(nbytes, limit, Py_LE);
            Py_DECREF(nbytes);
            if (carried < 0) goto failed;
        }
        if (carried) {
            PyObject *carry_call = state(self, s_carry_call);
            if (carry_call == NULL) goto failed;
            PyObject *a[8] = {carry, call, reduce_op, root, dtype, view, out, extra};
            result = PyObject_Vectorcall(carry_call, a, 8, NULL);
        } else {
            PyObject *check_call = state(self, s_check_call), *shape;
            if (check_call == NULL || (shape = PyObject_GetAttr(x, s_shape)) == NULL) goto failed;
            PyObject *a[7] = {call, reduce_op, root, dtype, shape, Py_None, on_fast_path ? Py_True : Py_False};
            got = PyObject_Vectorcall(check_call, a, 7, NULL);
            Py_DECREF(shape);
            if (got == NULL) goto failed;
            Py_DECREF(got);
            result = Py_NewRef(self->not_taken);
        }
        if (result == NULL) goto failed;
    } else {
        result = Py_NewRef(self->not_taken);
    }
    if (result != self->not_taken) {
        /* x travelled in the check's round (see Transport._carried_path) */
    } else if (on_fast_path) {
        Py_DECREF(result);
        PyObject *a[4] = {view, root, out, extra};
        if ((result = PyObject_Vectorcall(fast, a, 4, NULL)) == NULL) goto failed;
    }
    if (result == self->not_taken) {
        PyObject *debug = state(self, s_debug);
        if (debug == NULL || (truth = PyObject_IsTrue(debug)) < 0) goto failed;
        Py_DECREF(result);
        result = NULL;
        if (truth && !row->collective) {
            PyObject *p2p = state(self, s_p2p);
            if (p2p == NULL) goto failed;
            PyObject *a[8] = {p2p, call, x, adapter, dtype, root, async_op, extra};
            result = PyObject_VectorcallMethod(s_run, a, 8, NULL);
        } else { /* the row's transport method, its Request refilled */
            if (PyObject_SetAttr(request, s_x, x) < 0 || PyObject_SetAttr(request, s_root, root) < 0 ||
                PyObject_SetAttr(request, s_out, out) < 0 || PyObject_SetAttr(request, s_async_op, async_op) < 0 ||
                PyObject_SetAttr(request, s_extra, extra) < 0)
                goto failed;
            if (row->counted) {
                PyObject *a[2] = {comm, request};
                if ((got = PyObject_Vectorcall(self->counted, a, 2, NULL)) == NULL) goto failed;
                Py_DECREF(got);
            }
            if ((result = PyObject_CallOneArg(method, request)) == NULL) goto failed;
            if (PyObject_SetAttr(request, s_x, Py_None) < 0 || PyObject_SetAttr(request, s_out, Py_None) < 0 ||
                PyObject_SetAttr(request, s_carried, Py_None) < 0)
                goto failed;
        }
        if (result == NULL) goto failed;
    }
    Py_CLEAR(view);

    if (record != NULL) {
        PyObject *now = call0(self->clock);
        if (now == NULL || PyList_SetItem(record, self->end, now) < 0) goto fail;
        PyObject *hooks = state(self, s_hooks);
        if (hooks == NULL || (truth = PyObject_IsTrue(hooks)) < 0) goto fail;
        if (truth) {
            PyObject *a[2] = {comm, record};
            if ((got = PyObject_VectorcallMethod(s_call_hooks, a, 2, NULL)) == NULL)
                goto fail;
            Py_DECREF(got);
        }
    }
    if (async_op == Py_True) {
        if (Py_TYPE(result) != (PyTypeObject *)self->work_type) { /* a handle that may still be running */
            if (record != NULL && PyList_SetItem(record, self->state, Py_NewRef(self->posted)) < 0) goto fail;
            if (row->collective) {
                PyObject *keep = state(self, s_keep);
                if (keep == NULL) goto fail;
                PyObject *a[2] = {result, record == NULL ? Py_None : record};
                got = PyObject_Vectorcall(keep, a, 2, NULL);
            } else {
                PyObject *handles = state(self, s_handles);
                if (handles == NULL) goto fail;
                PyObject *a[2] = {handles, result};
                got = PyObject_VectorcallMethod(s_keep_p2p, a, 2, NULL);
            }
            if (got == NULL) goto fail;
            Py_DECREF(got);
        }
        Py_XDECREF(record);
        return result;
    }
    Py_XDECREF(record);
    if (row->in_place) {
        Py_DECREF(result);
        return Py_NewRef(x);
    }
    return result;

failed: /* inside the try block: an Exception becomes what the context's raise_failed raises */
    Py_XDECREF(result);
    result = NULL;
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyObject *type, *error, *traceback;
        PyErr_Fetch(&type, &error, &traceback);
        PyErr_NormalizeException(&type, &error, &traceback);
        if (traceback != NULL) PyException_SetTraceback(error, traceback);
        Py_XDECREF(type);
        Py_XDECREF(traceback);
        PyObject *raise_failed = state(self, s_raise_failed);
        if (raise_failed != NULL) {
            /* as in the Python form's except block: the error is the one being handled */
            PyObject *handled = get_handled();
            set_handled(error);
            PyObject *a[2] = {record == NULL ? Py_None : record, error};
            got = PyObject_Vectorcall(raise_failed, a, 2, NULL);
            set_handled(handled);
            Py_XDECREF(handled);
            if (got != NULL) { /* (it always raises) */
                Py_DECREF(got);
                PyErr_SetString(PyExc_SystemError, "raise_failed returned");
            }
        }
        Py_DECREF(error);
    }
fail:
    Py_XDECREF(result);
    Py_XDECREF(view);
    Py_XDECREF(record);
    return NULL;
}

static PyObject *
Front_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Front *self = (Front *)self_;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (!takes(self, nargs, kwnames, args)) return hand_over(self, args, nargsf, kwnames);
    PyObject *call = args[0], *x = args[1], *op = args[2];
    /* a kind of x (type, dtype, and op) that passed the checks before: its plan */
    PyObject *plans = PyDict_GetItem(self->dict, s_plans), *dtype, *key, *plan;
    if (plans == NULL || !PyDict_CheckExact(plans)) return hand_over(self, args, nargsf, kwnames);
    if ((dtype = PyObject_GetAttr(x, s_dtype)) == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
        return hand_over(self, args, nargsf, kwnames);
    }
    key = PyTuple_Pack(4, call, (PyObject *)Py_TYPE(x), dtype, op);
    Py_DECREF(dtype);
    if (key == NULL) return NULL;
    plan = PyDict_GetItemWithError(plans, key);
    Py_DECREF(key);
    if (plan == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) return NULL;
            PyErr_Clear();
        }
        return hand_over(self, args, nargsf, kwnames);
    }
    if (!PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 8) return hand_over(self, args, nargsf, kwnames);
    Row *row = row_of(self, call);
    if (row == NULL) return NULL;
    Py_INCREF(plan);
    self->taken++;
    PyObject *result = run_planned(self, row, call, x, op, args[3], args[4], args[5], nargs > 6 ? args[6] : Py_None,
                                   plan);
    Py_DECREF(plan);
    return result;
}

static PyObject *
Front_tp_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
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
                             "work_type", "clock", "counted", NULL};
    PyObject *comm, *python_run, *not_taken, *started, *posted, *work_type, *clock, *counted, *size;
    Py_ssize_t end, state_index;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOnnOOO", kwlist, &comm, &python_run, &not_taken, &started,
                                     &posted, &end, &state_index, &work_type, &clock, &counted))
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
    if (self->size == -1 && PyErr_Occurred()) {
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
    .tp_call = Front_tp_call,
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
        {&s_ring, "_ring"}, {&s_append, "append"}, {&s_checking, "_checking"}, {&s_nbytes, "nbytes"},
        {&s_carry_bytes, "_carry_bytes"}, {&s_carry_call, "_carry_call"}, {&s_check_call, "_check_call"},
        {&s_debug, "debug"}, {&s_p2p, "_p2p"}, {&s_run, "run"}, {&s_x, "x"}, {&s_root, "root"}, {&s_out, "out"},
        {&s_async_op, "async_op"}, {&s_extra, "extra"}, {&s_carried, "carried"}, {&s_hooks, "_hooks"},
        {&s_call_hooks, "_call_hooks"}, {&s_keep, "_keep"}, {&s_handles, "_handles"}, {&s_keep_p2p, "keep_p2p"},
        {&s_raise_failed, "_raise_failed"}, {&s_name, "name"}, {&s_check, "check"}, {&s_in_place, "in_place"},
        {&s_collective, "collective"}, {&s_counted, "counted"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) return -1;
    if ((one = PyLong_FromLong(1)) == NULL) return -1;
    return (zero_float = PyFloat_FromDouble(0.0)) == NULL ? -1 : 0;
}

PyMODINIT_FUNC
PyInit__front(void)
{
    if (intern_all() < 0 || PyType_Ready(&FrontType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&FrontType);
    if (PyModule_AddIntConstant(m, "VERSION", FRONT_VERSION) < 0 ||
        PyModule_AddObject(m, "Front", (PyObject *)&FrontType) < 0) {
        Py_DECREF(&FrontType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
