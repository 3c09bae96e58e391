/* A communicator's public collective methods (all_reduce, broadcast, send, ...), compiled: each
 * is a Method set on the communicator beside its Front (collectives/front.py), which passes the
 * call's arguments to the Front in _run's order without the Python method's frame.
 *
 * The Python method is the reference (its body is one call of self._run): its parameters, their
 * defaults and which of _run's arguments each one is are read from its signature when the Method
 * is made. A call whose arguments are not the usual ones (too many or too few, an unknown or
 * repeated keyword) and a communicator whose _run is no longer the Front go to the Python
 * method, which raises what Python raises. */
#include "_front.h"

#include <structmember.h>

/* _run's arguments: call, x, op, root, out, async_op, extra, timeout. */
#define SLOTS 8
#define MAX_POSITIONAL 2
#define MAX_KEYWORDS 6

static PyObject *s_private_run, *s_doc, *s_name_dunder, *s_qualname;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *front;       /* the communicator's Front */
    PyObject *dict;        /* the communicator's __dict__ (is its _run still the Front?) */
    PyObject *python;      /* the class's method, bound to the communicator */
    PyObject *base[SLOTS]; /* _run's arguments where the call gives none (base[1], x: None) */
    int npos, required;    /* the positional parameters after x; the first `required` have no default */
    int pos_slot[MAX_POSITIONAL];
    int nkw;               /* the parameters after x by name (positional ones too), and their slots */
    PyObject *kw_name[MAX_KEYWORDS];
    int kw_slot[MAX_KEYWORDS];
} Method;

static int
Method_traverse(Method *self, visitproc visit, void *arg)
{
    Py_VISIT(self->front);
    Py_VISIT(self->dict);
    Py_VISIT(self->python);
    for (int i = 0; i < SLOTS; i++) Py_VISIT(self->base[i]);
    return 0;
}

static int
Method_clear(Method *self)
{
    Py_CLEAR(self->front);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->python);
    for (int i = 0; i < SLOTS; i++) Py_CLEAR(self->base[i]);
    for (int i = 0; i < self->nkw; i++) Py_CLEAR(self->kw_name[i]);
    self->nkw = 0;
    return 0;
}

static void
Method_dealloc(Method *self)
{
    PyObject_GC_UnTrack(self);
    Method_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The slot of keyword `name`, or -1. */
static int
slot_of(Method *self, PyObject *name)
{
    for (int j = 0; j < self->nkw; j++)
        if (name == self->kw_name[j]) return self->kw_slot[j];
    for (int j = 0; j < self->nkw; j++) {  /* (a name not interned) */
        int equal = PyUnicode_Compare(name, self->kw_name[j]) == 0;
        if (PyErr_Occurred()) PyErr_Clear();
        if (equal) return self->kw_slot[j];
    }
    return -1;
}

static PyObject *
Method_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Method *self = (Method *)op;
    if (self->front == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the method's communicator is gone");
        return NULL;
    }
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *run = PyDict_GetItemWithError(self->dict, s_private_run);  /* (borrowed) */
    if (run == NULL && PyErr_Occurred()) return NULL;
    if (run != self->front || nargs < 1 || nargs > 1 + self->npos) goto python;
    PyObject *a[SLOTS];
    for (int i = 0; i < SLOTS; i++) a[i] = self->base[i];
    a[1] = args[0];
    unsigned given = 0;
    for (Py_ssize_t i = 1; i < nargs; i++) {
        int s = self->pos_slot[i - 1];
        a[s] = args[i];
        given |= 1u << s;
    }
    Py_ssize_t nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nk; k++) {
        int s = slot_of(self, PyTuple_GET_ITEM(kwnames, k));
        if (s < 0 || (given & (1u << s))) goto python;
        a[s] = args[nargs + k];
        given |= 1u << s;
    }
    for (int i = 0; i < self->required; i++)
        if (!(given & (1u << self->pos_slot[i]))) goto python;
    return Front_call(self->front, a, SLOTS, NULL);
python:
    return PyObject_Vectorcall(self->python, args, nargsf, kwnames);
}

/* Method(front, dict, python, base, positional, required, keywords): base, _run's 8 arguments
 * where a call gives none; positional, the slots of the positional parameters after x (the
 * first `required` of them without a default); keywords, ((name, slot), ...). */
static PyObject *
Method_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"front", "dict", "python", "base", "positional", "required", "keywords", NULL};
    PyObject *front, *dict, *python, *base, *positional, *keywords;
    int required;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!OO!O!iO!", names, &front, &PyDict_Type, &dict, &python,
                                     &PyTuple_Type, &base, &PyTuple_Type, &positional, &required, &PyTuple_Type,
                                     &keywords))
        return NULL;
    Py_ssize_t npos = PyTuple_GET_SIZE(positional), nkw = PyTuple_GET_SIZE(keywords);
    if (PyTuple_GET_SIZE(base) != SLOTS || npos > MAX_POSITIONAL || nkw > MAX_KEYWORDS || required < 0 ||
        required > npos) {
        PyErr_SetString(PyExc_ValueError, "a method this front cannot take");
        return NULL;
    }
    Method *self = (Method *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = Method_call;
    self->front = Py_NewRef(front);
    self->dict = Py_NewRef(dict);
    self->python = Py_NewRef(python);
    for (int i = 0; i < SLOTS; i++) self->base[i] = Py_NewRef(PyTuple_GET_ITEM(base, i));
    self->npos = (int)npos;
    self->required = required;
    for (Py_ssize_t i = 0; i < npos; i++) {
        long s = PyLong_AsLong(PyTuple_GET_ITEM(positional, i));
        self->pos_slot[i] = (int)s;
        if (s < 2 || s >= SLOTS) goto bad;
    }
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *pair = PyTuple_GET_ITEM(keywords, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(pair, 0)))
            goto bad;
        PyObject *name = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
        PyUnicode_InternInPlace(&name);
        self->kw_name[i] = name;
        self->nkw = (int)i + 1;
        long s = PyLong_AsLong(PyTuple_GET_ITEM(pair, 1));
        self->kw_slot[i] = (int)s;
        if (s < 2 || s >= SLOTS) goto bad;
    }
    return (PyObject *)self;
bad:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a slot of _run's arguments is from 2 to 7");
    Py_DECREF(self);
    return NULL;
}

/* What introspection asks of a method: the Python method's (help(), inspect.signature). */
static PyObject *
Method_python_attribute(Method *self, void *name)
{
    if (self->python == NULL) Py_RETURN_NONE;
    return PyObject_GetAttr(self->python, *(PyObject **)name);
}

static PyObject *
Method_wrapped(Method *self, void *closure)
{
    return Py_NewRef(self->python ? self->python : Py_None);
}

static PyGetSetDef Method_getset[] = {
    {"__doc__", (getter)Method_python_attribute, NULL, NULL, &s_doc},
    {"__name__", (getter)Method_python_attribute, NULL, NULL, &s_name_dunder},
    {"__qualname__", (getter)Method_python_attribute, NULL, NULL, &s_qualname},
    {"__wrapped__", (getter)Method_wrapped, NULL, "the Python method it stands for", NULL},
    {NULL},
};

static PyObject *
Method_repr(Method *self)
{
    return PyUnicode_FromFormat("<compiled %R>", self->python);
}

PyTypeObject MethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._front.Method",
    .tp_basicsize = sizeof(Method),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Method_traverse,
    .tp_clear = (inquiry)Method_clear,
    .tp_vectorcall_offset = offsetof(Method, vectorcall),
    .tp_new = Method_new,
    .tp_dealloc = (destructor)Method_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_repr = (reprfunc)Method_repr,
    .tp_getset = Method_getset,
};

int
method_type_ready(PyObject *module)
{
    if ((s_private_run = PyUnicode_InternFromString("_run")) == NULL ||
        (s_doc = PyUnicode_InternFromString("__doc__")) == NULL ||
        (s_name_dunder = PyUnicode_InternFromString("__name__")) == NULL ||
        (s_qualname = PyUnicode_InternFromString("__qualname__")) == NULL || PyType_Ready(&MethodType) < 0)
        return -1;
    Py_INCREF(&MethodType);
    if (PyModule_AddObject(module, "Method", (PyObject *)&MethodType) < 0) {
        Py_DECREF(&MethodType);
        return -1;
    }
    return 0;
}
