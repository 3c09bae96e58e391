"""The README's examples of all_to_all with splits and of a send/recv pipeline, run verbatim on
real ranks of every backend (taken from the README's ```python blocks marked ``# example:``)."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def examples():
    with open(README) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(# example: [^\n]*\n.*?)```", text, re.S)
    return {block.splitlines()[0][len("# example: "):]: block for block in blocks}


def run_example_job(comm, name):
    exec(compile(examples()[name], f"README example {name!r}", "exec"), {"comm": comm})
    return True


def test_the_readme_has_both_examples():
    assert set(examples()) >= {"all_to_all with splits", "a send/recv pipeline"}


@pytest.mark.parametrize("name", ["all_to_all with splits", "a send/recv pipeline"])
@pytest.mark.parametrize("world", [("local", 1), ("mpi", 3), ("torch", 2)], indirect=True,
                         ids=lambda p: f"{p[0]}-{p[1]}")
def test_readme_example_runs(world, name):
    assert world.run(run_example_job, args=(name,)) == [True] * world.size
