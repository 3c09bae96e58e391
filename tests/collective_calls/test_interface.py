"""The interface without ranks: the dtype x op table, op names, launcher discovery, array
adapters, and that importing collectives imports no transport."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import collectives
from collectives import ALLOWED_OPS, DTYPES, ReduceOp
from collectives.arrays import adapter_for
from collectives.launcher import detect_launcher, without_launcher_variables
from collectives.ops import INTEGER_DTYPES, check_reduction, resolve_op

# DESIGN.md's table, written out again by hand: the independent reference for ops.py.
DESIGN_TABLE = """
dtype     SUM PROD MIN MAX AVG BAND BOR BXOR
bool      no  no   yes yes no  yes  yes yes
int8      yes yes  yes yes no  yes  yes yes
uint8     yes yes  yes yes no  yes  yes yes
int16     yes yes  yes yes no  yes  yes yes
int32     yes yes  yes yes no  yes  yes yes
int64     yes yes  yes yes no  yes  yes yes
float16   yes yes  yes yes yes no   no  no
bfloat16  yes yes  yes yes yes no   no  no
float32   yes yes  yes yes yes no   no  no
float64   yes yes  yes yes yes no   no  no
"""


def test_allowed_ops_is_the_design_table():
    header, *rows = [line.split() for line in DESIGN_TABLE.strip().splitlines()]
    ops = [ReduceOp[name] for name in header[1:]]
    assert [row[0] for row in rows] == list(DTYPES)
    for dtype, *cells in rows:
        assert ALLOWED_OPS[dtype] == {op for op, cell in zip(ops, cells) if cell == "yes"}, dtype


@pytest.mark.parametrize("spelling", ["sum", "SUM", "Sum", ReduceOp.SUM])
def test_ops_are_accepted_as_strings_in_any_case(spelling):
    assert resolve_op(spelling) is ReduceOp.SUM


@pytest.mark.parametrize("bad", ["add", "", None, 3, ReduceOp])
def test_an_unknown_op_is_a_value_error_listing_the_valid_ones(bad):
    with pytest.raises(ValueError, match="valid: SUM, PROD, MIN, MAX, AVG, BAND, BOR, BXOR"):
        resolve_op(bad)


def test_a_disallowed_pair_names_dtype_op_and_the_allowed_ops():
    with pytest.raises(TypeError, match="op=AVG is not allowed on dtype int32; allowed on int32: SUM, PROD, MIN, MAX, "
                                        "BAND, BOR, BXOR"):
        check_reduction("int32", "avg")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_refused_pair_names_the_op_s_dtypes_and_what_to_do(dtype):
    """Read from the table: the ops allowed on the dtype, the dtypes allowed for the op."""
    for op in set(ReduceOp) - ALLOWED_OPS[dtype]:
        with pytest.raises(TypeError) as refused:
            check_reduction(dtype, op.value)
        message = str(refused.value)
        dtypes = ", ".join(name for name in DTYPES if op in ALLOWED_OPS[name])
        assert f"{op.name} is allowed on: {dtypes}. What to do: " in message, message
    avg = pytest.raises(TypeError, check_reduction, dtype, "avg") if dtype in INTEGER_DTYPES else None
    if avg is not None:
        assert "cast x to a float dtype" in str(avg.value)


def test_every_error_class_a_user_can_meet_is_exported():
    """Every exception class of collectives.errors (PeerLeft too, also collectives.farewell's) is a
    public name of the package (and so in the API reference: `make docs` checks that)."""
    from collectives import errors, farewell

    classes = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == errors.__name__}
    assert "PeerLeft" in classes and classes <= set(collectives.__all__), classes - set(collectives.__all__)
    assert collectives.PeerLeft is farewell.PeerLeft
    assert issubclass(collectives.PeerLeft, collectives.CollectiveMismatch)


@pytest.mark.parametrize("call", ["dtype x op", "op", "src", "dtype", "array type"])
def test_a_refusal_is_not_chained_under_an_internal_error(call):
    """The user's TypeError/ValueError stands alone: no "During handling of the above exception"
    with the call path's own lookups (a plan's KeyError) above it."""
    comm = collectives.init("local")
    x = np.arange(3, dtype=np.int32)
    thunk = {"dtype x op": lambda: comm.all_reduce(x, "avg"), "op": lambda: comm.all_reduce(x, "add"),
             "src": lambda: comm.broadcast(x, 3), "dtype": lambda: comm.all_reduce(x.astype(np.complex64)),
             "array type": lambda: comm.all_reduce([1, 2])}[call]
    for _ in range(2):  # a new kind, then one whose plan exists (src)
        with pytest.raises((TypeError, ValueError)) as refused:
            thunk()
        assert refused.value.__context__ is None and refused.value.__cause__ is None, repr(refused.value.__context__)
    comm.broadcast(x, 0)
    with pytest.raises(ValueError) as refused:
        comm.broadcast(x, 3)
    assert refused.value.__context__ is None


LAUNCH_ENVIRONMENTS = [
    ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
      "TORCHELASTIC_RUN_ID": "x"}, ("torchrun", 2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}, ("mpi", 1, 3, 1, 3)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, ("mpi", 5, 8, 1, 4)),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"},
     ("slurm", 3, 4, 1, None)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, (None, 0, 1, 0, 1)),  # sbatch, no srun
    ({"RANK": "1", "WORLD_SIZE": "2"}, (None, 0, 1, 0, 1)),  # RANK alone is not torchrun
    ({}, (None, 0, 1, 0, 1)),
]


@pytest.mark.parametrize("env, expected", LAUNCH_ENVIRONMENTS)
def test_launcher_variables_are_read_for_every_launcher(env, expected):
    info = detect_launcher(env)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == expected


def test_a_non_integer_launcher_variable_is_named():
    with pytest.raises(ValueError, match="PMI_RANK='x'"):
        detect_launcher({"PMI_RANK": "x", "PMI_SIZE": "2"})


def test_importing_collectives_imports_no_transport():
    code = ("import sys, collectives, collectives.testing, collectives.info; "
            "print(sorted(m for m in ('torch', 'mpi4py', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_syncbn_imports_only_torch_and_the_interface():
    # torch is SyncBN's array library; the transports are the interface's business.
    code = ("import sys, collectives.syncbn; print(sorted(m for m in ('mpi4py', 'cupy', 'collectives.backends')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    for path in (Path(__file__).parents[2] / "syncbn").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                forbidden = ("torch.distributed", "mpi4py", "cupy", "collectives.backends")
                assert not name.startswith(forbidden), (path, name)


@pytest.mark.parametrize("x", [[1, 2], (1.0,), 3.0, "abc", memoryview(b"ab")])
def test_unsupported_array_types_are_a_type_error(x):
    with pytest.raises(TypeError, match="pass a torch.Tensor .CPU or CUDA., numpy.ndarray or cupy.ndarray"):
        adapter_for(x)


@pytest.mark.parametrize("x", [np.zeros(2, np.complex64), np.zeros(2, np.uint32), np.zeros(2, object),
                               np.zeros(2, ">f4"), torch.zeros(2, dtype=torch.complex64)])
def test_dtypes_outside_the_table_are_a_type_error_listing_the_supported_ones(x):
    comm = collectives.init("local")
    with pytest.raises(TypeError, match="supported dtypes: bool, int8, uint8, int16, int32, int64, float16, "
                                        "bfloat16, float32, float64"):
        comm.all_reduce(x)


def test_torch_parameters_are_tensors_and_in_place_use_is_refused():
    comm = collectives.init("local")
    weight = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="requires grad.*x.detach"):
        comm.all_reduce(weight)
    assert comm.all_gather(weight).shape == (1, 3)  # reading is fine
    comm.all_reduce(weight.detach())


def test_without_launcher_variables_leaves_nothing_detect_launcher_would_read():
    for env, _ in LAUNCH_ENVIRONMENTS:
        cleaned = without_launcher_variables({**env, "PATH": "/bin", "PMI_FD": "9"})
        assert cleaned == {"PATH": "/bin"}
        assert detect_launcher(cleaned).launcher is None
