"""calibrate.memory's fitting side: synthetic measurements made from known terms come back as those terms,
the profile it writes is the one sim.memory reads, and the table scores the held-out token count."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from sparsebalance.calibrate import memory
from sparsebalance.calibrate.memory import COLUMNS, HELDOUT_TOKENS, activation_bytes, build_points, fit_profile
from sparsebalance.sim.config import ModelConfig
from sparsebalance.sim.memory import MODES, TokenTerms, load_profile_terms

SHAPES = {"qwen2.5-3b": dict(hidden=2048, heads=16, kv_heads=2, head_dim=128, ffn=11008),
          "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336)}
# bytes a made-up GPU "measures": per shape and mode (full, checkpointed)
TRUE = {("qwen2.5-3b", 0): TokenTerms(120_000.0, 600.0, 60_000.0, 9e7),
        ("qwen2.5-3b", 1): TokenTerms(4_200.0, 600.0, 180_000.0, 9e7),
        ("llama3-8b", 0): TokenTerms(180_000.0, 700.0, 90_000.0, 2.4e8),
        ("llama3-8b", 1): TokenTerms(8_300.0, 700.0, 270_000.0, 2.4e8)}


def synthetic_rows(skew: float = 0.0) -> pd.DataFrame:
    """What the measurer would write if the GPU held exactly TRUE (plus the block selection); ``skew`` adds
    that share of extra bytes to the held-out points' peaks."""
    rows = []
    for point in build_points(list(SHAPES)):
        row = {"model": point.model, **SHAPES[point.model], "block_size": 128, "layers": point.layers,
               "checkpointing": int(point.checkpointing), "kept_fraction": point.kept_fraction,
               "lengths": ";".join(map(str, point.lengths)), "tokens": point.tokens, "base_bytes": 5e9,
               "forward_peak_bytes": 0}
        held, peak = activation_bytes(row, TRUE[(point.model, int(point.checkpointing))])
        extra = skew * peak if point.tokens == HELDOUT_TOKENS else 0.0
        rows.append(row | {"held_bytes": held, "peak_bytes": peak + extra})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def test_fit_recovers_the_terms_it_was_made_from():
    profile, table = fit_profile(synthetic_rows(), {"gpu_name": "NVIDIA H200"})
    for (model, ckpt), truth in TRUE.items():
        got = profile["shapes"][model]["modes"][MODES[ckpt]]
        for name in ("held_layer", "held_micro_batch", "transient", "transient_bytes"):
            assert got[name] == pytest.approx(getattr(truth, name), rel=1e-6), (model, ckpt, name)
    assert profile["fit"]["heldout_peak_abs_err_pct"]["max"] < 1e-6
    assert set(table["split"]) == {"fit", "heldout"} and len(table) == len(synthetic_rows())


def test_heldout_error_is_the_fits_miss_on_points_it_did_not_see():
    profile, table = fit_profile(synthetic_rows(skew=0.04), {})
    heldout = table[table["split"] == "heldout"]
    assert heldout["fitted_err_%"].to_numpy() == pytest.approx(100 * (1 / 1.04 - 1), rel=1e-6)
    assert profile["fit"]["heldout_peak_abs_err_pct"]["median"] == pytest.approx(100 * (1 - 1 / 1.04), rel=1e-6)


def test_written_profile_is_what_the_simulator_reads(tmp_path, capsys):
    raw = tmp_path / "memory_raw.csv"
    synthetic_rows().to_csv(raw, index=False)
    (tmp_path / "memory_raw.meta.json").write_text(json.dumps({"gpu_name": "NVIDIA H200", "command": "x"}))
    out = tmp_path / "h200_memory.json"
    assert memory.main(["--fit", str(raw), "--profile", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "held-out peak |error| %" in stdout and "first_principles_err_%" in stdout
    profile = json.loads(out.read_text())
    assert profile["gpu"] == "NVIDIA H200"
    assert profile["meta"]["fit_command"].startswith("python -m calibrate.memory --fit")
    qwen = ModelConfig(name="qwen2.5-3b", layers=36, vocab=151936, max_context=32768, **SHAPES["qwen2.5-3b"])
    terms = load_profile_terms(str(out), qwen)
    assert terms["checkpointed"].transient == pytest.approx(TRUE[("qwen2.5-3b", 1)].transient, rel=1e-6)


def test_too_few_points_to_fit_is_one_line(tmp_path, capsys):
    raw = tmp_path / "memory_raw.csv"
    rows = synthetic_rows()
    rows[rows["layers"] == 1].to_csv(raw, index=False)
    line = refused(capsys, ["--fit", raw, "--profile", tmp_path / "p.json"])
    assert "needs points at 2+ layer counts" in line
    assert "it has layers [1], tokens [4096, 8192, 32768, 65536]" in line  # plain numbers, not np.int64(1)
    assert not (tmp_path / "p.json").exists()


def refused(capsys, argv) -> str:
    """The one ``error:`` line of calibrate.memory refusing ``argv`` (exit code 2)."""
    with pytest.raises(SystemExit) as done:
        memory.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("column, value, shown, allowed", [
    ("peak_bytes", float("nan"), "nan", "a finite number of bytes >= 0"),
    ("peak_bytes", -1000, "-1000.0", "a finite number of bytes >= 0"),
    ("held_bytes", float("inf"), "inf", "a finite number of bytes >= 0"),
    ("tokens", "abc", "'abc'", "a whole number >= 1"),
    ("layers", 0, "0", "a whole number >= 1"),
    ("checkpointing", 2, "2", "0 or 1"),
    ("kept_fraction", 1.5, "1.5", "a number in (0, 1]"),
    ("lengths", "4096;-1", "'4096;-1'", "';'-joined whole numbers >= 1 adding up to tokens"),
    ("lengths", "1;2", "'1;2'", "';'-joined whole numbers >= 1 adding up to tokens"),
], ids=["nan-peak", "negative-peak", "inf-held", "text-tokens", "no-layers", "checkpointing", "kept", "negative-length",
        "lengths-not-tokens"])
def test_a_bad_row_is_one_line_and_writes_nothing(tmp_path, capsys, column, value, shown, allowed):
    raw = tmp_path / "memory_raw.csv"
    rows = synthetic_rows().astype({column: object})
    rows.loc[2, column] = value
    rows.to_csv(raw, index=False)
    out = tmp_path / "p.json"
    err = refused(capsys, ["--fit", raw, "--profile", out])
    assert f"--fit {raw}: row 3 (model {rows.loc[2, 'model']}) has {column}={shown}; allowed: {allowed}" in err, err
    assert not out.exists()


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_an_output_path_that_cannot_be_written_is_refused_first(tmp_path, capsys, where):
    raw = tmp_path / "memory_raw.csv"
    synthetic_rows().to_csv(raw, index=False)
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    profile = raw / "p.json" if where == "under-a-file" else Path("/proc/m.json")
    assert f"--profile='{profile}' cannot be written (" in refused(capsys, ["--fit", raw, "--profile", profile])
    assert capsys.readouterr().out == ""  # refused before fitting
    assert "--out='{}' is a file; allowed: a directory path".format(raw) in refused(capsys, ["--out", raw])
