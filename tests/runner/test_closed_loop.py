"""The runner closes the planning loop as the simulator does: every rank's planner is shown, after each step,
what the kernel reported of every sequence of that step (kept fraction and coverage, as sequences.csv records
them) and the step's time; all ranks see the same, so their next Plans agree; the planner never gets the
data's truth."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from equivalence import RUNNER, SHARED

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_rank_observes_the_kernels_reports_of_every_step(tmp_path):
    observed = tmp_path / "observed"
    observed.mkdir()
    run_dir = tmp_path / "run"
    overrides = [o for o in SHARED if not o.startswith(("policy=", "steps="))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "tests/runner/observe_probe.py", f"hydra.run.dir={run_dir}", *RUNNER, *overrides,
           "policy=sparsebalance", "steps=2", "cluster.gpus_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "OBSERVED": str(observed)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [[json.loads(line) for line in (observed / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert ranks[0] == ranks[1]  # the same observations on every rank
    plans = (run_dir / "plans.jsonl").read_text().splitlines()
    assert [o["plan"] for o in ranks[0]] == plans  # one observation per step, of the Plan that ran
    assert all('"sensitivity"' not in plan for plan in plans)
    sequences = pd.read_csv(run_dir / "sequences.csv")
    steps = pd.read_csv(run_dir / "steps.csv")
    for step, obs in enumerate(ranks[0]):
        rows = sequences[sequences["step"] == step].set_index("seq_id")
        ids = [a["seq_id"] for a in json.loads(obs["plan"])["assignments"]]
        assert obs["kept"] == pytest.approx(rows.loc[ids, "kept_fraction"].tolist(), rel=1e-6)
        assert obs["coverage"] == pytest.approx(rows.loc[ids, "coverage"].tolist(), rel=1e-6)
        assert 0 < min(obs["kept"]) and max(obs["kept"]) <= 1
        assert obs["step_ms"] == pytest.approx(steps.loc[step, "step_ms"], rel=1e-6)
