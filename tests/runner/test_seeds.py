"""runner.seeds: held-out accuracy compared over seeds, paired by seed, from run dirs' own files."""
import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from sparsebalance.runner import seeds

# (policy, seed) -> correct answers at p = 1.0 and 0.9 for two lengths of 100 answers each
CORRECT = {("baseline", 0): ((50, 60), (40, 50)), ("sparsebalance", 0): ((55, 60), (45, 50)),
           ("baseline", 1): ((30, 40), (30, 40)), ("sparsebalance", 1): ((20, 40), (20, 40)),
           ("baseline", 2): ((45, 45), (44, 44)), ("sparsebalance", 2): ((50, 46), (44, 44))}


def write_run(root, policy, seed, correct, steps=100):
    run = root / f"{policy}_s{seed}"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"policy": policy, "seed": seed, "steps": steps}))
    rows = [{"steps": steps, "length": length, "p": p, "answers": 100, "accuracy": c / 100}
            for p, per_length in zip((1.0, 0.9), correct, strict=True)
            for length, c in zip((128, 512), per_length, strict=True)]
    pd.DataFrame(rows).to_csv(run / "eval_summary.csv", index=False)
    return run


@pytest.fixture
def runs(tmp_path):
    return [write_run(tmp_path, policy, seed, correct) for (policy, seed), correct in CORRECT.items()]


def test_accuracy_pools_lengths_and_pairs_by_seed(runs, tmp_path, capsys):
    out = tmp_path / "seeds.csv"
    assert seeds.main([*map(str, runs), "--out", str(out)]) == 0
    rows = pd.read_csv(out)
    at_1 = rows[rows.p == 1.0].set_index("seed")
    assert at_1.loc[0, "baseline"] == pytest.approx(0.55) and at_1.loc[0, "sparsebalance"] == pytest.approx(0.575)
    differences = np.array([0.025, -0.05, 0.03])
    assert at_1["difference"].to_numpy() == pytest.approx(differences)
    low, high = stats.t.interval(0.95, 2, loc=differences.mean(), scale=stats.sem(differences))
    printed = capsys.readouterr().out
    assert f"over 3 seeds: {differences.mean():+.4f} [{low:+.4f}, {high:+.4f}]" in printed


def test_a_seed_without_its_pair_is_left_out(runs, tmp_path):
    lone = write_run(tmp_path, "baseline", 7, ((90, 90), (90, 90)))
    rows = seeds.paired(pd.concat([seeds.run_accuracy(r) for r in [*runs, lone]]), "baseline", "sparsebalance")
    assert sorted(set(rows["seed"])) == [0, 1, 2]


def test_one_seed_pair_gives_its_difference_and_says_the_interval_is_na(runs, tmp_path, capsys):
    assert seeds.main([str(runs[0]), str(runs[1]), "--out", str(tmp_path / "seeds.csv")]) == 0
    printed = capsys.readouterr().out
    assert "sparsebalance - baseline over 1 seeds: +0.0250 interval and Wilcoxon p n/a (one seed pair)" in printed
    assert "nan" not in printed.lower()
    assert seeds.effect(pd.Series([0.1])) == {"seeds": 1, "mean": 0.1, "ci_low": None, "ci_high": None,
                                              "wilcoxon_p": None}


@pytest.mark.parametrize("difference", [0.0, 0.1])
def test_equal_differences_give_the_mean_as_the_interval(difference):
    result = seeds.effect(pd.Series([difference] * 3))
    assert (result["ci_low"], result["ci_high"]) == pytest.approx((difference, difference))
    assert not np.isnan(result["wilcoxon_p"])


def test_an_out_that_cannot_be_written_is_one_line_before_any_work(runs, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        seeds.main([*map(str, runs), "--out", str(tmp_path / "file" / "seeds.csv")])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "seeds.csv' cannot be written" in captured.err


@pytest.mark.parametrize("case, message", [
    ("unequal steps", "runs trained different steps (100, 200)"),
    ("no such policy", "--baseline/--policy 'lbb': no run of it"),
    ("not a run dir", "not an evaluated run dir"),
])
def test_bad_input_is_one_line(runs, tmp_path, capsys, case, message):
    args = [*map(str, runs)]
    if case == "unequal steps":
        args.append(str(write_run(tmp_path, "sparsebalance", 9, ((1, 1), (1, 1)), steps=200)))
    elif case == "no such policy":
        args += ["--baseline", "lbb"]
    else:
        args.append(str(tmp_path / "missing"))
    out = tmp_path / "seeds.csv"
    with pytest.raises(SystemExit) as exit_:
        seeds.main([*args, "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not out.exists()
