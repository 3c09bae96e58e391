"""Runs the Python blocks of the user guide that tests/tooling/test_docs_commands.py hands it (a
JSON list), in their order, each in a namespace of its own after its hidden set-up, under whatever
launcher started this process: ``mpiexec -n 2 python doc_snippet_runner.py blocks.json``.

A block's code is compiled under its page's name and line numbers, so a block that raises shows
``File "README.md", line 14`` in its traceback; the exception ends the rank (and the launcher
ends the job), which fails the test that started it."""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        blocks = json.load(f)
    for block in blocks:
        namespace = {"__name__": "__main__"}
        where = f"{block['page']}:{block['line']}"
        exec(compile(block["setup"], f"{where} (its hidden set-up)", "exec"), namespace)
        # Padded with empty lines: the code's line numbers are the page's.
        exec(compile("\n" * (block["first"] - 1) + block["code"], block["page"], "exec"), namespace)
        sys.stdout.write(f"ran {where}\n")  # one write: the ranks' lines do not interleave
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
