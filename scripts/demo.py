"""Run every collective once on every rank and print a table of results on rank 0.

    mpiexec -n 4 python scripts/demo.py            (COLLECTIVES_BACKEND=mpi or auto)
    torchrun --nproc_per_node 4 scripts/demo.py    (COLLECTIVES_BACKEND=torch or auto)
"""

from __future__ import annotations

import numpy as np

import collectives


def main() -> None:
    comm = collectives.init()
    rank, size = comm.rank, comm.size
    rows = []

    x = np.full(3, rank + 1, dtype=np.float32)
    rows.append(("all_reduce sum", f"{rank + 1} each", comm.all_reduce(x, "sum"),
                 np.full(3, size * (size + 1) / 2)))
    x = np.full(3, rank + 1, dtype=np.float64)
    rows.append(("all_reduce avg", f"{rank + 1} each", comm.all_reduce(x, "avg"),
                 np.full(3, (size + 1) / 2)))
    x = np.array([rank, -rank], dtype=np.int32)
    rows.append(("all_reduce max", f"[{rank}, {-rank}]", comm.all_reduce(x, "max"),
                 np.array([size - 1, 0])))
    x = np.array([rank % 2 == 0, True])
    rows.append(("all_reduce band (bool)", "[even rank, True]", comm.all_reduce(x, "band"),
                 np.array([size == 1, True])))
    x = np.full(2, rank * 10, dtype=np.int64)
    rows.append((f"broadcast src={size - 1}", f"{rank * 10} each", comm.broadcast(x, src=size - 1),
                 np.full(2, (size - 1) * 10)))
    gathered = comm.all_gather(np.array([rank], dtype=np.int16))
    rows.append(("all_gather", f"[{rank}]", gathered.ravel(), np.arange(size)))
    x = np.ones((2 * size,), dtype=np.float32) * (rank + 1)
    rows.append(("reduce_scatter sum", f"{2 * size} x {rank + 1}", comm.reduce_scatter(x),
                 np.full(2, size * (size + 1) / 2)))
    half = comm.split(rank % 2)
    x = np.array([rank], dtype=np.int64)
    expected = sum(r for r in range(size) if r % 2 == rank % 2)
    rows.append(("split(rank % 2) + sum", f"[{rank}]", half.all_reduce(x), np.array([expected])))
    comm.barrier()

    ok = all(np.array_equal(np.asarray(got), want) for _, _, got, want in rows)
    verdicts = np.array([ok], dtype=bool)
    comm.all_reduce(verdicts, "min")
    if rank == 0:
        print(f"collectives demo: backend={comm.backend}, {size} ranks")
        print(f"{'collective':<26}{'rank input':<20}{'rank 0 result':<24}{'expected'}")
        for name, given, got, want in rows:
            print(f"{name:<26}{given:<20}{np.array2string(np.asarray(got)):<24}"
                  f"{np.array2string(want)}")
        print("all ranks agree with the expected results" if verdicts[0] else "MISMATCH")
    if not verdicts[0]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
