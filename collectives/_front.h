/* What collectives/_front.c (the Front object, its type and module) and _front_call.c (its call:
 * Communicator._run's steps) share. */
#ifndef COLLECTIVES_FRONT_H
#define COLLECTIVES_FRONT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <stddef.h>

/* The module's interface, as collectives/front.py expects it (FRONT_VERSION there). */
#define FRONT_VERSION 11

/* The out= shapes a row's out_shape gives that the front checks itself (Front's out_shapes, in
 * this order; 0: another, or none: checks.check_out runs), and the uneven rows' (OUT_ROWS: any
 * rows, x's trailing shape; the rows are checked once the counts have travelled). */
enum { OUT_OTHER, OUT_STACKED, OUT_BLOCK_OF_ROWS, OUT_ONE_ROW, OUT_SAME_SHAPE, OUT_ROWS };

/* A Call row's fields the steps read (collectives/calls.py; its rows are frozen). */
typedef struct {
    PyObject *name, *root, *check;
    int in_place, collective, counted, out_kind, any_root; /* any_root: a root of None is any rank (recv) */
    long tags_below;  /* the check's tags_below (send/recv: see calls.peer_and_tag), else -1 */
} Row;

/* A CPU tensor's numpy view kept for the next call on it (_front_views.c): at most FRONT_VIEWS of
 * them, of tensors of at most FRONT_VIEW_BYTES. */
#define FRONT_VIEWS 4
#define FRONT_VIEW_BYTES 65536
typedef struct {
    PyObject *tensor;       /* compared by address only (not held) */
    PyObject *view, *dtype, *shape;
    void *data;
    int readonly;           /* the view's buffer's */
} Viewed;

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
    PyObject *host_view;   /* NumpyAdapter.host_view (the function) and arrays.NUMPY: a plan whose */
    PyObject *numpy;       /* check is numpy's host_view is read through the buffer protocol */
    PyObject *torch_host_view;  /* TorchAdapter.host_view and arrays.TORCH: x.numpy() called here */
    PyObject *torch;
    PyObject *rows;        /* {call: capsule of its Row}: a row's fields read once */
    PyObject *out_shapes;  /* calls.stacked, block_of_rows, one_row, same_shape (see OUT_STACKED) */
    Py_ssize_t end, state; /* the record's END and STATE fields */
    Py_ssize_t taken;      /* the calls it ran itself (not handed over) */
    long size, rank;
    Viewed views[FRONT_VIEWS];
    int views_next;
    Py_ssize_t viewed;     /* the calls that took a kept view */
} Front;

/* Interned attribute names. */
extern PyObject *s_gate, *s_plans, *s_dtype, *s_checks, *s_check_rank, *s_check_out, *s_shape,
    *s_pending, *s_reap, *s_seq, *s_operation, *s_ring, *s_append, *s_checking,
    *s_carry_call, *s_check_call, *s_debug, *s_p2p, *s_run, *s_x, *s_root, *s_out,
    *s_async_op, *s_extra, *s_carried, *s_view, *s_hooks, *s_call_hooks, *s_keep, *s_handles, *s_keep_p2p,
    *s_raise_failed, *s_name, *s_check, *s_in_place, *s_collective, *s_counted, *s_out_shape, *s_numpy,
    *s_posting, *s_stream_ordered, *s_post_call;
extern PyObject *front_zero, *front_one;

/* The row of `call` (its fields read the first time), or NULL with an error (_front.c). */
Row *row_of(Front *self, PyObject *call);

/* front(call, x, op, root, out, async_op, extra=None, timeout=None): Communicator._run (_front_call.c). */
PyObject *Front_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

/* A CPU tensor's numpy view (x.numpy(), or the one kept from an earlier call while it is still
 * that), C-contiguous, writable where in_place; NULL without an error where x.numpy() fails or is
 * not such a view (then the plan's check runs). `dtype` is x.dtype where the caller has it, else
 * NULL (_front_views.c). */
PyObject *front_tensor_view(Front *self, PyObject *x, PyObject *dtype, int in_place);
int front_views_ready(void);
int front_views_traverse(Front *self, visitproc visit, void *arg);
void front_views_clear(Front *self);

/* The public methods' type, Method (_front_method.c), added to the module. */
int method_type_ready(PyObject *module);

#endif
