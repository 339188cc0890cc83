"""The docs' example drives the planner from a plain PyTorch loop (no Hydra): it must run as written."""
from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "plain_loop.py"


@pytest.mark.slow  # a CPU training loop through the kernel's reference: over 3 s
def test_the_plain_loop_example_plans_trains_and_feeds_the_kernels_reports_back(capsys):
    main = runpy.run_path(str(EXAMPLE))["main"]
    predicted = main(steps=2)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1"]
    assert all("8 sequences on 2 ranks" in line for line in lines)
    assert np.isfinite(predicted).all() and min(predicted) > 0


@pytest.mark.slow
def test_under_top_k_budgets_the_example_keeps_what_the_plan_asked_for(capsys):
    """The example hands the kernel the whole budget: under sparsebalance_topk each sequence keeps the fraction
    its plan's top_k gives at its length (sim.cost.topk_kept_fraction), not every block."""
    from sparsebalance.sim.cost import topk_kept_fraction

    namespace = runpy.run_path(str(EXAMPLE))
    reports: list = []
    namespace["main"](steps=2, policy="sparsebalance_topk", reports=reports)
    capsys.readouterr()
    asked, kept = [], []
    for plan, reported in reports:
        for a in plan.assignments:
            assert a.budget.top_k is not None
            asked.append(float(topk_kept_fraction(np.array([a.length]), a.budget.top_k, namespace["BLOCK"])[0]))
            kept.append(reported[a.seq_id])
    np.testing.assert_allclose(kept, asked, rtol=1e-6)
    assert min(kept) < 1.0
