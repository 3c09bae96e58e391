"""Every allowed (op, dtype) through the public contract only, checked against numpy on every
rank. Run under a launcher; prints one line per rank and exits 1 on any mismatch.

    mpiexec -n 3 python tests/scripts/contract_check.py
    torchrun --nproc_per_node 3 tests/scripts/contract_check.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from grid import allowed_pairs, make_input, tolerance  # noqa: E402

import collectives  # noqa: E402
from collectives.testing.reference import as_array, reference_reduce, to_numpy  # noqa: E402


def main() -> int:
    comm = collectives.init()
    failures = []
    for dtype, op in allowed_pairs():
        for kind in ("torch", "numpy"):
            if kind == "numpy" and dtype == "bfloat16":
                continue
            inputs = [make_input(7, r, dtype, op) for r in range(comm.size)]
            x = as_array(inputs[comm.rank], dtype, kind)
            got = to_numpy(comm.all_reduce(x, op.value))
            ref = reference_reduce(inputs, dtype, op)
            tol = tolerance(inputs, dtype, op, ref)
            ok = np.all(np.abs(got.astype(np.float64) - ref) <= tol) if tol.any() else np.array_equal(got, ref)
            if not ok:
                failures.append(f"{kind} {dtype} {op}")
    print(f"rank {comm.rank}/{comm.size} backend={comm.backend} checked={len(allowed_pairs())} "
          f"failures={failures}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
