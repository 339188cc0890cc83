"""``python -m runner.evaluate`` on a tiny checkpoint: per-sequence rows under every budget, Wilson intervals,
identical files from identical inputs, and bad input refused in one line before anything is written."""
from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sparsebalance.runner.task import TaskConfig
from sparsebalance.runner.evaluate import main, summarise
from tiny import TINY_ONE_RANK

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--lengths", "64,128", "--p", "1.0,0.5", "--sequences", "6"]
Z95 = 1.959963984540054


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Two training steps of the tiny model, with the checkpoint written at the end."""
    run = tmp_path_factory.mktemp("evaluate") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    cmd = [sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={run}", *TINY_ONE_RANK, "steps=2",
           "runner.checkpoint_every=2", "runner.device=cpu", "write_plans=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def evaluated(run_dir) -> tuple[pd.DataFrame, pd.DataFrame]:
    assert main([str(run_dir), *ARGS]) == 0
    return pd.read_csv(run_dir / "eval.csv"), pd.read_csv(run_dir / "eval_summary.csv")


def wilson(k: int, n: int) -> tuple[float, float]:
    centre = (k + Z95**2 / 2) / (n + Z95**2)
    half = Z95 / (n + Z95**2) * math.sqrt(k * (n - k) / n + Z95**2 / 4)
    return centre - half, centre + half


@pytest.mark.slow
def test_every_sequence_is_scored_under_every_budget(evaluated):
    rows, _ = evaluated
    assert len(rows) == 2 * 2 * 6
    assert rows.groupby(["length", "p"]).size().to_dict() == {(64, 0.5): 6, (64, 1.0): 6, (128, 0.5): 6,
                                                              (128, 1.0): 6}
    assert rows["answers"].between(1, 2).all()  # n_queries=2, at least one pair
    pd.testing.assert_series_equal(rows["accuracy"], rows["correct"] / rows["answers"], check_names=False,
                                   check_dtype=False)
    dense, sparse = rows[rows["p"] == 1.0], rows[rows["p"] == 0.5]
    assert (dense["kept_fraction"] == 1.0).all() and (dense["coverage"] == 1.0).all()
    # 128 tokens are 4 blocks of 32: half the attention mass leaves blocks out.
    assert (sparse.loc[sparse["length"] == 128, "kept_fraction"] < 1.0).all()
    # The same held-out sequences under each budget.
    assert list(dense["seq_id"]) == list(sparse["seq_id"]) == list(range(12))


@pytest.mark.slow
def test_the_summary_is_pooled_accuracy_with_its_wilson_interval(evaluated):
    rows, summary = evaluated
    assert len(summary) == 4
    for _, s in summary.iterrows():
        group = rows[(rows["length"] == s["length"]) & (rows["p"] == s["p"])]
        k, n = int(group["correct"].sum()), int(group["answers"].sum())
        assert s["answers"] == n and s["sequences"] == 6
        assert s["accuracy"] == pytest.approx(k / n)
        low, high = wilson(k, n)
        assert (s["ci_low"], s["ci_high"]) == (pytest.approx(low, abs=1e-6), pytest.approx(high, abs=1e-6))
        assert s["chance"] == pytest.approx(1 / 16)


def test_the_interval_pools_the_answers_of_a_length_and_budget():
    """7 of 20 answers right, over three sequences: 0.35 in [0.1812, 0.5671] (Wilson, 95%)."""
    rows = pd.DataFrame({"length": [64, 64, 64, 128], "p": [0.9, 0.9, 0.9, 0.9], "seq_id": [0, 1, 2, 3],
                         "items": [8, 8, 4, 2], "answers": [8, 8, 4, 2], "correct": [1, 4, 2, 2],
                         "kept_fraction": [0.5, 0.7, 0.6, 1.0], "coverage": [0.8, 0.9, 1.0, 1.0]})
    summary = summarise(rows, TaskConfig(n_values=32)).set_index("length")
    assert summary.loc[64, "accuracy"] == pytest.approx(0.35) and summary.loc[64, "answers"] == 20
    assert summary.loc[64, ["ci_low", "ci_high"]].tolist() == pytest.approx([0.18119, 0.56715], abs=1e-5)
    assert summary.loc[64, ["kept_fraction", "coverage", "chance"]].tolist() == pytest.approx([0.6, 0.9, 1 / 32])
    assert summary.loc[64, "item_chance"] == pytest.approx((8 / 8 + 8 / 8 + 4 / 4) / 20)
    assert summary.loc[128, ["accuracy", "ci_high", "item_chance"]].tolist() == pytest.approx([1.0, 1.0, 0.5])


@pytest.mark.slow
def test_the_same_inputs_write_the_same_files(run_dir, evaluated, tmp_path):
    assert main([str(run_dir / "checkpoint.pt"), *ARGS, "--out", str(tmp_path)]) == 0
    for name in ("eval.csv", "eval_summary.csv"):
        assert (tmp_path / name).read_bytes() == (run_dir / name).read_bytes()


@pytest.mark.parametrize("args, message", [
    (["--p", "1.5"], "--p 1.5: allowed: budgets in (0, 1]"),
    (["--p", "nan"], "--p nan: allowed: budgets in (0, 1]"),
    (["--p", "high"], "'high' is not a comma-separated list of floats"),
    (["--lengths", "16"], "--lengths 16: allowed: lengths in [25, 512]"),
    (["--lengths", "64,4096"], "--lengths 4096: allowed: lengths in [25, 512]"),
    (["--sequences", "0"], "--sequences 0: allowed: >= 1"),
    (["--seed", "5"], "--seed 5: the checkpoint trained on that seed; allowed: any other"),
    (["--seed", "-1"], "--seed -1: allowed: a whole number >= 0 other than the training seed"),
    (["--out", "/proc"], "--out='/proc' cannot be written (No such file or directory)"),
    (["--device", "tpu"], "--device='tpu' is unknown; allowed: auto, cuda, cpu"),
])
@pytest.mark.slow  # run_dir: a training run
def test_a_bad_option_is_one_line_and_writes_nothing(run_dir, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main([str(run_dir), "--out", str(tmp_path), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not any(tmp_path.iterdir())


def test_a_bad_source_is_one_line(tmp_path, capsys):
    not_a_checkpoint = tmp_path / "checkpoint.pt"
    not_a_checkpoint.write_text("weights")
    for source, message in [(tmp_path / "nothing", f"{tmp_path / 'nothing'}: no checkpoint there"),
                            (ROOT / "runner", f"{ROOT / 'runner'}: no checkpoint there"),
                            (not_a_checkpoint, f"{not_a_checkpoint}: not a torch checkpoint")]:
        with pytest.raises(SystemExit) as exc:
            main([str(source)])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
