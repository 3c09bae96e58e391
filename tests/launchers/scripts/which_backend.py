"""Print what collectives.init() made here (or the error it raised), one line per rank."""

import collectives

try:
    comm = collectives.init()
    print(f"OK backend={comm.backend} rank={comm.rank} size={comm.size} local_rank={comm.local_rank}", flush=True)
    # No rank leaves before every rank is set up: Gloo's connectFullMesh on a slow rank fails
    # when a faster peer has already exited (seen under load in CI).
    comm.barrier()
except Exception as error:  # noqa: BLE001
    print(f"ERROR {type(error).__name__}: {error}", flush=True)
    raise SystemExit(3) from None
