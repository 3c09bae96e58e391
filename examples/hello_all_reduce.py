# run: mpiexec -n 2 python examples/hello_all_reduce.py
"""Hello, all_reduce: every rank adds its number, every rank gets the sum.

The same file runs on every backend; the launcher picks it (COLLECTIVES_BACKEND overrides):

    mpiexec -n 2 python examples/hello_all_reduce.py                           # mpi
    torchrun --nproc_per_node 2 examples/hello_all_reduce.py                   # torch (Gloo on CPU)
    COLLECTIVES_BACKEND=torch mpiexec -n 2 python examples/hello_all_reduce.py  # torch, started by mpiexec
    python examples/hello_all_reduce.py                                        # local: one rank
"""

import numpy as np

import collectives

comm = collectives.init()  # COLLECTIVES_BACKEND, else auto: the launcher decides
x = np.array([comm.rank + 1.0, 10.0 * (comm.rank + 1)], dtype=np.float32)
comm.all_reduce(x, "sum")  # in place, on every rank
n = comm.size
assert x.tolist() == [n * (n + 1) / 2, 10 * n * (n + 1) / 2]
print(f"rank {comm.rank} of {n} ({comm.backend}): all_reduce sum = {x.tolist()}")
comm.close()
