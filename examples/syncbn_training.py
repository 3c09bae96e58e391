# run: mpiexec -n 3 python examples/syncbn_training.py
"""Data-parallel training with SyncBatchNorm on any transport, checked against one process.

Each rank trains on its shard of the global batch; ``syncbn.convert_sync_batchnorm`` makes
the BatchNorm layers normalize with the statistics of the whole global batch and
``syncbn.DataParallel`` sums the gradients. The shards may be uneven (8 rows on 3 ranks:
3, 3 and 2), so each rank's loss is the sum of its rows' losses divided by the global batch
size: the sum over ranks is the mean over the global batch. After a few steps the model
equals the same model trained by one process with plain BatchNorm on the global batch
(float64, to 1e-10).

    mpiexec -n 3 python examples/syncbn_training.py                    # mpi (shards 3, 3, 2)
    torchrun --nproc_per_node 2 examples/syncbn_training.py            # torch (Gloo on CPU)
    COLLECTIVES_BACKEND=torch mpiexec -n 2 python examples/syncbn_training.py
"""

import copy

import torch
from torch import nn

import collectives
from collectives import syncbn

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
comm = collectives.init()


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights everywhere
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], global_size: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        (nn.functional.cross_entropy(model(x), y, reduction="sum") / global_size).backward()
        opt.step()


# The global batches (every rank builds the same ones); rank r trains on rows r::size.
gen = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 3, 6, 6, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(3)]

reference = make_model()  # one process, plain BatchNorm, the whole global batch
ours = syncbn.DataParallel(syncbn.convert_sync_batchnorm(copy.deepcopy(reference), comm), comm,
                           grad_reduction="sum")
train(reference, batches, global_size=8)
train(ours, [(x[comm.rank::comm.size], y[comm.rank::comm.size]) for x, y in batches], global_size=8)

theirs = dict(reference.named_parameters())
diff = max((p - theirs[name.removeprefix("module.")]).abs().max().item() for name, p in ours.named_parameters())
assert diff < 1e-10, diff
if comm.rank == 0:
    print(f"{comm.size} ranks ({comm.backend}) with SyncBatchNorm equal one process on the global batch: "
          f"max |param diff| = {diff:.1e}")
comm.close()
