"""The call path's compiled form: :meth:`Communicator._run <collectives.communicator.Communicator._run>`
in C (collectives/_front_call.c; the object and module in _front.c), set as a communicator's ``_run``
when the communicator is made.

The Python ``_run`` is the reference. The compiled one runs the same steps in the same order,
calling the same parts (the plan's check and fast path, the carried path, the check, the flight
recorder, the hooks, the transport's method, the error mapping); it hands every call it does not
take to the Python one before any step has run (keyword arguments, a call's own ``timeout=``, a
closed or unusable communicator, another thread, a kind of ``x`` with no plan yet), and a call its
checks refuse (the Python form's checks raise the same error, after the refused call's check round:
see ``Communicator._refused``). It saves the
interpreter's cost of the path's own steps, 0.1-0.5 us a call (docs/performance.md).

Optional: an install without a C compiler has no ``collectives._front``, and
``COLLECTIVES_COMPILED=0`` turns it off for communicators made after; a communicator keeps the
form it was made in.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from . import arrays, calls, config, emulations
from .diagnostics import recorder
from .work import Work

#: The interface the module's ``VERSION`` (``FRONT_VERSION`` of collectives/_front.h) must have:
#: a build left from an older checkout is not used.
FRONT_VERSION = 11


def compiled_module() -> Any:
    """The compiled front's module (``collectives._front``), or None where it was not built (or is stale) or
    ``COLLECTIVES_COMPILED=0`` turns the compiled forms off."""
    return config.compiled_extension(f"{__package__}._front", FRONT_VERSION)


#: The public methods whose body is one call of ``self._run(row, x, ...)``, and their rows: each
#: becomes a compiled ``Method`` on the communicator (see :func:`install`).
METHODS = {"all_reduce": calls.ALL_REDUCE, "broadcast": calls.BROADCAST, "reduce": calls.REDUCE,
           "all_gather": calls.ALL_GATHER, "all_gather_v": calls.ALL_GATHER_V,
           "reduce_scatter": calls.REDUCE_SCATTER, "gather": calls.GATHER, "scatter": calls.SCATTER,
           "send": calls.SEND, "recv": calls.RECV}


#: The rows' ``out_shape`` functions whose out= check of a host array (numpy, or a CPU tensor's
#: view) the front makes itself (in this order: OUT_STACKED, ... of collectives/_front.h; the
#: uneven rows' too, OUT_ROWS); another row's goes to checks.check_out.
OUT_SHAPES = (calls.stacked, calls.block_of_rows, calls.one_row, calls.same_shape)


def install(comm: Any, owner: type) -> bool:
    """Set ``comm._run`` to its compiled form (``owner._run``, ``Communicator._run``, is what it
    hands over to), where there is one and ``comm``'s class has not a ``_run`` of its own (which
    then runs, as written). Whether it did.

    Each method of :data:`METHODS` that ``comm``'s class has as ``owner`` wrote it becomes a
    compiled ``Method`` on ``comm``: it calls the front with the method's arguments in ``_run``'s
    order, without the Python frame (see :func:`method_spec`)."""
    module = compiled_module()
    if module is None or type(comm)._run is not owner._run:  # type: ignore[attr-defined]
        return False
    run = comm.__dict__["_run"] = module.Front(  # (the constants it needs)
        comm, owner._run, not_taken=calls.NOT_TAKEN, started=recorder.STARTED,  # type: ignore[attr-defined]
        posted=recorder.POSTED, end=recorder.END, state=recorder.STATE, work_type=Work, clock=recorder.clock,
        counted=emulations.counted, host_view=arrays.NumpyAdapter.host_view, numpy=arrays.NUMPY,
        out_shapes=OUT_SHAPES, torch_host_view=arrays.TorchAdapter.host_view, torch=arrays.TORCH)
    for name, row in METHODS.items():
        function = getattr(owner, name)
        spec = method_spec(function, row)
        if spec is not None and getattr(type(comm), name) is function:
            comm.__dict__[name] = module.Method(run, vars(comm), getattr(comm, name), *spec)
    return True


#: The argument of ``Communicator._run(call, x, op, root, out, async_op, extra, timeout)`` that a
#: public method's parameter of each name is (its index there).
RUN_SLOTS = {"op": 2, "src": 3, "dst": 3, "out": 4, "async_op": 5, "tag": 6, "timeout": 7}


@functools.cache
def method_spec(function: Any, row: Any) -> tuple[Any, ...] | None:
    """What ``Method`` needs of ``function(self, x, ...)``, whose body is ``self._run(row, x, ...)``
    with each parameter as the argument :data:`RUN_SLOTS` names: ``_run``'s arguments where a
    call gives none (the defaults), the slots of the positional parameters after ``x``, how many of
    them have no default, and ``(name, slot)`` of every parameter after ``x``. None where a
    parameter is none of those."""
    kinds = inspect.Parameter
    base: list[Any] = [row, None, None, -1, None, False, None, None]
    positional: list[int] = []
    keywords: list[tuple[str, int]] = []
    required = 0
    for parameter in list(inspect.signature(function).parameters.values())[2:]:
        slot = RUN_SLOTS.get(parameter.name)
        if slot is None or parameter.kind not in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY):
            return None
        if parameter.default is kinds.empty:
            if parameter.kind is kinds.KEYWORD_ONLY or len(positional) != required:
                return None
            required += 1
        else:
            base[slot] = parameter.default
        if parameter.kind is kinds.POSITIONAL_OR_KEYWORD:
            positional.append(slot)
        keywords.append((parameter.name, slot))
    return tuple(base), tuple(positional), required, tuple(keywords)


def is_compiled(comm: Any) -> bool:
    """Whether ``comm``'s calls go through the compiled call path."""
    return "_run" in vars(comm)
