/* Communicator._run's steps, compiled (the Front of collectives/_front.c calls Front_call): the
 * same steps in the same order as the Python form, calling the same parts; what it does not take
 * goes to the Python form (hand_over) before any step has run. */
#include "_front.h"

#include <string.h>

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

/* comm.<name>, from its __dict__ (borrowed), or NULL with AttributeError. */
static PyObject *
state(Front *self, PyObject *name)
{
    PyObject *value = PyDict_GetItemWithError(self->dict, name);
    if (value == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
    return value;
}

/* comm.<name>(*args), the attribute held while it runs (as the Python form's stack holds it). */
static PyObject *
call_state(Front *self, PyObject *name, PyObject *const *args, size_t n)
{
    PyObject *fn = state(self, name);
    if (fn == NULL) return NULL;
    Py_INCREF(fn);
    PyObject *got = PyObject_Vectorcall(fn, args, n, NULL);
    Py_DECREF(fn);
    return got;
}

/* comm.<name>.<method>(*args[1:]), the object held while it runs (args[0] is set to it here). */
static PyObject *
call_state_method(Front *self, PyObject *name, PyObject *method, PyObject **args, size_t n)
{
    PyObject *obj = state(self, name);
    if (obj == NULL) return NULL;
    Py_INCREF(obj);
    args[0] = obj;
    PyObject *got = PyObject_VectorcallMethod(method, args, n, NULL);
    Py_DECREF(obj);
    return got;
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

/* NumpyAdapter.host_view(x, in_place) where it returns x (a numpy array, C-contiguous, writable
 * where in_place): x, read through the buffer protocol; TorchAdapter.host_view(x, in_place) where
 * it returns x.numpy() (C-contiguous): that view, made or kept here (front_tensor_view; x's dtype
 * is `dtype`). NULL without an error where check is another check or x is not such an array (then
 * the check itself runs: its view, None or its error). */
static PyObject *
numpy_view(Front *self, PyObject *check, PyObject *x, PyObject *dtype, int in_place)
{
    if (!PyMethod_Check(check)) return NULL;
    PyObject *function = PyMethod_GET_FUNCTION(check), *adapter = PyMethod_GET_SELF(check);
    if (function == self->torch_host_view && adapter == self->torch) return front_tensor_view(self, x, dtype, in_place);
    if (function != self->host_view || adapter != self->numpy) return NULL;
    Py_buffer buffer;
    if (PyObject_GetBuffer(x, &buffer, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return NULL;
    }
    int usable = !(in_place && buffer.readonly);
    PyBuffer_Release(&buffer);
    return usable ? Py_NewRef(x) : NULL;
}

/* Whether checks.check_out would pass out= at its first test, for x with a host view (numpy_view:
 * x itself, or a CPU tensor's x.numpy()): an array of x's type whose memory is read the same way
 * (out.numpy() for a tensor, or its kept view, refuses what check_out refuses of its device,
 * layout, grad and negative bit), of x's dtype (its buffer's format), C-contiguous and writable, of the result's
 * shape (the row's out_kind); 0 where not, or where the row's shape is another (then check_out
 * itself runs: it passes, or names what is wrong). */
static int
out_fits(Front *self, Row *row, PyObject *check, PyObject *x, PyObject *view, PyObject *out, PyObject **out_view_kept)
{
    if (row->out_kind == OUT_OTHER || view == NULL || view == Py_None || Py_TYPE(out) != Py_TYPE(x)) return 0;
    PyObject *out_view;
    if (view == x) {
        out_view = Py_NewRef(out);
    } else if (PyMethod_Check(check) && PyMethod_GET_FUNCTION(check) == self->torch_host_view) {
        if ((out_view = front_tensor_view(self, out, NULL, 0)) == NULL) return 0;
    } else {
        return 0;
    }
    Py_buffer o, v;
    int got = PyObject_GetBuffer(out_view, &o, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    if (got < 0) {
        Py_DECREF(out_view);
        PyErr_Clear();
        return 0;
    }
    if (PyObject_GetBuffer(view, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&o);
        return 0;
    }
    Py_ssize_t want[65];
    int n = -1, xn = v.ndim;
    const Py_ssize_t *xs = v.shape;
    if (xn < 64) {
        switch (row->out_kind) {
        case OUT_STACKED:
            want[0] = self->size;
            for (int i = 0; i < xn; i++) want[i + 1] = xs[i];
            n = xn + 1;
            break;
        case OUT_BLOCK_OF_ROWS:
            if (xn < 1) break;
            want[0] = xs[0] / self->size;
            for (int i = 1; i < xn; i++) want[i] = xs[i];
            n = xn;
            break;
        case OUT_ONE_ROW:
            for (int i = 1; i < xn; i++) want[i - 1] = xs[i];
            n = xn > 0 ? xn - 1 : 0;
            break;
        case OUT_SAME_SHAPE:
            for (int i = 0; i < xn; i++) want[i] = xs[i];
            n = xn;
            break;
        case OUT_ROWS:
            if (xn < 1 || o.ndim < 1) break;
            want[0] = o.shape[0];
            for (int i = 1; i < xn; i++) want[i] = xs[i];
            n = xn;
        }
    }
    int fits = n == o.ndim && o.itemsize == v.itemsize && o.format != NULL && v.format != NULL &&
               strcmp(o.format, v.format) == 0;
    for (int i = 0; fits && i < n; i++) fits = o.shape[i] == want[i];
    PyBuffer_Release(&o);
    PyBuffer_Release(&v);
    if (fits && out_view != out) *out_view_kept = out_view; /* (a tensor's: see run_planned) */
    else Py_DECREF(out_view);
    return fits;
}

/* Whether a send's or recv's check would pass at its first test (calls.peer_and_tag): an int tag
 * from 0 to below the row's tags_below, a peer (valid: checked before) that is not this rank. */
static int
usual_tag(Front *self, Row *row, PyObject *tag, PyObject *peer)
{
    if (row->tags_below < 0 || !PyLong_CheckExact(tag) || !PyLong_CheckExact(peer)) return 0;
    long t = PyLong_AsLong(tag), p = PyLong_AsLong(peer);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 0 <= t && t < row->tags_below && p != self->rank;
}

/* The steps from the number to the result: Communicator._run after its plan is found. An argument
 * the checks refuse (their TypeError or ValueError) sets *refused, the error cleared: the caller hands
 * the call to the Python form, whose same checks raise it after the refused call's check round. */
static PyObject *
run_planned(Front *self, Row *row, PyObject *call, PyObject *x, PyObject *xdtype, PyObject *root, PyObject *out,
            PyObject *async_op, PyObject *extra, PyObject *plan, int *refused)
{
    PyObject *check = PyTuple_GET_ITEM(plan, 0), *fast = PyTuple_GET_ITEM(plan, 1);
    PyObject *carry = PyTuple_GET_ITEM(plan, 2), *adapter = PyTuple_GET_ITEM(plan, 3);
    PyObject *dtype = PyTuple_GET_ITEM(plan, 4), *reduce_op = PyTuple_GET_ITEM(plan, 5);
    PyObject *request = PyTuple_GET_ITEM(plan, 6), *method = PyTuple_GET_ITEM(plan, 7);
    PyObject *comm = self->comm, *view = NULL, *out_view = NULL, *record = NULL, *result = NULL, *got;

    /* What can differ between two arrays of one kind, checked on every call. */
    if ((view = numpy_view(self, check, x, xdtype, row->in_place)) == NULL) {
        PyObject *check_args[2] = {x, row->in_place ? Py_True : Py_False};
        if ((view = PyObject_Vectorcall(check, check_args, 2, NULL)) == NULL) goto refuse;
    }
    if (row->root != Py_None && !(root == Py_None && row->any_root)) {
        long r = PyLong_CheckExact(root) ? PyLong_AsLong(root) : -1;
        if (r == -1 && PyErr_Occurred()) PyErr_Clear();
        if (!PyLong_CheckExact(root) || r < 0 || r >= self->size) {
            PyObject *a[3] = {NULL, root, row->root};
            if ((got = call_state_method(self, s_checks, s_check_rank, a, 3)) == NULL) goto refuse;
            Py_DECREF(got);
        }
    }
    if (row->check != Py_None && !usual_tag(self, row, extra, root)) {
        PyObject *shape = PyObject_GetAttr(x, s_shape), *tuple;
        if (shape == NULL) goto refuse;
        tuple = PySequence_Tuple(shape);
        Py_DECREF(shape);
        if (tuple == NULL) goto refuse;
        PyObject *a[4] = {comm, tuple, extra, root};
        got = PyObject_Vectorcall(row->check, a, 4, NULL);
        Py_DECREF(tuple);
        if (got == NULL) goto refuse;
        Py_DECREF(got);
    }
    if (out != Py_None && !out_fits(self, row, check, x, view, out, &out_view)) {
        PyObject *a[7] = {NULL, call, x, adapter, out, extra, root};
        if ((got = call_state_method(self, s_checks, s_check_out, a, 7)) == NULL) goto refuse;
        Py_DECREF(got);
    }
    PyObject *pending = state(self, s_pending);
    if (pending == NULL) goto fail;
    int truth = PyObject_IsTrue(pending);
    if (truth < 0) goto fail;
    if (truth) {
        if ((got = call_state(self, s_reap, NULL, 0)) == NULL) goto fail;
        Py_DECREF(got);
    }
    PyObject *seq = state(self, s_seq);
    if (seq == NULL) goto fail;
    if (row->collective) {
        PyObject *next = PyNumber_Add(seq, front_one);
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
        if (shape == NULL || (now = PyObject_CallNoArgs(self->clock)) == NULL) {
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
        PyObject *items[11] = {seq, call, dtype, shape, root, self->started, now, front_zero, Py_None, Py_None,
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
    int on_fast_path = view != Py_None && async_op == Py_False && !row->counted && root != Py_None;
    PyObject *checking = state(self, s_checking);
    if (checking == NULL || (truth = PyObject_IsTrue(checking)) < 0) goto failed;
    if (truth && row->collective) {
        if (on_fast_path && carry != Py_None) { /* (carried where x fits its round) */
            /* an out= tensor goes as its numpy view, written through its buffer; the result is out */
            PyObject *a[8] = {carry, call, reduce_op, root, dtype, view, out_view != NULL ? out_view : out, extra};
            result = call_state(self, s_carry_call, a, 8);
            if (result != NULL && result == out_view) Py_SETREF(result, Py_NewRef(out));
        } else {
            /* (beside a call on a device stream where the transport posts checks: CallCheck.post) */
            int posts = 0;
            PyObject *posting = state(self, s_posting);
            if (posting == NULL || (posts = PyObject_IsTrue(posting)) < 0) goto failed;
            if (posts) {
                PyObject *a[1] = {x};
                if ((got = call_state(self, s_stream_ordered, a, 1)) == NULL) goto failed;
                posts = PyObject_IsTrue(got);
                Py_DECREF(got);
                if (posts < 0) goto failed;
            }
            PyObject *shape = PyObject_GetAttr(x, s_shape);
            if (shape == NULL) goto failed;
            if (posts) {
                PyObject *a[5] = {call, reduce_op, root, dtype, shape};
                got = call_state(self, s_post_call, a, 5);
            } else {
                PyObject *a[7] = {call, reduce_op, root, dtype, shape, Py_None, on_fast_path ? Py_True : Py_False};
                got = call_state(self, s_check_call, a, 7);
            }
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
            PyObject *a[8] = {NULL, call, x, adapter, dtype, root, async_op, extra};
            result = call_state_method(self, s_p2p, s_run, a, 8);
        } else { /* the row's transport method, its Request refilled */
            if (PyObject_SetAttr(request, s_x, x) < 0 || PyObject_SetAttr(request, s_root, root) < 0 ||
                PyObject_SetAttr(request, s_out, out) < 0 || PyObject_SetAttr(request, s_async_op, async_op) < 0 ||
                PyObject_SetAttr(request, s_extra, extra) < 0 || PyObject_SetAttr(request, s_view, view) < 0)
                goto failed;
            if (row->counted) {
                PyObject *a[2] = {comm, request};
                if ((got = PyObject_Vectorcall(self->counted, a, 2, NULL)) == NULL) goto failed;
                Py_DECREF(got);
            }
            if ((result = PyObject_CallOneArg(method, request)) == NULL) goto failed;
            if (PyObject_SetAttr(request, s_x, Py_None) < 0 || PyObject_SetAttr(request, s_out, Py_None) < 0 ||
                PyObject_SetAttr(request, s_carried, Py_None) < 0 || PyObject_SetAttr(request, s_view, Py_None) < 0)
                goto failed;
        }
        if (result == NULL) goto failed;
    }
    Py_CLEAR(view);
    Py_CLEAR(out_view);

    if (record != NULL) {
        PyObject *now = PyObject_CallNoArgs(self->clock);
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
                PyObject *a[2] = {result, record == NULL ? Py_None : record};
                got = call_state(self, s_keep, a, 2);
            } else {
                PyObject *a[2] = {NULL, result};
                got = call_state_method(self, s_handles, s_keep_p2p, a, 2);
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

refuse: /* the checks raised: nothing done yet */
    *refused = PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_ValueError);
    if (*refused) PyErr_Clear();
    goto fail;

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
        /* as in the Python form's except block: the error is the one being handled */
        PyObject *handled = get_handled();
        set_handled(error);
        PyObject *a[2] = {record == NULL ? Py_None : record, error};
        got = call_state(self, s_raise_failed, a, 2);
        set_handled(handled);
        Py_XDECREF(handled);
        if (got != NULL) { /* (it always raises) */
            Py_DECREF(got);
            PyErr_SetString(PyExc_SystemError, "raise_failed returned");
        }
        Py_DECREF(error);
    }
fail:
    Py_XDECREF(result);
    Py_XDECREF(view);
    Py_XDECREF(out_view);
    Py_XDECREF(record);
    return NULL;
}

PyObject *
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
    if (key == NULL) {
        Py_DECREF(dtype);
        return NULL;
    }
    plan = PyDict_GetItemWithError(plans, key);
    Py_DECREF(key);
    if (plan == NULL || !PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 8) {
        Py_DECREF(dtype);
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) return NULL;
            PyErr_Clear();
        }
        return hand_over(self, args, nargsf, kwnames);
    }
    Row *row = row_of(self, call);
    if (row == NULL) {
        Py_DECREF(dtype);
        return NULL;
    }
    Py_INCREF(plan);
    self->taken++;
    int refused = 0;
    PyObject *result = run_planned(self, row, call, x, dtype, args[3], args[4], args[5], nargs > 6 ? args[6] : Py_None,
                                   plan, &refused);
    Py_DECREF(plan);
    Py_DECREF(dtype);
    if (refused) return hand_over(self, args, nargsf, kwnames); /* its checks raise, after the refusal's round */
    return result;
}

