"""viz: figures from real Results, calibration and benchmark files; one clear line on bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from pinned import PINNED_OVERRIDES, PINNED_PROFILE
from sparsebalance.sim.config import RunConfig
from sparsebalance.sim.workload import Workload, truth_of
from sparsebalance.viz.calibration import (benchmark_vs_profile, calibration_frame, plot_calibration, plot_residuals,
                             read_profile)
from sparsebalance.viz.cli import main
from sparsebalance.viz.fidelity import fidelity_frame, plot_step_fidelity
from sparsebalance.viz.figures import profile_figures, results_figures
from sparsebalance.viz.kernels import plot_kernel_comparison, read_benchmark
from sparsebalance.viz.learning import held_out_accuracy, plot_learning, read_learning, rolling_accuracy
from sparsebalance.viz.policies import plot_frontier, plot_policies
from sparsebalance.viz.runs import PlotError, read_run, read_runs, summary_frame
from sparsebalance.viz.timeline import pick_timeline_runs, plot_timeline, replay_step

ROOT = Path(__file__).resolve().parents[2]


def assert_legible(fig):
    """Every axes with data has labelled axes, a title and the figure a legend and a suptitle."""
    axes = [ax for ax in fig.axes if ax.has_data()]
    assert axes
    for ax in axes:
        assert ax.get_xlabel() and ax.get_title(), ax
    assert any(ax.get_ylabel() for ax in axes)
    assert fig.get_suptitle() or all(ax.get_title() for ax in axes)
    assert fig.legends or any(ax.get_legend() for ax in axes)


# ----------------------------------------------------------------------------- Results
def test_sweep_is_read_in_job_order_with_settings(sweep):
    runs = read_runs(sweep)
    assert [r.policy for r in runs] == ["baseline", "kk"]
    frame = summary_frame(runs)
    assert list(frame["setting"]) == ["", ""]  # steps=2 is common to every job: not a sweep axis
    assert frame.loc[0, "speedup"] == pytest.approx(1.0)
    assert frame.loc[1, "speedup"] > 1.0


@pytest.mark.parametrize("make", [plot_policies, plot_frontier])
def test_policy_figures(sweep, make, tmp_path):
    fig = make(read_runs(sweep))
    assert_legible(fig)
    fig.savefig(tmp_path / "f.png")


def test_timeline_replays_the_recorded_step(sweep):
    runs = pick_timeline_runs(read_runs(sweep))
    traces = [replay_step(r, step=1) for r in runs]
    for trace, run in zip(traces, runs, strict=True):
        assert trace.step_ms == pytest.approx(run.steps.loc[1, "step_ms"], rel=1e-6)
        assert set(trace.ops["kind"]) == {"F", "B"}
        assert len(trace.ops) == 2 * trace.dp * trace.pp * run.summary["micro_batches"]
    assert_legible(plot_timeline(traces))


@pytest.mark.slow
def test_sim_run_draws_a_pipeline_timeline_when_asked(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sparsebalance.sim.run", "policy=kk", "steps=1", "layout.pp=2",
                           "layout.micro_batches=4", "baseline=null", "plot=true", f"hydra.run.dir={tmp_path}",
                           *PINNED_OVERRIDES],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"figures: {tmp_path / 'figures'}  (timeline.png)" in done.stdout
    assert (tmp_path / "figures" / "timeline.png").stat().st_size > 0
    trace = replay_step(read_run(tmp_path))
    assert trace.pp == 2 and set(trace.ops["stage"]) == {0, 1}
    assert_legible(plot_timeline([trace]))


def test_replay_refuses_a_run_the_current_model_would_time_differently(sweep_copy):
    steps = sweep_copy / "0" / "steps.csv"
    frame = pd.read_csv(steps)
    frame.loc[0, "step_ms"] *= 1.5
    frame.to_csv(steps, index=False)
    with pytest.raises(PlotError, match="changed since, re-run it"):
        replay_step(read_run(sweep_copy / "0"), step=0)


def test_empty_directory_says_how_to_make_results(tmp_path):
    with pytest.raises(PlotError, match=r"no Results found .*python -m sim.run"):
        read_runs(tmp_path)


def test_partial_run_is_named(sweep_copy):
    (sweep_copy / "1" / "summary.json").unlink()
    with pytest.raises(PlotError, match=r"partial Results \(no summary.json\); the run did not finish"):
        read_run(sweep_copy / "1")
    with pytest.warns(UserWarning, match="skipped: .*partial Results"):
        runs = read_runs(sweep_copy)  # the rest of the sweep still plots
    assert [r.policy for r in runs] == ["baseline"]


def test_older_schema_names_the_missing_column(sweep_copy):
    path = sweep_copy / "0" / "micro_batches.csv"
    pd.read_csv(path).drop(columns=["coverage"]).to_csv(path, index=False)
    with pytest.raises(PlotError, match=r"older or unknown Results schema \(no column coverage\)"):
        read_run(sweep_copy / "0")


def test_unknown_summary_is_refused(sweep_copy):
    (sweep_copy / "0" / "summary.json").write_text(json.dumps({"schema": 99}))
    with pytest.raises(PlotError, match="summary.json lacks policy"):
        read_run(sweep_copy / "0")


@pytest.mark.slow  # a Python process importing the plotting stack
def test_cli_bad_input_is_one_line_without_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sparsebalance.viz", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "no Results found" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("damage, message", [("partial", "partial Results"), ("schema", "older or unknown")])
def test_cli_names_a_partial_or_old_run(sweep_copy, damage, message, capsys):
    steps = sweep_copy / "0" / "steps.csv"
    steps.unlink() if damage == "partial" else steps.write_text("step,step_ms\n0,1.0\n")
    with pytest.raises(SystemExit) as exc:
        main([str(sweep_copy / "0")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.slow  # draws every results figure, over 2 s of CPU
def test_cli_writes_every_results_figure(sweep, tmp_path, capsys):
    out = tmp_path / "figs"
    assert main([str(sweep), "--out", str(out), "--format", "svg", "--step", "1"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["frontier.svg", "policies.svg", "timeline.svg"]
    assert f"figure: {out / 'timeline.svg'}" in capsys.readouterr().out


# ----------------------------------------------------------------------------- fidelity
def fake_runner_run(job_dir, slower=1.1):
    """A sim job dressed as a runner run: 'measured' 10% slower than simulated, every kernel keeping half, each
    sequence's sensitivity the one the job's workload drew (what the runner's data generator records)."""
    summary = json.loads((job_dir / "summary.json").read_text())
    runner_keys = {"source": "runner", "final_loss": 1.0, "final_accuracy": 0.5}
    (job_dir / "summary.json").write_text(json.dumps({**summary, **runner_keys}))
    steps = pd.read_csv(job_dir / "steps.csv")
    steps["step_ms"] *= slower
    steps.to_csv(job_dir / "steps.csv", index=False)
    plans = [json.loads(line) for line in (job_dir / "plans.jsonl").read_text().splitlines()]
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig),
                                              OmegaConf.load(job_dir / ".hydra" / "config.yaml")))
    workload = Workload(cfg.workload, cfg.model.max_context, cfg.seed)
    truth = {p["step"]: truth_of(workload.batch(p["step"])) for p in plans}
    pd.DataFrame([{"step": p["step"], "seq_id": a["seq_id"], "sensitivity": truth[p["step"]][a["seq_id"]],
                   "kept_fraction": 0.5}
                  for p in plans for a in p["assignments"]]).to_csv(job_dir / "sequences.csv", index=False)


def test_fidelity_replays_runner_runs(sweep_copy):
    fake_runner_run(sweep_copy / "1")
    runs = read_runs(sweep_copy)
    frame = fidelity_frame(runs, profile=str(PINNED_PROFILE))  # the profile the sweep was simulated with
    assert list(frame["step"]) == [1] and list(frame["group"]) == ["kk"]  # step 0 is warm-up
    assert (frame["measured_ms"] / frame["plan_ms"]).iloc[0] == pytest.approx(1.1, rel=1e-6)
    assert frame["predicted_ms"].iloc[0] != pytest.approx(frame["plan_ms"].iloc[0])
    assert_legible(plot_step_fidelity(frame))
    assert sorted(results_figures(sweep_copy, step=0)) == ["fidelity", "timeline"]  # one simulated run


def test_a_cpu_runner_run_is_drawn_from_its_measured_times_or_priced_by_a_named_profile(sweep_copy, capsys):
    """No cost profile describes a CPU: without --profile the run's measured step times alone, with one its
    fidelity as runner.compare --profile prices it."""
    fake_runner_run(sweep_copy / "1")
    summary = json.loads((sweep_copy / "1" / "summary.json").read_text())
    (sweep_copy / "1" / "summary.json").write_text(json.dumps({**summary, "device": "cpu"}))
    figures = results_figures(sweep_copy, step=0)
    assert sorted(figures) == ["step_times", "timeline"]
    assert_legible(figures["step_times"])
    assert sorted(results_figures(sweep_copy, step=0, profile=str(PINNED_PROFILE))) == ["fidelity", "timeline"]
    assert "ran on the CPU, which no cost profile describes" in capsys.readouterr().err
    for flags, figure in (([], "step_times.png"), (["--profile", str(PINNED_PROFILE)], "fidelity.png")):
        out = sweep_copy / f"figs{len(flags)}"
        assert main([str(sweep_copy / "1"), "--out", str(out), *flags]) == 0
        assert [p.name for p in out.iterdir()] == [figure]


def test_fidelity_reads_runner_compare_output(sweep_copy):
    from sparsebalance.runner import compare

    fake_runner_run(sweep_copy / "0", slower=2.0)
    assert compare.main([str(sweep_copy / "0"), "--skip", "0", "--profile", str(PINNED_PROFILE)]) == 0
    frame = fidelity_frame(read_runs(sweep_copy))
    assert list(frame["step"]) == [0, 1]  # compare.json's skip, not the default
    assert list(frame["measured_ms"] / frame["plan_ms"]) == pytest.approx([2.0, 2.0], rel=1e-5)  # 6-digit CSV


def test_a_cpu_runner_run_has_no_profile_to_draw_its_fidelity_with(sweep_copy):
    fake_runner_run(sweep_copy / "1")
    summary = json.loads((sweep_copy / "1" / "summary.json").read_text())
    (sweep_copy / "1" / "summary.json").write_text(json.dumps({**summary, "device": "cpu"}))
    with pytest.raises(PlotError, match=r"ran on the CPU .*\(runner.compare --profile PATH"):
        fidelity_frame(read_runs(sweep_copy))


def test_fidelity_without_runner_runs_says_how_to_make_them(sweep):
    with pytest.raises(PlotError, match="no runner Results .*runner.compare"):
        fidelity_frame(read_runs(sweep))


# ----------------------------------------------------------------------------- calibration and kernels
def test_calibration_figures_from_a_fitted_profile(fitted_profile, tmp_path):
    frame = calibration_frame(fitted_profile)
    assert {"attn_fwd", "attn_bwd", "select", "layer_fwd", "layer_bwd", "layer_full"} <= set(frame["term"])
    assert frame.loc[frame["split"] == "heldout", "residual_pct"].abs().median() < 10
    figures = profile_figures(fitted_profile)
    assert sorted(figures) == ["calibration", "layer_fidelity", "residuals"]
    for fig in figures.values():
        assert_legible(fig)


def test_provisional_profile_says_how_to_measure(tmp_path):
    # The pinned profile is measured; a provisional copy of it has no measurements to show.
    profile = json.loads(PINNED_PROFILE.read_text()) | {"provisional": True}
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(PlotError, match=r"no measurements to compare with .*python -m calibrate.run"):
        calibration_frame(path)


def test_bad_profile_is_one_line(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"schema_version": 0}))
    with pytest.raises(PlotError, match="schema_version=0"):
        read_profile(bad)


def test_kernel_comparison_counts_failed_configs(bench_csv):
    bench = read_benchmark(bench_csv)
    assert set(bench["impl"]) == {"flex", "triton_sparse", "cudnn_dense"}
    fig = plot_kernel_comparison(bench)
    assert_legible(fig)
    assert "1 config(s) failed" in fig.get_suptitle()


def test_benchmark_with_foreign_columns_is_refused(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(PlotError, match="not a kernel benchmark CSV"):
        read_benchmark(path)


def test_benchmark_checks_the_profile_on_our_kernel(bench_csv):
    frame = benchmark_vs_profile(read_benchmark(bench_csv), PINNED_PROFILE)
    assert set(frame["term"]) == {"attn_fwd", "attn_fwd+bwd"}
    assert sorted(frame["budget"].unique()) == [0.1, 1.0]  # nominal budgets group the realised fractions
    assert (frame["predicted_ms"] > 0).all()
    profile = read_profile(PINNED_PROFILE)
    assert_legible(plot_calibration(frame, profile, source="benchmark"))
    assert_legible(plot_residuals(frame, profile))


@pytest.mark.slow  # draws three figures, over 2 s of CPU
def test_cli_benchmark_figures(bench_csv, tmp_path):
    out = tmp_path / "figs"
    assert main([str(bench_csv), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["kernel_model.png", "kernel_model_residuals.png", "kernels.png"]


def test_cli_plots_the_rest_of_a_sweep_and_warns_in_one_line(sweep_copy, tmp_path, capsys):
    (sweep_copy / "1" / "micro_batches.csv").unlink()
    assert main([str(sweep_copy), "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: skipped: ") and err.count("\n") == 1 and "partial Results" in err
    assert (tmp_path / "timeline.png").is_file()


def test_committed_h200_runner_runs_replay():
    runs = read_runs(ROOT / "tests" / "fixtures" / "h200_qmajor_runs")
    frame = fidelity_frame(runs, skip=4)
    assert set(frame["group"]) == {"baseline", "sparsebalance"} and frame["step"].min() == 4
    assert_legible(plot_step_fidelity(frame))


# ----------------------------------------------------------------------------- learning tables
@pytest.fixture
def learning_tables(tmp_path):
    """runner.collect's tables of three runs: two seeds of one policy, one of another; 60 steps each."""
    out = tmp_path / "learning"
    out.mkdir()
    rows, held = [], []
    for run, final in (("task_baseline_s0", 0.6), ("task_baseline_s1", 0.4), ("task_sparsebalance_s0", 0.5)):
        rows += [{"run": run, "step": s, "loss": 1.0, "accuracy": final * s / 59, "answers": 10 + s % 3}
                 for s in range(60)]
        held += [{"run": run, "p": p, "length": n, "accuracy": final - (1 - p), "answers": a, "item_chance": 0.3}
                 for p in (1.0, 0.9) for n, a in ((128, 100), (256, 300))]
    pd.DataFrame(rows).to_csv(out / "train.csv", index=False)
    pd.DataFrame(held).to_csv(out / "eval_summary.csv", index=False)
    return out


def test_learning_curves_group_seeds_and_weigh_by_answers(learning_tables):
    train, summary = read_learning(learning_tables)
    curves = rolling_accuracy(train, window=50)
    assert set(curves["group"]) == {"task_baseline", "task_sparsebalance"}
    assert curves.groupby("run")["step"].min().eq(49).all()  # no partial windows
    last = curves[(curves["run"] == "task_baseline_s0") & (curves["step"] == 59)]["accuracy"].item()
    window = train[(train["run"] == "task_baseline_s0") & (train["step"] >= 10)]
    assert last == pytest.approx((window["accuracy"] * window["answers"]).sum() / window["answers"].sum())
    held = held_out_accuracy(summary).set_index("run")
    assert held.loc["task_baseline_s1", "accuracy"] == pytest.approx(0.4)  # densest budget only
    assert_legible(plot_learning(train, summary))


def test_cli_draws_learning_tables_and_names_a_missing_column(learning_tables, tmp_path, capsys):
    out = tmp_path / "figs"
    assert main([str(learning_tables), "--out", str(out)]) == 0
    assert [p.name for p in out.iterdir()] == ["learning.png"]
    pd.read_csv(learning_tables / "train.csv").drop(columns="answers").to_csv(learning_tables / "train.csv",
                                                                             index=False)
    with pytest.raises(SystemExit) as exc:
        main([str(learning_tables), "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "no column answers" in err, err


def test_learning_tables_too_short_for_the_window_say_so(learning_tables):
    train, summary = read_learning(learning_tables)
    with pytest.raises(PlotError, match="no run has 100 steps"):
        plot_learning(train, summary, window=100)
