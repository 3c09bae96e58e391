"""The one call path every collective goes through: :func:`run`, the communicator's ``_run``
(``Communicator._run``). It checks every argument first (the same ``TypeError``/``ValueError`` on
every backend, before any data is sent, the input untouched; a refused call still takes part in its
check), numbers the call, checks that every rank makes it, records it, runs it on the transport and
maps its errors. ``self`` is the Communicator (typed ``Any``: this module does not import
the one that imports it). A module of its own so that it reads in one sitting, beside the communicator
whose parts it calls (see :mod:`collectives.communicator`).

It is also the call path's compiled form: the build compiles this file as it stands with Cython
(``collectives._callpath_c``, setup.py's ``COMPILED``), which :mod:`collectives.front` sets as a
communicator's ``_run``; a change here is a change of both forms (build again to run it compiled)."""

from __future__ import annotations

from _thread import get_ident as _thread_id
from typing import Any

from . import emulations
from .calls import NOT_TAKEN, Call
from .diagnostics import recorder
from .diagnostics.recorder import END, POSTED, STARTED, STATE
from .work import Work

_clock = recorder.clock


def run(self: Any, call: Call, x: Any, op: Any, root: Any, out: Any, async_op: Any,
        extra: Any = None, timeout: Any = None) -> Any:
    """Check, number, fingerprint, record, run and map the errors of one call of ``call``'s
    kind. A bad argument raises with nothing of the call sent and ``x`` untouched."""
    if self._gate != _thread_id():  # closed, unusable, or another thread
        self._check_open()
    if timeout is not None:
        return self._context.run_with_timeout(call, x, op, root, out, async_op, extra, timeout)
    try:
        if async_op is not False and async_op is not True:
            raise TypeError(f"async_op must be True or False; got {type(async_op).__name__}")
        try:  # the plan of x's kind (its type and dtype, and op) that passed the checks before
            plan = self._plans[call, type(x), x.dtype, op]
        except (KeyError, TypeError, AttributeError):  # (its errors not raised inside the lookup's:
            plan = None  # a user's TypeError is never chained under a KeyError)
        if plan is None:  # a kind not seen yet: the full checks (ArgumentChecks.plan)
            plan = self._checks.plan(call, x, op)
        check, fast, carry, adapter, dtype, reduce_op, request, method = plan
        # What can differ between two arrays of one kind, checked on every call; the first
        # call of a kind runs the same route as the later ones (the backend's fast path too).
        in_place = call.in_place
        view = check(x, in_place)
        if call.root is not None and (type(root) is not int or not 0 <= root < self.size):  # noqa: E721
            if root is not None or not call.any_root:  # (None: a recv from any source)
                self._checks.check_rank(root, call.root)  # (a bool is no rank)
        if call.check is not None:
            call.check(self, tuple(x.shape), extra, root)
        if out is not None:
            self._checks.check_out(call, x, adapter, out, extra, root)
    except (TypeError, ValueError) as refusal:  # nothing sent; its number and check, marked refused:
        if self._checking and call.collective:  # the peers name this rank (CallCheck.refused)
            self._call_check.refused(call, x, op, root, refusal, self._begin(call))
        raise
    if self._pending:
        self._reap()
    seq, collective = self._seq, call.collective
    if collective:
        self._seq = seq = seq + 1
    self._operation = call.name
    ring = self._ring
    if ring is not None:  # the flight recorder (collectives/diagnostics/recorder.py): a call with an end time
        # and no error has completed; the fast path's view's shape is a plain tuple (cheaper)
        record = [seq, call, dtype, (x if view is None else view).shape, root, STARTED,
                  _clock(), 0.0, None, None, reduce_op]
        ring.append(record)
    else:
        record = None
    try:
        result, on_fast_path = NOT_TAKEN, view is not None and not (async_op or call.counted or root is None)
        if self._checking and collective:
            if on_fast_path and carry is not None:  # (carried where x fits its round)
                result = self._carry_call(carry, call, reduce_op, root, dtype, view, out, extra)
            else:
                self._check_call(call, reduce_op, root, dtype, x.shape, None, on_fast_path)
        if result is not NOT_TAKEN:
            pass  # x travelled in the check's round (see Transport._carried_path)
        elif on_fast_path and (result := fast(view, root, out, extra)) is not NOT_TAKEN:
            pass  # the backend's fast path ran it (see Transport._fast_path)
        elif self.debug and not collective:
            result = self._p2p.run(call, x, adapter, dtype, root, async_op, extra)
        else:  # the row's transport method; its calls.Request refilled in two 3s (no tuple built)
            request.x, request.root, request.out = x, root, out
            request.async_op, request.extra, request.view = async_op, extra, view
            if call.counted:  # the uneven rows: the counts exchange puts every rank's in extra
                emulations.counted(self, request)
            result = method(request)
            request.x = request.out = request.carried = request.view = None  # (the record keeps no array alive)
    except Exception as error:
        self._raise_failed(record, error)
    if record is not None:
        record[END] = _clock()
        if self._hooks:
            self._call_hooks(record)
    if async_op:
        if type(result) is not Work:  # a handle that may still be running: keep it
            if record is not None:  # (completed once the communicator learns it has)
                record[STATE] = POSTED
            if collective:
                self._keep(result, record)
            else:
                self._handles.keep_p2p(result)
        return result
    return x if in_place else result
