# run: mpiexec -n 2 python examples/torch_ddp.py
"""torch's own DistributedDataParallel over MPI, through the torch backend "collectives".

    mpiexec -n 2 python examples/torch_ddp.py                       # no MASTER_ADDR/PORT needed
    srun -n 4 python examples/torch_ddp.py                          # Slurm
    python examples/torch_ddp.py                                    # one rank
    COLLECTIVES_BACKEND=cupy torchrun --nproc_per_node 2 examples/torch_ddp.py   # with GPUs

The backend "collectives" runs on collectives' own transports: under torchrun only on the
cupy one, which needs GPUs; without them launch with an MPI launcher.

Every rank trains on its own half of the batch; DDP averages the gradients, so the model
ends where one process training on the whole batch would.
"""

import torch
import torch.distributed as dist
from torch import nn

import collectives.c10d  # registers the backend "collectives"

collectives.c10d.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)  # the same model everywhere (DDP also broadcasts rank 0's)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)  # the same global batch everywhere
x, y = torch.randn(8 * size, 4, generator=g), torch.randn(8 * size, 1, generator=g)
mine = slice(8 * rank, 8 * rank + 8)
for _ in range(20):
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()  # all_reduce over MPI, in backward
    optimizer.step()

names = dist.get_backend(), collectives.c10d.communicator().backend
print(f"rank {rank} of {size} (backend {names[0]!r} over {names[1]}): weight {model.module.weight.data.tolist()}")
dist.destroy_process_group()
