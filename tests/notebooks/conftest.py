"""Shared inputs of the plotting tests: a small real sweep, a synthetic calibration run, a benchmark CSV."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pinned import PINNED_OVERRIDES, PINNED_PROFILE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def sweep(once) -> Path:
    """Two policies, two steps: what ``python -m sim.run -m`` writes under multirun/. Made once however many
    xdist workers run its tests; they read it, and a test that damages it works on ``sweep_copy``."""
    return once("sweep", _sweep) / "multirun"


def _sweep(out: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "sparsebalance.sim.run", "-m", "policy=baseline,kk", "steps=2", "layout.micro_batches=4",
         f"hydra.sweep.dir={out / 'multirun'}", *PINNED_OVERRIDES],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr


@pytest.fixture
def sweep_copy(sweep, tmp_path) -> Path:
    """A copy the test may damage."""
    return Path(shutil.copytree(sweep, tmp_path / "multirun"))


@pytest.fixture(scope="session")
def fitted_profile(tmp_path_factory) -> Path:
    """A profile fitted by calibrate.fit on measurements made up from the committed profile's terms."""
    from sparsebalance.calibrate import fit, fitting, run, store
    from sparsebalance.calibrate.fitting import FeatureSource, Measurement
    from sparsebalance.calibrate.grid import build_grid
    from sparsebalance.sim.shapes import load_shapes

    out = tmp_path_factory.mktemp("calibration")
    shapes = [s for s in load_shapes() if s.name == "qwen2.5-3b"]
    block = 128
    features = FeatureSource({s.name: vars(s) for s in shapes}, block, "h200")
    truth = json.loads(PINNED_PROFILE.read_text())["terms"]
    truth = {t: {f: c for f, c in truth[t].items()} | {"const": 0.02} for t in truth}  # a launch cost
    rng = np.random.default_rng(0)
    csv = out / "h200_raw.csv"
    rows = []
    for point in build_grid(shapes):
        probe = Measurement(point.key, "", point.split, point.model, point.lengths, point.kept_fractions, 1.0, 0.0)
        feats = features(probe)
        for term in point.terms:
            exact = fitting.term_prediction(term, truth, feats)
            ms = max(exact, 0.05) * float(np.exp(rng.normal(0.0, 0.03)))
            rows.append({"key": point.key, "term": term, "split": point.split, "model": point.model,
                         "lengths": ";".join(map(str, point.lengths)),
                         "kept_fractions": ";".join(map(str, point.kept_fractions)),
                         "median_ms": ms, "p20_ms": ms * 0.99, "p80_ms": ms * 1.01, "reps": 5})
    store.append_rows(csv, rows)
    grid = run.grid_description(shapes, block, None, len(build_grid(shapes)))
    run.write_meta(csv, {"command": "python -m calibrate.run", "date": "2026-12-02T00:00:00+00:00", "torch": "t",
                         "triton": "tr", "gpu_name": "synthetic", "driver": "d", "grid": grid})
    profile = out / "h200.json"
    assert fit.main(["--csv", str(csv), "--out", str(profile)]) == 0
    return profile


BENCH_CSV = """\
case,T,ndocs,sparsity,kept_fraction,impl,fwd_ms,fwdbwd_ms,fwd_tflops,fwdbwd_tflops,speedup_vs_flex_fwdbwd,error
packed64k,65536,40,0.0,1.0,flex,3,11,300,300,,
packed64k,65536,40,0.0,1.0,triton_sparse,2.5,9,330,330,1.2,
packed64k,65536,40,0.9,0.11,flex,0.5,1.7,300,300,,
packed64k,65536,40,0.9,0.11,triton_sparse,0.4,1.2,330,330,1.4,
single,8192,1,0.0,1.0,cudnn_dense,0.5,1.8,400,400,,
single,8192,1,0.0,1.0,triton_sparse,0.6,2.0,330,330,,
single,8192,1,0.9,0.12,flex,,,,,,RuntimeError('out of memory')
single,8192,1,0.9,0.12,triton_sparse,0.1,0.3,330,330,,
selection_32k,32768,1,0.9,0.1,select[p=0.9],0.3,4,,,,select/attn_fwdbwd=0.07
"""


@pytest.fixture
def bench_csv(tmp_path) -> Path:
    path = tmp_path / "attention_h200.csv"
    path.write_text(BENCH_CSV)
    return path
