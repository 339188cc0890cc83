"""The front door of ``python -m sim.run``: every bad value of every config group, trace file and sweep ends
in exactly one ``error:`` line naming it, exit code 2, no traceback, and no run or multirun directory.

Every case goes through ``check_composition`` (what the command line runs before any job) in this process;
one case of each way a value can fail (a Hydra group or key, an OmegaConf type, a range, a cross-field rule,
a missing file, a trace row) also goes through the command line, which turns the same error into the line."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.run import check_composition

ROOT = Path(__file__).resolve().parents[2]

# (overrides, text the one error line must contain)
CONFIG_CASES = [
    (["policy=nope"], "unknown policy 'nope'; allowed: baseline"),
    (["cluster=nope"], "unknown cluster 'nope'"),
    (["baseline=nope"], "baseline='nope' is not a policy"),
    (["policy=kk", "policy.batching.params.equal_count=maybe"], "equal_count"),
    (["policy.batching.params.equal_count=true"], "Key 'equal_count' is not in struct"),
    (["policy.sparsity.params.p=nan"], "p=nan"),
    (["policy=dst", "policy.sparsity.params.floor=nan"], "policy.sparsity.params.floor=nan"),
    (["layout.cp=abc"], "could not be converted to Integer"),
    (["layout.cp=-2"], "layout.cp=-2 is out of range; allowed: >= 1"),
    (["layout.cp=3"], "cp=3 x pp=1 does not divide the cluster's 8 GPUs"),
    (["layout.dp=3"], "= 3 GPUs, but the cluster has 8"),
    (["layout.micro_batches=0"], "layout.micro_batches=0 is out of range; allowed: >= 1"),
    (["layout.cp_mode=elastic"], "layout.cp_mode"),
    (["layout.cp_mode=dynamic", "layout.cp=3", "cluster.nodes=3"],
     "layout.cp=3 under cp_mode=dynamic must be a power of two"),
    (["layout.pp=8"], "layout.pp=8 does not split the model's 36 layers evenly; allowed pp: 1, 2, 3, 4, 6, 9"),
    (["steps=0"], "steps=0 is out of range; allowed: >= 1"),
    (["seed=-1"], "seed=-1 is out of range; allowed: >= 0"),
    (["plot=true", "write_plans=false"], "plot=true needs write_plans=true"),
    (["workload.distribution=zipf"], "expected one of [longtail, bimodal, trace]"),
    (["workload.max_len=40000"], "workload.max_len=40000 exceeds the model's max context 32768"),
    (["workload.min_len=0"], "workload.min_len=0 is out of range; allowed: >= 1"),
    (["workload.min_len=5000", "workload.max_len=4000"], "workload.min_len=5000 exceeds workload.max_len=4000"),
    (["workload.sigma=-1"], "workload.sigma=-1.0 is out of range; allowed: >= 0"),
    (["workload.sigma=nan"], "workload.sigma=nan is not allowed; it must be a finite number >= 0"),
    (["workload.median=nan"], "workload.median=nan is not allowed"),
    (["workload.median=0"], "workload.median=0.0 is out of range; allowed: > 0"),
    (["workload.sensitivity_a=nan"], "workload.sensitivity_a=nan is not allowed"),
    (["workload.sensitivity_b=-1"], "workload.sensitivity_b=-1.0 is out of range; allowed: > 0"),
    (["workload=bimodal", "workload.long_fraction=2"],
     "workload.long_fraction=2.0 is out of range; allowed: in [0, 1]"),
    (["workload.global_batch=4"], "workload.global_batch=4 is smaller than the DP degree 8"),
    (["workload.global_batch=100000000"], "2e+09 sequences, above the limit 2e+06"),
    (["model.hidden=-1"], "model.hidden=-1 is out of range; allowed: >= 1"),
    (["model.layers=0"], "model.layers=0 is out of range; allowed: >= 1"),
    (["model.vocab=0"], "model.vocab=0 is out of range; allowed: >= 1"),
    (["model.heads=5"], "model.kv_heads=2 does not divide model.heads=5"),
    (["model.heads=3", "model.kv_heads=1"], "model.heads=3 does not divide model.hidden=2048"),
    (["cluster.peak_tflops=nan"], "cluster.peak_tflops=nan is not allowed"),
    (["cluster.peak_tflops=0"], "cluster.peak_tflops=0.0 is out of range; allowed: > 0"),
    (["cluster.hbm_tbps=inf"], "cluster.hbm_tbps=inf is not allowed"),
    (["cluster.intra.latency_us=-1"], "cluster.intra.latency_us=-1.0 is out of range; allowed: >= 0"),
    (["cluster.inter.bandwidth_gbps=nan"], "cluster.inter.bandwidth_gbps=nan is not allowed"),
    (["cluster.grad_bytes=0"], "cluster.grad_bytes=0 is out of range; allowed: in [1, 8]"),
    (["cluster.nodes=100000"], "800,000 GPUs, above the limit 131,072"),
    (["cluster.nodes=1000", "steps=1000"], "simulated GPU-steps"),
    (["cost=roofline", "cost.attn_efficiency=1.5"], "cost.attn_efficiency=1.5 is out of range; allowed: in (0, 1]"),
    (["cost=roofline", "cost.launch_ms=-1"], "cost.launch_ms=-1.0 is out of range; allowed: >= 0"),
    (["cost.hybrid_margin=1"], "cost.hybrid_margin=1.0 is out of range; allowed: in [0, 1)"),
    (["cost=roofline", "cost.block_size=0"], "cost.block_size=0 is out of range; allowed: in [16, 1024]"),
    (["cost.profile=calibrate/profiles/missing.json"], "no such file"),
    (["+foo=1"], "foo is not a config key; allowed under the top: baseline, cluster"),
    (["+layout.bogus=3"], "layout.bogus is not a config key; allowed under layout: cp, cp_mode, dp, micro_batches, pp"),
    (["policy=sparsebalance", "policy.sparsity.params.min_mean_coverage=5"],
     "policy.sparsity.params.min_mean_coverage=5.0 is out of range; allowed: in [0, 1]"),
    (["hydra.run.dir=/proc/nope"], "hydra.run.dir='/proc/nope' cannot be written"),
    (["write_plans=2"], "write_plans=2: write_plans is a switch; allowed: true, false"),
    (["plot=0"], "plot=0: plot is a switch; allowed: true, false"),
    (["write_plans=yes"], "write_plans=yes: write_plans is a switch"),
]

# (trace file name, contents, text of the error line)
TRACE_CASES = [
    ("abc.csv", "length\n100\nabc\n", "row 2 has length 'abc'; allowed: a whole number of tokens >= 1"),
    ("fraction.csv", "length\n100\n4096.7\n", "row 2 has length '4096.7'"),
    ("negative.csv", "length\n-5\n", "row 1 has length '-5'"),
    ("overflow.csv", "length\n99999999999999999999999\n",
     "length 99999999999999999999999 is outside the allowed range"),
    ("fraction.jsonl", '{"length": 5}\n{"length": 3.5}\n', "row 2 has length 3.5"),
    ("long.jsonl", '{"length": 100}\n{"length": 50000}\n', "length 50000 is outside the allowed range [1, 32768]"),
    ("nolength.csv", "tokens\n100\n", "needs a non-empty 'length' column, found ['tokens']"),
    ("broken.jsonl", '{"length": 5\n', "unreadable trace"),
    ("quoted.jsonl", '{"length": 5}\n{"length": "4096"}\n',
     "row 2 has length '4096'; allowed: a JSON whole number of tokens >= 1"),
    ("true.jsonl", '{"length": true}\n', "row 1 has length True"),
]


def run_cli(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, "-m", "sparsebalance.sim.run", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=120)


def assert_one_line(proc, needle):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


# One case of each way to fail, through the command line.
CLI_CONFIG_CASES = [case for case in CONFIG_CASES if case[0][-1] in (
    "policy=nope", "policy.batching.params.equal_count=true", "layout.cp=abc", "workload.sigma=nan",
    "layout.pp=8", "cost.profile=calibrate/profiles/missing.json")]
CLI_TRACE_CASES = [case for case in TRACE_CASES if case[0] in ("abc.csv", "broken.jsonl")]


def assert_one_error(overrides, needle):
    with pytest.raises(ConfigError) as caught:
        check_composition(overrides)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("overrides,needle", CONFIG_CASES, ids=[" ".join(o) for o, _ in CONFIG_CASES])
def test_bad_config_value_is_one_error_before_any_job(overrides, needle):
    assert_one_error(["steps=20", *overrides], needle)


@pytest.mark.parametrize("name,content,needle", TRACE_CASES, ids=[c[0] for c in TRACE_CASES])
def test_bad_trace_is_one_error_before_any_job(tmp_path, name, content, needle):
    trace = tmp_path / name
    trace.write_text(content)
    assert_one_error(["workload=trace", f"workload.trace_path={trace}"], needle)


@pytest.mark.parametrize("overrides,needle", CLI_CONFIG_CASES, ids=[" ".join(o) for o, _ in CLI_CONFIG_CASES])
def test_bad_config_value_is_one_line_and_leaves_nothing(tmp_path, overrides, needle):
    proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", "steps=20", *overrides, cwd=tmp_path)
    assert_one_line(proc, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name,content,needle", CLI_TRACE_CASES, ids=[c[0] for c in CLI_TRACE_CASES])
def test_bad_trace_is_one_line_and_leaves_nothing(tmp_path, name, content, needle):
    trace = tmp_path / name
    trace.write_text(content)
    proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", "workload=trace", f"workload.trace_path={trace}")
    assert_one_line(proc, needle)
    assert list(tmp_path.iterdir()) == [trace]


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_a_run_or_sweep_directory_that_is_a_file_is_one_line(tmp_path, mode):
    there = tmp_path / "taken"
    there.write_text("a file")
    proc = run_cli(*(["-m"] if mode == "sweep" else []), f"hydra.{mode}.dir={there}", "steps=1", cwd=tmp_path)
    assert_one_line(proc, f"hydra.{mode}.dir='{there}' is a file; allowed: a directory path")
    assert list(tmp_path.iterdir()) == [there]


def test_one_bad_job_stops_a_sweep_before_any_job_runs(tmp_path):
    proc = run_cli("-m", f"hydra.sweep.dir={tmp_path / 'multirun'}", "steps=2", "policy=kk,baseline",
                   "workload.sigma=1,-1", cwd=tmp_path)
    assert_one_line(proc, "workload.sigma=-1.0 is out of range; allowed: >= 0 "
                          "(in the sweep job: steps=2 policy=kk workload.sigma=-1)")
    assert list(tmp_path.iterdir()) == []


def test_force_lifts_the_size_guard_but_not_the_range_checks(tmp_path):
    check_composition(["cluster.nodes=100000", "force=true", "workload.global_batch=800000", "layout.micro_batches=1",
                       "steps=1"])
    with pytest.raises(ConfigError, match="workload.sigma=nan"):
        check_composition(["force=true", "workload.sigma=nan"])


def test_packages_named_like_ours_in_the_working_directory_hide_nothing(tmp_path):
    """``python -m`` puts the working directory first on the path; the project imports itself as
    ``sparsebalance.<package>``, so a sweep's ``policies`` folder or another project's ``sim`` or ``kernels``
    package there hides nothing."""
    for name in ("policies", "sim", "kernels"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('the wrong package was imported')\n")
    proc = run_cli("steps=1", "baseline=null", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "summary.json").is_file()
