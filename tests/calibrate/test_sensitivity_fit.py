"""``python -m calibrate.sensitivity``: exponents, the model of s by length and its choice, the held-out report,
the profile the simulator reads, ``--check``, and one line for every bad input.

The raw CSVs here are synthetic, written in runner.sensitivity's format from known exponents, so that what the
fit must recover is known exactly."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st
from scipy.special import expit

from sparsebalance.calibrate import sensitivity as fit
from sparsebalance.sim.sensitivity import RAW_COLUMNS, load_sensitivity_profile, raw_meta_path

LENGTHS = (512, 1024, 2048, 4096)
KEPT = (0.1, 0.25, 0.5, 1.0)  # kept fraction 1 says nothing about s and is left out


def synthetic(path: Path, logit_mean, logit_std: float, per_length: int = 8, task: str = "retrieval",
              layer_offsets=(0.0, 0.0), seed: int = 0) -> pd.DataFrame:
    """A raw CSV (and its run facts) whose sequence s has logit(s) ~ N(logit_mean(length), logit_std^2) and whose
    layer l has exponent s + layer_offsets[l], coverage = kf ** exponent exactly."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, (length, z) in enumerate((n, rng.standard_normal()) for n in LENGTHS for _ in range(per_length)):
        s = expit(logit_mean(length) + logit_std * z)
        for layer, offset in enumerate(layer_offsets):
            rows += [{"task": task, "seq_id": 1000 + i, "length": length, "data_sensitivity": 0.5, "layer": layer,
                      "mode": "kept", "budget": kf, "kept_fraction": kf, "coverage": kf ** (s + offset)} for kf in KEPT]
    frame = pd.DataFrame(rows, columns=list(RAW_COLUMNS))
    frame.to_csv(path, index=False)
    raw_meta_path(path).write_text(json.dumps({"command": "python -m runner.sensitivity x", "date": "2026-12-04",
                                               "model": {"name": "tiny"}, "task": {task: {"kind": task}}}))
    return frame


def linear(length):
    return 1.0 - 0.3 * np.log(length / 512)


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = fit.main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@settings(max_examples=50)
@given(s=st.floats(0.002, 0.999), kept=st.lists(st.floats(0.01, 0.99), min_size=1, max_size=6))
def test_an_exact_power_law_gives_its_exponent_back(s, kept):
    points = pd.DataFrame({"g": 0, "kept_fraction": kept + [1.0], "coverage": [k ** s for k in kept] + [1.0]})
    got = fit.exponents(points, ["g"])
    assert got["s"].item() == pytest.approx(s, rel=1e-9)
    assert got["points"].item() == len(kept) and not got["clipped"].item()


def test_exponents_are_clipped_into_0_1_and_say_so():
    points = pd.DataFrame({"g": [0, 0, 1, 1], "kept_fraction": [0.5, 0.25, 0.5, 0.25],
                           "coverage": [0.4, 0.2, 1.0, 1.0]})  # coverage below kf (s > 1), and coverage 1 (s = 0)
    got = fit.exponents(points, ["g"]).set_index("g")
    assert got.loc[0, "s"] == 1.0 and got.loc[1, "s"] == pytest.approx(1e-3)
    assert got["clipped"].tolist() == [True, True]


def test_a_linear_logit_is_recovered_chosen_and_drawn_by_the_simulator(tmp_path, capsys):
    csv = tmp_path / "raw.csv"
    synthetic(csv, linear, 0.3, per_length=16)
    out = tmp_path / "sensitivity_test.json"
    code, printed, _ = run(capsys, csv, "--out", out)
    assert code == 0 and "retrieval: linear model, knots [512, 4096]" in printed
    profile = json.loads(out.read_text())
    report = profile["fit"]["tasks"]["retrieval"]
    assert report["chosen"] == "linear"
    assert report["sequences"] == {"fit": 48, "heldout": 16, "clipped": 0, "dense": 0}
    # an exact power law per layer and per sequence
    assert profile["fit"]["power_law"]["sequence"]["median_rel_err_coverage"] == pytest.approx(0, abs=1e-6)
    assert profile["fit"]["power_law"]["sequence"]["points"] == 64 * 3
    entry = profile["tasks"]["retrieval"]
    np.testing.assert_allclose(entry["logit_mean"], [linear(512), linear(4096)], atol=0.15)
    assert entry["logit_std"][0] == entry["logit_std"][1] == pytest.approx(0.3, abs=0.08)
    held = report["heldout"]
    assert held["linear"]["rmse_logit"] < held["constant_rmse_logit"]
    model = load_sensitivity_profile(str(out))
    assert model.task == "retrieval" and model.lengths == (512, 4096)
    assert profile["meta"]["task"] == {"retrieval": {"kind": "retrieval"}}
    assert "python -m runner.sensitivity x && python -m calibrate.sensitivity" in profile["meta"]["command"]


def test_a_mean_that_is_not_linear_in_log_length_gets_a_knot_per_length(tmp_path, capsys):
    csv = tmp_path / "raw.csv"
    zigzag = {512: -1.0, 1024: 1.0, 2048: -1.0, 4096: 1.0}
    synthetic(csv, zigzag.get, 0.1)
    out = tmp_path / "p.json"
    assert run(capsys, csv, "--out", out)[0] == 0
    profile = json.loads(out.read_text())
    assert profile["fit"]["tasks"]["retrieval"]["chosen"] == "per_length"
    entry = profile["tasks"]["retrieval"]
    assert entry["lengths"] == list(LENGTHS)
    np.testing.assert_allclose(entry["logit_mean"], [-1, 1, -1, 1], atol=0.15)
    np.testing.assert_allclose(entry["logit_std"], 0.1, atol=0.08)


def test_layers_with_different_exponents_are_reported_per_layer(tmp_path, capsys):
    csv = tmp_path / "raw.csv"
    synthetic(csv, lambda n: 0.0, 0.05, layer_offsets=(-0.2, 0.2))
    out = tmp_path / "p.json"
    assert run(capsys, csv, "--out", out)[0] == 0
    layers = json.loads(out.read_text())["fit"]["tasks"]["retrieval"]["per_layer"]
    assert [row["layer"] for row in layers] == [0, 1]
    assert layers[0]["mean_s"] == pytest.approx(0.3, abs=0.02) and layers[1]["mean_s"] == pytest.approx(0.7, abs=0.02)


def test_a_sequence_kept_dense_at_every_budget_has_no_exponent_and_is_counted(tmp_path, capsys):
    csv = tmp_path / "raw.csv"
    frame = synthetic(csv, linear, 0.3)
    first = frame["seq_id"] == frame["seq_id"].min()
    frame.loc[first, ["kept_fraction", "coverage"]] = 1.0
    frame.to_csv(csv, index=False)
    out = tmp_path / "p.json"
    assert run(capsys, csv, "--out", out)[0] == 0
    counts = json.loads(out.read_text())["fit"]["tasks"]["retrieval"]["sequences"]
    assert counts["dense"] == 1 and counts["fit"] + counts["heldout"] == 31


def test_the_fit_is_the_same_from_the_same_files(tmp_path, capsys):
    csv = tmp_path / "raw.csv"
    synthetic(csv, linear, 0.3)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    run(capsys, csv, "--out", a)
    run(capsys, csv, "--out", b)
    strip = lambda p: {k: v for k, v in json.loads(p.read_text()).items() if k != "meta"}  # noqa: E731
    assert strip(a) == strip(b)


def test_check_passes_a_good_profile_and_names_a_missed_target(tmp_path, capsys):
    csv = tmp_path / "raw.csv"
    synthetic(csv, linear, 0.3, per_length=16)
    out = tmp_path / "p.json"
    code, printed, _ = run(capsys, csv, "--out", out, "--check")
    assert code == 0 and "targets met" in printed
    profile = json.loads(out.read_text())
    profile["fit"]["tasks"]["retrieval"]["heldout"]["linear"]["share_in_80pct_interval"] = 0.25
    profile["fit"]["power_law"]["sequence"]["median_rel_err_coverage"] = 0.2
    out.write_text(json.dumps(profile))
    code, _, err = run(capsys, "--check", out)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "power law median relative coverage error per sequence 0.2000 (at most 0.05)" in lines[0]
    assert "retrieval held-out share in the linear model's 80% interval 0.2500 (at least 0.6)" in lines[0]


def _frame_edit(edit):
    def make(tmp_path: Path) -> list[Path]:
        csv = tmp_path / "raw.csv"
        frame = synthetic(csv, linear, 0.3)
        edit(frame).to_csv(csv, index=False)
        return [csv]
    return make


def _two_of_one_task(tmp_path: Path) -> list[Path]:
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    synthetic(a, linear, 0.3)
    synthetic(b, linear, 0.3)
    return [a, b]


def _no_meta(tmp_path: Path) -> list[Path]:
    csv = tmp_path / "raw.csv"
    synthetic(csv, linear, 0.3)
    raw_meta_path(csv).unlink()
    return [csv]


def _few(tmp_path: Path) -> list[Path]:
    csv = tmp_path / "raw.csv"
    synthetic(csv, linear, 0.3, per_length=2)
    return [csv]


BAD = {
    # name: (the CSVs given, what the one line must say)
    "no such file": (lambda tmp: [tmp / "missing.csv"], "missing.csv: no such file"),
    "no run facts": (_no_meta, "no run facts raw.meta.json beside it"),
    "a column missing": (_frame_edit(lambda f: f.drop(columns="coverage")), "allowed: task, seq_id, length"),
    "a coverage of 0": (_frame_edit(lambda f: f.assign(coverage=f["coverage"].where(f.index != 5, 0.0))),
                        "row 6 has coverage=0.0; allowed: a number in (0, 1]"),
    "a kept fraction above 1": (_frame_edit(lambda f: f.assign(kept_fraction=f["kept_fraction"] * 2)),
                                "row 4 has kept_fraction=2.0; allowed: a number in (0, 1]"),
    "an unknown mode": (_frame_edit(lambda f: f.assign(mode="topk")), "row 1 has mode='topk'; allowed: one of p, kept"),
    "a fractional length": (_frame_edit(lambda f: f.assign(length=f["length"] + 0.5)), "row 1 has length=512.5"),
    "no rows": (_frame_edit(lambda f: f.iloc[:0]), "no rows"),
    "one task twice": (_two_of_one_task, "task 'retrieval' is measured in"),
    "too few sequences": (_few, "no held-out sequence; allowed: at least 4 sequences per length"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, name):
    csvs = BAD[name][0](tmp_path)
    out = tmp_path / "p.json"
    code, _, err = run(capsys, *csvs, "--out", out)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and BAD[name][1] in lines[0], err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("argv, needle", [
    ([], "nothing to do; allowed: raw CSVs to fit (with --out), or --check PROFILE"),
    (["raw.csv"], "--out is missing"),
    # a cost or memory profile is named as not a sensitivity profile, whatever its schema version
    (["--check", "tests/fixtures/profile_h200.json"],
     "--check='tests/fixtures/profile_h200.json': kind=None: allowed: 'sensitivity' (a cost or memory profile is "
     "not a sensitivity one)"),
    (["--check", "calibrate/profiles/h200_memory.json"], "kind=None: allowed: 'sensitivity'"),
])
def test_bad_options_are_one_line(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err


def test_an_output_path_that_cannot_be_written_is_refused_before_the_fit(tmp_path, capsys):
    csv = tmp_path / "raw.csv"
    synthetic(csv, linear, 0.3)
    out = csv / "p.json"  # under a file
    code, printed, err = run(capsys, csv, "--out", out)
    assert code == 2 and err.startswith(f"error: --out='{out}' cannot be written (") and printed == ""


def test_a_profile_the_simulator_refuses_names_the_out_path_not_its_temporary_copy(tmp_path, capsys):
    csv, out = tmp_path / "raw.csv", tmp_path / "p.json"
    synthetic(csv, linear, 0.3)
    assert run(capsys, csv, "--out", out)[0] == 0
    profile = json.loads(out.read_text()) | {"family": "beta"}
    with pytest.raises(fit.ConfigError) as err:
        fit.write_profile(out, profile)
    assert str(err.value).startswith(f"--out='{out}': family='beta'")
    assert json.loads(out.read_text())["family"] == "logit_normal"
