"""Print what collectives.init() made here (or the error it raised), one line per rank."""

import collectives

try:
    comm = collectives.init()
    print(f"OK backend={comm.backend} rank={comm.rank} size={comm.size} local_rank={comm.local_rank}", flush=True)
except Exception as error:  # noqa: BLE001
    print(f"ERROR {type(error).__name__}: {error}", flush=True)
    raise SystemExit(3) from None
