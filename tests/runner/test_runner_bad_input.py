"""The runner's own inputs at its front doors: ``runner.train``'s runner keys and ``runner.compare``'s run dirs
and options. A bad value is one ``error:`` line and exit code 2, before anything is written.

The shared groups (model, cluster, workload, cost, layout) are ``sim.config``'s and tested in tests/sim.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from pinned import PINNED_PROFILE
from sparsebalance.runner import compare
from sparsebalance.runner.train import check_inputs
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.run import simulate
from sparsebalance.sim.workload import Workload, truth_of
from tiny import ONE_RANK, TINY_ONE_RANK

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = [*TINY_ONE_RANK, "steps=3"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's answer")


# ---------------------------------------------------------------------- runner.train
@pytest.mark.parametrize("override, message", [
    ("runner.lr=-1", "runner.lr=-1.0 is out of range; allowed: > 0"),
    ("runner.lr=nan", "runner.lr=nan is not allowed; it must be a finite number"),
    ("runner.lr=fast", "Value 'fast' of type 'str' could not be converted to Float"),
    ("runner.weight_decay=-0.1", "runner.weight_decay=-0.1 is out of range; allowed: >= 0"),
    ("runner.lr_schedule=linear", "Invalid value 'linear', expected one of [constant, cosine]"),
    ("runner.warmup_steps=-1", "runner.warmup_steps=-1 is out of range; allowed: >= 0"),
    ("runner.warmup_steps=0.5", "Value '0.5' of type 'float' could not be converted to Integer"),
    ("runner.min_lr_ratio=1.5", "runner.min_lr_ratio=1.5 is out of range; allowed: in [0, 1]"),
    ("runner.min_lr_ratio=-0.1", "runner.min_lr_ratio=-0.1 is out of range; allowed: in [0, 1]"),
    ("runner.timeout_s=0", "runner.timeout_s=0.0 is out of range; allowed: in (0, 604800]"),
    ("runner.timeout_s=1e6", "runner.timeout_s=1000000.0 is out of range; allowed: in (0, 604800]"),
    ("runner.checkpoint_every=-1", "runner.checkpoint_every=-1 is out of range; allowed: >= 0"),
    ("runner.task.n_keys=0", "runner.task.n_keys=0 is out of range; allowed: >= 1"),
    ("runner.task.n_queries=0", "runner.task.n_queries=0 is out of range; allowed: >= 1"),
    ("runner.task.max_pairs=17", "runner.task.max_pairs=17 (17 distinct keys for the retrieval task) exceeds "
                                 "runner.task.n_keys=16; allowed: max_pairs <= n_keys"),
    ("runner.task.kind=copy", "Invalid value 'copy', expected one of [retrieval, multihop]"),
    ("runner.task.kind=multihop runner.task.max_pairs=9", "runner.task.max_pairs=9 (18 distinct keys for the "
     "multihop task) exceeds runner.task.n_keys=16; allowed: 2 * max_pairs <= n_keys"),
    ("runner.task.kind=multihop workload.min_len=40", "workload.min_len=40 is too short for the multihop task; "
     "allowed: >= 41 tokens"),
    ("model.vocab=40", "model.vocab=40 is too small for the retrieval task; allowed: >= 41"),
    ("workload.min_len=16", "workload.min_len=16 is too short for the retrieval task; allowed: >= 25 tokens"),
    ("runner.attention=flash", "runner.attention='flash' is unknown; allowed: kernel, triton, naive"),
    ("runner.device=tpu", "runner.device='tpu' is unknown; allowed: auto, cuda, cpu"),
    ("runner.data_parallel=zero3", "runner.data_parallel='zero3' is unknown; allowed: ddp, fsdp"),
    ("cluster.gpus_per_node=2 model.kv_heads=2 layout.tp=2", "layout.tp=2: runner.train runs no tensor parallelism; "
     "allowed: layout.tp=1"),
    ("runner.no_such_key=1", "Key 'no_such_key' not in 'RunnerSettings'"),
    ("runner.resume=/no/such/checkpoint.pt", "runner.resume=/no/such/checkpoint.pt: no such file"),
    (f"runner.resume={ROOT / 'runner'}", f"runner.resume={ROOT / 'runner'}: a directory; allowed: a checkpoint file"),
    pytest.param("runner.device=cuda", "runner.device=cuda but no CUDA device is visible", marks=NO_CUDA),
    pytest.param("runner.attention=triton", "runner.attention='triton' on the CPU runs only under TRITON_INTERPRET=1",
                 marks=NO_CUDA),

    ("hydra.run.dir=/proc/run", "hydra.run.dir='/proc/run' cannot be written (No such file or directory)"),
    ("-m seed=1,2 hydra.sweep.dir=/proc/sweep", "hydra.sweep.dir='/proc/sweep' cannot be written"),
])
def test_a_bad_runner_value_is_one_line(override, message, monkeypatch):
    """``override``: one or more overrides, separated by spaces."""
    # tests/kernels' conftest turns the interpreter on for the whole process when both suites share a worker.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError) as exc:
        check_inputs([*OVERRIDES, *override.split()], ONE_RANK)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_sweep_is_checked_job_by_job_before_any_runs():
    with pytest.raises(ConfigError, match=r"runner.lr=-1.0 is out of range"):
        check_inputs(["-m", *OVERRIDES, "runner.lr=1e-3,-1"], ONE_RANK)


def test_a_run_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^hydra.run.dir='.*/file/run' cannot be written \(Not a directory\)"):
        check_inputs([*OVERRIDES, f"hydra.run.dir={tmp_path / 'file' / 'run'}"], ONE_RANK)


def test_a_new_run_dir_passes_and_the_check_makes_nothing(tmp_path):
    """Every rank probes at once, so the check writes only in the deepest directory that exists and leaves it
    as it was; ``${hydra:...}`` in the path resolves as Hydra resolves it."""
    check_inputs([*OVERRIDES, f"hydra.run.dir={tmp_path}/a/b/${{hydra:job.name}}"], ONE_RANK)
    check_inputs(["-m", *OVERRIDES, "seed=1,2", f"hydra.sweep.dir={tmp_path}/sweep"], ONE_RANK)
    assert list(tmp_path.iterdir()) == []


def test_good_runner_values_pass():
    check_inputs([*OVERRIDES, "runner.checkpoint_every=0", "runner.weight_decay=0", "runner.device=cpu",
                  "runner.lr_schedule=cosine", "runner.warmup_steps=10", "runner.min_lr_ratio=1"], ONE_RANK)


@pytest.mark.slow
def test_the_cli_answers_a_bad_runner_value_in_one_line_and_makes_no_run_dir(tmp_path):
    cmd = [sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={tmp_path / 'run'}", *OVERRIDES,
           "runner.timeout_s=0"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: runner.timeout_s=0.0 is out of range; allowed: in (0, 604800]"]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------- runner.compare
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The files ``runner.train`` writes, made without training: the simulator's Results for the same config,
    per planned sequence its sensitivity (the workload's draw) and a kept fraction, and the summary keys of a
    training run."""
    import sparsebalance.runner.config as runner_config

    runner_config.register()
    cfg = compose_config(OVERRIDES, config_name="runner")
    out = simulate(cfg)
    path = tmp_path_factory.mktemp("compare") / "run"
    out.results.write(path, {**out.summary, "final_loss": 4.0, "final_accuracy": 0.1})
    (path / ".hydra").mkdir()
    OmegaConf.save(cfg, path / ".hydra" / "config.yaml")
    plans = [json.loads(line) for line in (path / "plans.jsonl").read_text().splitlines()]
    workload = Workload(OmegaConf.to_object(cfg.workload), cfg.model.max_context, cfg.seed)
    truth = {p["step"]: truth_of(workload.batch(p["step"])) for p in plans}
    rows = [{"step": p["step"], "seq_id": a["seq_id"], "sensitivity": truth[p["step"]][a["seq_id"]],
             "kept_fraction": 0.5} for p in plans for a in p["assignments"]]
    pd.DataFrame(rows).to_csv(path / "sequences.csv", index=False)
    return path


@pytest.fixture
def run(run_dir, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def rewrite(name: str, text: str):
    return lambda run: (run / name).write_text(text)


def drop_column(name: str, column: str):
    return lambda run: pd.read_csv(run / name).drop(columns=column).to_csv(run / name, index=False)


def set_config(key: str, value):
    def edit(run: Path) -> None:
        cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
        OmegaConf.update(cfg, key, value)
        OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    return edit


def drop_config_key(key: str):
    def edit(run: Path) -> None:
        cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
        group, leaf = key.split(".")
        del cfg[group][leaf]
        OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    return edit


BAD_RUNS = {
    "no summary": (lambda run: (run / "summary.json").unlink(), "is not a complete runner run dir: missing"),
    "a summary that is not JSON": (rewrite("summary.json", "{"), "summary.json is not JSON"),
    "a summary without the training keys": (rewrite("summary.json", "{}"), "needs the keys mean_coverage"),
    "a plan line that is not JSON": (rewrite("plans.jsonl", "garbage\n"), "plans.jsonl line 1 is not a Plan"),
    "a plan without assignments": (rewrite("plans.jsonl", '{"step": 0}\n'), "KeyError: 'assignments'"),
    "an empty steps.csv": (rewrite("steps.csv", ""), "steps.csv is not a CSV table"),
    "steps.csv without step_ms": (drop_column("steps.csv", "step_ms"), "missing ['step_ms']"),
    "a step that is not a number": (rewrite("steps.csv", "step,step_ms\nx,1.0\n"), "needs the numeric columns step"),
    "sequences.csv of another run": (rewrite("sequences.csv", "step,seq_id,sensitivity,kept_fraction\n9,9,0.5,0.5\n"),
                                     "has no row for step 0"),
    "sequences.csv without the data's truth": (drop_column("sequences.csv", "sensitivity"), "missing ['sensitivity']"),
    "a config that is not YAML": (rewrite(".hydra/config.yaml", ": : :\n"), "is not a runner config"),
    "a config that is a list": (rewrite(".hydra/config.yaml", "[1, 2]\n"), "is not a runner config"),
    "a config value of the wrong type": (set_config("model.hidden", "wide"), "could not be converted to Integer"),
    "a config value out of range": (set_config("model.hidden", -3), "model.hidden=-3 is out of range"),
    "a config without a key added since, of no known cluster": (
        lambda run: (drop_config_key("cluster.hbm_gb")(run), set_config("cluster.name", "mine")(run)),
        "lacks cluster.hbm_gb (a key added to the schema after the run) and cluster.name='mine' is no conf/cluster/ "
        "option to read it from; allowed: a config that sets cluster.hbm_gb"),
}


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        compare.main(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_a_good_run_dir_is_compared(run):
    assert compare.main([str(run), "--profile", str(PINNED_PROFILE)]) == 0
    assert len(pd.read_csv(run / "compare.csv")) == 3


def as_cpu_run(run: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "device": "cpu"}))


def test_a_cpu_run_is_refused_the_default_profile_which_prices_a_gpu(run, capsys):
    as_cpu_run(run)
    line = refused([str(run)], capsys)
    assert "ran on the CPU (summary.json device='cpu'), and no cost profile describes a CPU" in line
    assert line.endswith("(runner.compare --profile PATH: a check of the pipeline, not of the cost model)")
    assert not (run / "compare.csv").exists()


def test_a_cpu_run_priced_by_a_named_profile_says_what_its_errors_measure(run, capsys):
    as_cpu_run(run)
    assert compare.main([str(run), "--profile", str(PINNED_PROFILE)]) == 0
    assert "ran on the CPU, which no cost profile describes: priced by" in capsys.readouterr().err


def test_with_out_only_out_is_written(run, tmp_path):
    """The run dirs may be committed results: --out takes every table instead of them."""
    before = sorted(p.name for p in run.iterdir())
    assert compare.main([str(run), "--profile", str(PINNED_PROFILE), "--out", str(tmp_path / "all.csv")]) == 0
    assert sorted(p.name for p in run.iterdir()) == before
    assert len(pd.read_csv(tmp_path / "all.csv")) == 3 and len(pd.read_csv(tmp_path / "all_memory.csv")) == 1
    assert json.loads((tmp_path / "all.json").read_text())["runs"][0]["steps_compared"] == 2


def test_a_key_the_schema_gained_is_read_from_the_runs_cluster(run, capsys):
    drop_config_key("cluster.hbm_gb")(run)
    assert compare.main([str(run), "--profile", str(PINNED_PROFILE)]) == 0
    assert "lacks cluster.hbm_gb (added to the schema after the run); read as 141.0 from conf/cluster/h200.yaml" in \
        capsys.readouterr().err


def test_the_committed_qmajor_runs_read_their_clusters_hbm():
    """Their configs predate cluster.hbm_gb; read only, nothing written."""
    for policy in ("baseline", "sparsebalance"):
        cfg = compare._config(ROOT / "tests/fixtures/h200_qmajor_runs" / policy / ".hydra/config.yaml")
        assert cfg.cluster.name == "h200" and cfg.cluster.hbm_gb == 141.0


@pytest.mark.parametrize("name", BAD_RUNS)
def test_a_bad_run_dir_is_one_line_and_nothing_is_written(run, capsys, name):
    spoil, message = BAD_RUNS[name]
    spoil(run)
    assert message in refused([str(run), "--profile", str(PINNED_PROFILE)], capsys)
    assert not list(run.glob("compare.*"))


def test_a_bad_run_dir_after_a_good_one_leaves_the_good_one_untouched(run_dir, run, tmp_path, capsys):
    good = tmp_path / "good"
    shutil.copytree(run_dir, good)
    BAD_RUNS["no summary"][0](run)
    refused([str(good), str(run), "--profile", str(PINNED_PROFILE), "--out", str(tmp_path / "all.csv")], capsys)
    assert not list(good.glob("compare.*")) and not (tmp_path / "all.csv").exists()


@pytest.mark.parametrize("args, message", [
    (["--skip", "abc"], "error: argument --skip: invalid int value: 'abc'"),
    (["--skip", "-1"], "error: --skip -1: must be >= 0"),
    (["--skip", "3"], "error: --skip 3 leaves none of the run's 3 steps to compare"),
    (["--out", "/no/such/dir/all.csv"], "error: --out /no/such/dir/all.csv: no directory /no/such/dir"),
    (["--out", "/proc/all.csv"], "error: --out='/proc/all.csv' cannot be written (No such file or directory)"),
    (["--profile", "/no/such/profile.json"], "no such file"),
    (["--no-such-option"], "error: unrecognized arguments: --no-such-option"),
])
def test_a_bad_option_is_one_line_and_nothing_is_written(run, capsys, args, message):
    line = refused([str(run), "--profile", str(PINNED_PROFILE), *args], capsys)
    assert line.startswith(message) or message in line
    assert not list(run.glob("compare.*"))


def test_an_out_ending_in_json_is_refused(run, tmp_path, capsys):
    """Its JSON would go to the same path as the CSV."""
    line = refused([str(run), "--profile", str(PINNED_PROFILE), "--out", str(tmp_path / "all.json")], capsys)
    assert "names the CSV, and its JSON goes to the same path with .json" in line
    assert list(tmp_path.iterdir()) == [run]


@pytest.mark.slow
def test_help_is_hydras_help_before_any_check_of_the_launched_world():
    """``--help`` outside torchrun: the groups and the config, exit 0, not the world-size check's error."""
    proc = subprocess.run([sys.executable, "-m", "sparsebalance.runner.train", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "== Configuration groups ==" in proc.stdout and "runner:" in proc.stdout
