/* A CPU tensor's numpy view, kept for the next call on the same tensor.
 *
 * TorchAdapter.host_view is x.numpy() (collectives/arrays.py): about 0.7 us a call, most of a
 * small call's cost over numpy's, where a loop passes the same tensors again and again (x, an
 * out= buffer). The front keeps the views of the last FRONT_VIEWS small tensors it viewed; a later
 * call on one of them takes the kept view after reading what x.numpy() reads of the tensor and
 * finding it the same: its dtype, data pointer and shape, that it is contiguous, needs no grad and
 * has no negative bit (x.numpy() refuses those two; `x.data = ...` and the in-place metadata
 * calls, resize_, t_, unsqueeze_, set_, change the others without making a new tensor). About 0.5
 * us (the five reads; x.numpy() 0.7). A view made for an equal (dtype, data, shape, contiguous) is the same memory read the same
 * way, so the kept view is x.numpy()'s view, whatever happened to the tensor between the calls;
 * the tensor itself is only compared by address (a new tensor at a dead one's address is
 * validated like any other).
 *
 * What it keeps alive: each kept view holds its tensor's storage, at most FRONT_VIEW_BYTES each,
 * until a view of another tensor takes its place or the communicator goes. */
#include "_front.h"

static PyObject *s_data_ptr, *s_is_contiguous, *s_requires_grad, *s_is_neg;

int
front_views_ready(void)
{
    return (s_data_ptr = PyUnicode_InternFromString("data_ptr")) != NULL &&
                   (s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) != NULL &&
                   (s_requires_grad = PyUnicode_InternFromString("requires_grad")) != NULL &&
                   (s_is_neg = PyUnicode_InternFromString("is_neg")) != NULL
               ? 0
               : -1;
}

/* x.<name>() (or x.<name> where !call) is `want` (Py_True or Py_False); 0 on any error, cleared. */
static int
is(PyObject *x, PyObject *name, int call, PyObject *want)
{
    PyObject *got = call ? PyObject_CallMethodNoArgs(x, name) : PyObject_GetAttr(x, name);
    if (got == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(got);
    return got == want;
}

/* Whether x.numpy() would be the view kept of (data, shape) now (x's dtype is the view's). */
static int
still(PyObject *x, void *data, PyObject *shape)
{
    PyObject *got = PyObject_CallMethodNoArgs(x, s_data_ptr);
    if (got == NULL) {
        PyErr_Clear();
        return 0;
    }
    void *now = PyLong_AsVoidPtr(got);
    Py_DECREF(got);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (now != data || (got = PyObject_GetAttr(x, s_shape)) == NULL) {
        PyErr_Clear();
        return 0;
    }
    int same = PyObject_RichCompareBool(got, shape, Py_EQ);
    Py_DECREF(got);
    if (same != 1) {
        PyErr_Clear();
        return 0;
    }
    return is(x, s_is_contiguous, 1, Py_True) && is(x, s_requires_grad, 0, Py_False) && is(x, s_is_neg, 1, Py_False);
}

static void
forget(Viewed *v)
{
    v->tensor = NULL;
    v->data = NULL;
    Py_CLEAR(v->view);
    Py_CLEAR(v->dtype);
    Py_CLEAR(v->shape);
}

/* Keep x's view `view` (C-contiguous: its buffer `b`, x's shape) in the next slot. */
static void
keep(Front *self, PyObject *x, PyObject *dtype, PyObject *view, const Py_buffer *b)
{
    if (b->len <= 0 || b->len > FRONT_VIEW_BYTES) return;
    PyObject *shape = PyTuple_New(b->ndim);
    for (int i = 0; shape != NULL && i < b->ndim; i++) {
        PyObject *n = PyLong_FromSsize_t(b->shape[i]);
        if (n == NULL) Py_CLEAR(shape);
        else PyTuple_SET_ITEM(shape, i, n);
    }
    if (shape == NULL) {
        PyErr_Clear();
        return;
    }
    Viewed *v = &self->views[self->views_next];
    self->views_next = (self->views_next + 1) % FRONT_VIEWS;
    forget(v);
    v->tensor = x;
    v->data = b->buf;
    v->readonly = b->readonly;
    v->view = Py_NewRef(view);
    v->dtype = Py_NewRef(dtype);
    v->shape = shape;
}

PyObject *
front_tensor_view(Front *self, PyObject *x, PyObject *dtype, int in_place)
{
    PyObject *own = NULL, *view = NULL;
    if (dtype == NULL && (own = dtype = PyObject_GetAttr(x, s_dtype)) == NULL) {
        PyErr_Clear();
        return NULL;
    }
    int kept_one = 0, readonly = 0;
    for (int i = 0; i < FRONT_VIEWS; i++) {
        Viewed *v = &self->views[i];
        if (v->tensor != x || v->view == NULL) continue;
        /* (held here: the tensor's methods may run Python, which may call this front again) */
        PyObject *kept = Py_NewRef(v->view), *shape = Py_NewRef(v->shape);
        readonly = v->readonly;
        kept_one = dtype == v->dtype && still(x, v->data, shape);
        if (kept_one) {
            self->viewed++;
            view = Py_NewRef(kept);
        } else if (v->view == kept) {
            forget(v);
        }
        Py_DECREF(kept);
        Py_DECREF(shape);
        break;
    }
    if (!kept_one && (view = PyObject_CallMethodNoArgs(x, s_numpy)) != NULL) {
        Py_buffer buffer;
        if (PyObject_GetBuffer(view, &buffer, PyBUF_C_CONTIGUOUS) < 0) {
            Py_CLEAR(view);
        } else {
            keep(self, x, dtype, view, &buffer);
            readonly = buffer.readonly;
            PyBuffer_Release(&buffer);
        }
    }
    if (view != NULL && in_place && readonly) Py_CLEAR(view);
    if (view == NULL) PyErr_Clear();  /* (the check says why, or takes the general path) */
    Py_XDECREF(own);
    return view;
}

int
front_views_traverse(Front *self, visitproc visit, void *arg)
{
    for (int i = 0; i < FRONT_VIEWS; i++) {
        Py_VISIT(self->views[i].view);
        Py_VISIT(self->views[i].dtype);
        Py_VISIT(self->views[i].shape);
    }
    return 0;
}

void
front_views_clear(Front *self)
{
    for (int i = 0; i < FRONT_VIEWS; i++) forget(&self->views[i]);
}
