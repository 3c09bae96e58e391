# run: mpiexec -n 4 python examples/moe_all_to_all.py
"""Mixture of experts: one expert per rank, tokens routed to their expert with all_to_all.

Each rank holds a batch of tokens and a router's choice of expert for each. Tokens are
sorted by expert, sent with ``all_to_all(tokens, send_splits)`` (uneven: as many rows to
each rank as it has tokens for that expert), transformed by the expert that lives there, and
sent back with the splits reversed. The result equals applying each token's expert locally.

    mpiexec -n 4 python examples/moe_all_to_all.py
    torchrun --nproc_per_node 4 examples/moe_all_to_all.py
"""

import numpy as np

import collectives


def expert(e: int, tokens: np.ndarray) -> np.ndarray:
    """Expert e: a fixed linear map (every rank can compute any expert, to check)."""
    weights = np.random.default_rng(1000 + e).standard_normal((tokens.shape[1], tokens.shape[1]))
    return (tokens @ weights).astype(tokens.dtype)


comm = collectives.init()
n, hidden = comm.size, 4
rng = np.random.default_rng(comm.rank)
tokens = rng.standard_normal((5 + 3 * comm.rank, hidden))  # uneven batches
route = rng.integers(0, n, size=len(tokens))  # the router's pick for each token

order = np.argsort(route, kind="stable")  # tokens grouped by expert
send_splits = np.bincount(route, minlength=n).tolist()  # rows for each rank
received = comm.all_to_all(tokens[order], send_splits)  # every token for my expert
# How many came from each rank: its row of the split table (one small all_gather).
from_each = comm.all_gather(np.array(send_splits, dtype=np.int64))[:, comm.rank].tolist()
output = expert(comm.rank, received)
returned = comm.all_to_all(output, from_each)  # back to the ranks they came from
result = np.empty_like(returned)
result[order] = returned  # back in the tokens' order

want = np.stack([expert(int(e), t[None])[0] for e, t in zip(route, tokens)])
np.testing.assert_allclose(result, want, rtol=1e-12)
print(f"rank {comm.rank}: {len(tokens)} tokens, sent {send_splits}, expert {comm.rank} "
      f"took {len(received)}; results equal local experts", flush=True)
comm.close()
