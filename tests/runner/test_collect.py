"""runner.collect: several runs' tables in one place, labelled by run, and the budget tables computed from the
per-sequence rows."""
import pandas as pd
import pytest

from sparsebalance.runner import collect

# per run: (step, length, p, kept_fraction, coverage) of each sequence
SEQUENCES = {
    "baseline_s0": [(0, 100, 0.9, 1.0, 1.0), (0, 300, 0.9, 0.5, 0.9), (1, 200, 0.9, 0.8, 0.95)],
    "sparsebalance_s0": [(0, 100, 0.95, 1.0, 1.0), (0, 300, 0.8, 0.4, 0.8), (1, 200, 0.9, 0.7, 0.9)],
}


def write_run(root, name, rows):
    run = root / name
    run.mkdir()
    pd.DataFrame({"step": [0, 1], "loss": [2.0, 1.5], "plan_sha256": ["a", "b"]}).to_csv(run / "train.csv", index=False)
    pd.DataFrame(rows, columns=["step", "length", "p", "kept_fraction", "coverage"]).to_csv(
        run / "sequences.csv", index=False)
    return run


@pytest.fixture
def runs(tmp_path):
    return [write_run(tmp_path, name, rows) for name, rows in SEQUENCES.items()]


def test_tables_are_labelled_by_run_and_weighted_by_attention_work(runs, tmp_path):
    out = tmp_path / "out"
    assert collect.main([*map(str, runs), "--out", str(out), "--length-edges", "150,250"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["budgets.csv", "coverage_by_length.csv", "train.csv"]
    train = pd.read_csv(out / "train.csv")
    assert list(train.columns) == ["run", "step", "loss"]  # the plan hash stays with the plans
    assert train["run"].tolist() == ["baseline_s0"] * 2 + ["sparsebalance_s0"] * 2

    budgets = pd.read_csv(out / "budgets.csv").set_index(["run", "step"])
    first = budgets.loc[("sparsebalance_s0", 0)]
    assert (first.mean_p, first.min_p, first.max_p) == pytest.approx((0.875, 0.8, 0.95))
    assert first.kept_fraction == pytest.approx(0.7)
    # lengths 100 and 300: weights 1 and 9
    assert first.kept_fraction_attn == pytest.approx((1.0 * 1 + 0.4 * 9) / 10)
    assert first.coverage_attn == pytest.approx((1.0 * 1 + 0.8 * 9) / 10)

    by_length = pd.read_csv(out / "coverage_by_length.csv")
    # buckets from the shortest to the longest sequence, ordered by length within a run
    assert by_length[by_length.run == "baseline_s0"]["length_bucket"].tolist() == \
        ["(99, 150]", "(150, 250]", "(250, 300]"]
    assert by_length["sequences"].tolist() == [1, 1, 1, 1, 1, 1]
    long = by_length[by_length.length_bucket == "(250, 300]"].set_index("run")
    assert long.loc["sparsebalance_s0", "mean_p"] == pytest.approx(0.8)


def test_same_runs_give_the_same_bytes(runs, tmp_path):
    for out in ("a", "b"):
        collect.main([*map(str, runs), "--out", str(tmp_path / out)])
    for name in ("train.csv", "budgets.csv", "coverage_by_length.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("case, message", [
    ("not a run", "not a training run dir (no train.csv)"),
    ("same name twice", "run dirs share the name baseline_s0"),
    ("bad edges", "--length-edges 256,128: edges must be positive and strictly ascending"),
    ("edges not numbers", "argument --length-edges: 'short' is not a comma-separated list of ints"),
])
def test_bad_input_is_one_line_and_writes_nothing(runs, tmp_path, capsys, case, message):
    args = [*map(str, runs)]
    if case == "not a run":
        (tmp_path / "empty").mkdir()
        args.append(str(tmp_path / "empty"))
    elif case == "same name twice":
        (tmp_path / "other").mkdir()
        args.append(str(write_run(tmp_path / "other", "baseline_s0", SEQUENCES["baseline_s0"])))
    elif case == "bad edges":
        args += ["--length-edges", "256,128"]
    else:
        args += ["--length-edges", "short"]
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        collect.main([*args, "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("case, message", [
    ("under a file", "/file/out' cannot be written (Not a directory)"),
    ("a file", "/file' is a file; allowed: a directory path"),
])
def test_an_out_that_cannot_be_written_is_one_line(runs, tmp_path, capsys, case, message):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out" if case == "under a file" else tmp_path / "file"
    with pytest.raises(SystemExit) as exit_:
        collect.main([*map(str, runs), "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out=") and message in err[0], err
