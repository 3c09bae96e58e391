"""A process group the user initialized is reused by the torch backend, as it is."""

import numpy as np
import torch.distributed as dist

import collectives

dist.init_process_group("gloo")
comm = collectives.init("torch")
assert comm.process_group is None and dist.get_world_size() == comm.size
total = comm.all_reduce(np.array([comm.rank + 1], np.int64))
print(f"REUSED rank={comm.rank} size={comm.size} sum={int(total[0])}", flush=True)
dist.destroy_process_group()
# The communicator is still open: what it holds of the group (the check round's bound all_to_all)
# lets go at exit all the same, or the group outlives the interpreter and aborts the process (an
# exit that did so now and then). The library's exit hook, run here first, then again at exit.
from collectives.backends import torch_bootstrap  # noqa: E402

torch_bootstrap._destroy_created_groups()
print(f"LET GO rank={comm.rank} {comm._transport._alltoall is None}", flush=True)
