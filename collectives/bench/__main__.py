"""``python -m collectives.bench``: the collectives-bench command (collectives.bench.cli)."""

from .cli import main

main()
