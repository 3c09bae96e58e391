# run: mpiexec -n 3 python examples/pipeline_send_recv.py
"""A pipeline of stages, one per rank: each receives a micro-batch from the stage before it,
works on it, and sends it on, with the sends asynchronous so a stage can take the next
micro-batch while its last one travels.

    mpiexec -n 3 python examples/pipeline_send_recv.py
    torchrun --nproc_per_node 3 examples/pipeline_send_recv.py
"""

import numpy as np

import collectives

comm = collectives.init()
first, last = comm.rank == 0, comm.rank == comm.size - 1
micro_batches = 4
activations = np.zeros(8, dtype=np.float32)
sent = None
for step in range(micro_batches):
    if sent is not None:
        sent.wait()  # the buffer may be reused once its send has completed
    if first:
        activations[:] = step  # the input of micro-batch `step`
    else:
        comm.recv(activations, src=comm.rank - 1, tag=step)
    activations += 1  # this stage's work
    if not last:
        sent = comm.send(activations, dst=comm.rank + 1, tag=step, async_op=True)
    else:
        assert activations.tolist() == [step + comm.size] * 8
        print(f"micro-batch {step}: through {comm.size} stages -> {activations[0]:g}")
if sent is not None:
    sent.wait()
comm.close()
