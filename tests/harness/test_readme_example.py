"""The README's example, verbatim: a user's reduction property-tested on 4 MPI ranks."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectives.testing import strategies as cst


def my_max(comm, x):  # the user's reduction: runs on every rank
    return comm.all_reduce(x, "max")


@pytest.mark.parametrize("world", [("mpi", 4)], indirect=True)
@given(data=st.data())
def test_my_max_is_numpys_max(world, data):
    xs = data.draw(cst.rank_arrays("int32", data.draw(cst.shapes()), world.size))
    for got in world.run(my_max, [(x,) for x in xs]):
        np.testing.assert_array_equal(got, np.maximum.reduce(xs))


def test_the_readme_shows_this_example_verbatim():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    section = readme[readme.index("## Testing your own reductions"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "def test_my_max_is_numpys_max" in block
    assert block in pathlib.Path(__file__).read_text()
