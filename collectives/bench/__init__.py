"""``collectives-bench``: time every collective through collectives, nccl-tests style.

    collectives-bench OP [-b MINBYTES] [-e MAXBYTES] [-f FACTOR] [-d DTYPE] [-o REDOP] [-r ROOT]
                         [-n ITERS] [-w WARMUP] [--raw] [--check] [--json FILE] [--plot FILE]

under mpiexec, torchrun or no launcher (also ``python -m collectives.bench``). It prints
nccl-tests' columns (size, count, type, redop, root, time, algbw, busbw, #wrong with
``--check``) and, with ``--raw``, the raw transport's time measured in the same run, interleaved,
and the ratio (and, where the default check makes a round, the raw call after one small
round). Importing it imports no transport; running it imports the backend's.
"""

from .cli import main, parse_table, run

__all__ = ["main", "parse_table", "run"]
