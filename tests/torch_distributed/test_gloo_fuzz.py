"""A fast slice of the differential fuzz against Gloo (scripts/fuzz_c10d.py; the longer run:
make fuzz-c10d): random calls, valid and not, on a "collectives" group and a Gloo group in
the same ranks. No trial where Gloo raises may return on the group, and where both return
their tensors must be equal."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fuzz_c10d", ROOT / "scripts" / "fuzz_c10d.py")
assert _spec is not None and _spec.loader is not None
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_c10d"] = fuzz
_spec.loader.exec_module(fuzz)

#: Trials per number of ranks (seed 7): about 40 s on CI's 2 cores.
SLICE = {3: 60, 4: 40}


@pytest.mark.parametrize("ranks", SLICE)
def test_no_trial_returns_where_gloo_raises_and_results_equal_gloos(ranks):
    report = fuzz.run([ranks], SLICE[ranks], seed=7, debug=False, batch=SLICE[ranks], gloo_timeout=2.0)
    part = report["sizes"][str(ranks)]
    assert part["failures"] == [], part["failures"]
    counts = part["categories"]
    assert counts.get("same", 0) > SLICE[ranks] // 3 and counts.get("both raised", 0) > 0, counts
    assert set(part["labels"]) >= {"valid", "invalid"}, part["labels"]
