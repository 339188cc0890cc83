"""The committed H200 profile: measured (not provisional), reproducible from the raw CSV beside it, accurate."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibrate import fit
from calibrate.run import meta_path
from sim.cost import TERMS, load_profile

PROFILES = Path(__file__).resolve().parents[2] / "calibrate" / "profiles"


@pytest.fixture(scope="module")
def profile():
    return load_profile(str(PROFILES / "h200.json"))


def test_profile_is_measured_on_an_h200_with_its_raw_data_and_command(profile):
    assert profile["provisional"] is False
    meta = profile["meta"]
    assert meta["gpu_name"] == "NVIDIA H200" and meta["driver"] and meta["torch"] and meta["triton"]
    assert "calibrate.run" in meta["command"] and "calibrate.fit" in meta["command"]
    csv = PROFILES / meta["raw_csv"]
    assert csv.is_file() and meta_path(csv).is_file()


def test_profile_coefficients_refit_from_the_committed_csv(profile):
    csv = PROFILES / profile["meta"]["raw_csv"]
    grid = json.loads(meta_path(csv).read_text())["runs"][-1]["grid"]
    coefs = fit.fit_all(fit.load_measurements(csv), fit.FeatureSource(grid["models"], grid["block_size"]))
    for term in TERMS:
        assert coefs[term] == pytest.approx(profile["terms"][term], rel=1e-6, abs=1e-15), term


def test_profile_meets_the_error_targets(profile):
    heldout = profile["fit"]["heldout_mape"]
    assert heldout["attn_fwd+bwd"]["median_ape_pct"] <= 5.0
    assert heldout["layer"]["median_ape_pct"] <= 5.0
    validation = profile["fit"]["validation"]
    assert len(validation) >= 3 and all(abs(v["error_pct"]) <= 10.0 for v in validation)


def test_cost_features_describe_the_kernels_dkdv_tiles():
    """``kv_blocks`` and ``path_flops`` count dK/dV programs of DKDV_KEYS keys: the kernel's long- and
    short-row dK/dV configs must use that tile, or the fitted profile describes another grid."""
    from kernels.sparse_attention import launch as tk
    from sim.cost import DKDV_KEYS

    assert {tk.DEFAULT_CONFIG[kind]["BN"] for kind in ("dkdv", "dkdv_short")} == {DKDV_KEYS}
