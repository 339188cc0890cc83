"""The docs' example drives the planner from a plain PyTorch loop (no Hydra): it must run as written."""
from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "plain_loop.py"


def test_the_plain_loop_example_plans_trains_and_feeds_the_kernels_reports_back(capsys):
    main = runpy.run_path(str(EXAMPLE))["main"]
    predicted = main(steps=2)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1"]
    assert all("8 sequences on 2 ranks" in line for line in lines)
    assert np.isfinite(predicted).all() and min(predicted) > 0
