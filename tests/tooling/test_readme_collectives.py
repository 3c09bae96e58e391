"""The README's example of all_to_all with splits, run verbatim on real ranks of every backend
(taken from the README's ```python blocks marked ``# example:``; the send/recv pipeline is
examples/pipeline_send_recv.py, run by tests/tooling/test_examples.py under mpiexec and torchrun)."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def examples():
    with open(README) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(# example: [^\n]*\n.*?)```", text, re.S)
    return {block.splitlines()[0][len("# example: "):]: block for block in blocks}


def run_example_job(comm, name):
    exec(compile(examples()[name], f"README example {name!r}", "exec"), {"comm": comm})
    return True


def test_the_readme_has_its_example():
    assert set(examples()) >= {"all_to_all with splits"}


@pytest.mark.parametrize("name", sorted(examples()))
@pytest.mark.parametrize("world", [("local", 1), ("mpi", 3), ("torch", 2)], indirect=True,
                         ids=lambda p: f"{p[0]}-{p[1]}")
def test_readme_example_runs(world, name):
    assert world.run(run_example_job, args=(name,)) == [True] * world.size
