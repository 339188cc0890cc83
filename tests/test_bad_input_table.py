"""A newcomer's bad inputs to every command, one table: each ends in exactly one ``error:`` line on stderr, exit code
2, no traceback, and nothing left in the working directory. Commands run in this process (their ``main(argv)``;
sim.run's front door ``check_composition``, which its command line turns into the same line).
"""
from __future__ import annotations

import importlib
import json
import sys

import pytest

from pinned import pinned
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.run import check_composition

# sim.run: (overrides, text the line must contain)
RUN = [
    (["steps=-1"], "steps=-1"), (["steps=1.5"], "steps"), (["steps=abc"], "steps"), (["seed=-3"], "seed=-3"),
    (["seed=x"], "seed"), (["policy=Baseline"], "policy"), (["policy="], "policy"), (["cluster=h300"], "h300"),
    (["model=llama"], "llama"), (["workload=zipf"], "zipf"), (["cost=exact"], "exact"),
    (["cluster.nodes=0"], "cluster.nodes=0"), (["cluster.nodes=-1"], "cluster.nodes=-1"),
    (["cluster.gpus_per_node=0"], "gpus_per_node=0"), (["cluster.peak_tflops=0"], "peak_tflops=0"),
    (["cluster.peak_tflops=inf"], "peak_tflops=inf"), (["cluster.hbm_tbps=-1"], "hbm_tbps=-1"),
    (["cluster.hbm_gb=nan"], "hbm_gb=nan"), (["cluster.intra.bandwidth_gbps=0"], "bandwidth_gbps=0"),
    (["cluster.inter.latency_us=-1"], "latency_us=-1"), (["cluster.grad_bytes=9"], "grad_bytes=9"),
    (["cluster.grad_bucket_mb=-1"], "grad_bucket_mb=-1"), (["cluster.gpu=h100"], "measured on h200"),
    (["model.hidden=0"], "hidden=0"), (["model.layers=0"], "layers=0"), (["model.heads=3"], "heads=3"),
    (["model.kv_heads=3"], "kv_heads=3"), (["model.head_dim=-1"], "head_dim=-1"), (["model.ffn=0"], "ffn=0"),
    (["model.vocab=0"], "vocab=0"), (["model.max_context=1000"], "max context"),
    (["model.tie_embeddings=maybe"], "tie_embeddings"), (["workload.global_batch=0"], "global_batch=0"),
    (["workload.global_batch=4"], "smaller than the DP degree"), (["workload.min_len=0"], "min_len=0"),
    (["workload.min_len=40000"], "exceeds"), (["workload.max_len=65536"], "max context"),
    (["workload.median=0"], "median=0"), (["workload.sigma=-1"], "sigma=-1"),
    (["workload.long_fraction=2"], "long_fraction=2"), (["workload.sensitivity_a=0"], "sensitivity_a=0"),
    (["workload.sensitivity_b=-1"], "sensitivity_b=-1"), (["workload.distribution=trace"], "trace_path"),
    (["workload.trace_path=missing.csv"], "trace_path"), (["workload.sensitivity_task=x"], "sensitivity_task"),
    (["workload.sensitivity_profile=missing.json"], "missing.json"), (["workload.short_median=100"], "short_median"),
    (["workload=bimodal", "workload.sigma=2"], "workload.sigma=2.0 is not read"),
    (["cost.block_size=8"], "block_size=8"), (["cost.block_size=2048"], "block_size=2048"),
    (["cost.profile=missing.json"], "missing.json"), (["cost.attention_backend=flash"], "flash"),
    (["cost.hybrid_margin=1"], "hybrid_margin=1"), (["cost.hybrid_margin=0.1"], "not read unless"),
    (["cost=roofline", "cost.attn_efficiency=0"], "attn_efficiency=0"),
    (["cost=roofline", "cost.matmul_efficiency=1.5"], "matmul_efficiency=1.5"),
    (["cost=roofline", "cost.attn_bwd_ratio=0"], "attn_bwd_ratio=0"), (["cost=roofline", "cost.launch_ms=-1"], "-1"),
    (["cost=roofline", "cost.profile=x.json"], "cost.profile=x.json is not read by cost=roofline"),
    (["layout.tp=3"], "layout.tp=3"), (["layout.tp=16"], "layout.tp=16"), (["layout.pp=0"], "layout.pp=0"),
    (["layout.pp=5"], "layout.pp=5"), (["layout.cp=0"], "layout.cp=0"), (["layout.dp=0"], "layout.dp=0"),
    (["layout.dp=16"], "16"), (["layout.micro_batches=-1"], "micro_batches=-1"),
    (["layout.micro_batches=9"], "micro_batches=9"), (["memory.overflow=ignore"], "ignore"),
    (["memory.margin_gb=-1"], "margin_gb=-1"), (["memory.margin_gb=200"], "margin_gb=200"),
    (["memory.sharding=zero3"], "zero3"), (["memory.weight_bytes=0"], "weight_bytes=0"),
    (["memory.grad_bytes=-2"], "grad_bytes=-2"), (["memory.optimizer_bytes=nan"], "optimizer_bytes=nan"),
    (["memory.logits_bytes=-1"], "logits_bytes=-1"), (["memory.activations.hidden=-1"], "hidden=-1"),
    (["memory.activations.nope=1"], "nope"), (["memory.profile=missing.json"], "missing.json"),
    (["memory.profile=calibrate/profiles/h200_memory.json", "memory.backward.ffn=1"], "not read under"),
    (["memory.activation_checkpointing=false", "memory.checkpointed.hidden=1"], "not read under"),
    (["memory.activation_checkpointing=sometimes"], "activation_checkpointing"),
    (["policy.estimator=psychic"], "psychic"), (["policy.attention_backend=flash"], "flash"),
    (["policy.cp_mode=sometimes"], "sometimes"), (["policy.sparsity.params.p=0"], "p"),
    (["policy.sparsity.params.p=2"], "p"), (["policy=dst", "policy.sparsity.params.levels=0"], "levels"),
    (["policy=kk", "policy.batching.params.refine=1"], "refine"), (["policy.sparsity.name=psychic"], "psychic"),
    (["policy.batching.name=psychic"], "psychic"), (["baseline=Baseline"], "Baseline"),
    (["write_plans=perhaps"], "write_plans"), (["plot=true", "write_plans=false"], "plot=true"),
    (["force=yes please"], "force"), (["overwrite=2"], "overwrite"), (["nokey=1"], "nokey"),
    (["+nokey=1"], "nokey"), (["layout.nokey=1"], "nokey"), (["~policy"], "policy"),
    (["steps=10000000"], "steps"), (["cluster.nodes=20000", "workload.global_batch=200000"], "GPUs"),
    (["+experiment=nope"], "nope"), (["+experiment=cpu_smoke"], "runner"),
]
# Other commands: (module, argv, text the line must contain). {tmp} is the test's own directory.
COMMANDS = [
    ("sim.compare", ["--seeds", "0"], "--seeds"), ("sim.compare", ["--seeds", "x"], "--seeds"),
    ("sim.compare", ["--policies", "nope"], "nope"), ("sim.compare", ["--baselines", "nope"], "nope"),
    ("sim.compare", ["--seed", "1"], "--seed"), ("sim.compare", ["policy.estimator=oracle"], "policy"),
    ("sim.compare", ["steps=0"], "steps=0"), ("sim.compare", ["experiment=nope"], "nope"),
    ("sim.compare", ["--fixed-k-of", "nope"], "nope"), ("sim.compare", ["--oracles", "nope"], "nope"),
    ("sim.compare", ["--nope"], "--nope"), ("sim.compare", ["cluster.nodes=-1"], "cluster.nodes=-1"),
    ("viz", ["{tmp}/missing"], "no such file"), ("viz", ["{tmp}/empty"], "empty"),
    ("viz", ["{tmp}/note.txt"], "note.txt"), ("viz", ["{tmp}/bad.json"], "bad.json"),
    ("viz", ["{tmp}/bad.csv"], "bad.csv"), ("viz", ["{tmp}/empty", "--step", "-1"], "--step"),
    ("viz", ["{tmp}/empty", "--skip", "-2"], "--skip"), ("viz", ["{tmp}/empty", "--format", "gif"], "gif"),
    ("viz", ["{tmp}/empty", "--out", "/proc/figures"], "--out"), ("viz", [], "paths"),
    ("viz", ["{tmp}/empty", "--nope"], "--nope"),
    ("runner.compare", ["{tmp}/missing"], "missing"), ("runner.compare", ["{tmp}/empty"], "empty"),
    ("runner.compare", ["{tmp}/empty", "--skip", "-1"], "--skip"), ("runner.compare", [], "run_dirs"),
    ("runner.compare", ["{tmp}/note.txt"], "note.txt"), ("runner.compare", ["{tmp}/empty", "--nope"], "--nope"),
    ("runner.collect", ["{tmp}/empty"], "--out"), ("runner.collect", ["{tmp}/missing", "--out", "{tmp}/o"], "missing"),
    ("runner.collect", ["{tmp}/empty", "--out", "{tmp}/o", "--length-edges", "x"], "length"),
    ("runner.collect", ["{tmp}/empty", "--out", "{tmp}/o", "--length-edges", "9,3"], "9"),
    ("calibrate.fit", ["--csv", "{tmp}/missing.csv"], "missing.csv"),
    ("calibrate.fit", ["--csv", "{tmp}/bad.csv"], "bad.csv"),
    ("calibrate.fit", ["--check", "{tmp}/bad.json"], "bad.json"), ("calibrate.fit", ["--nope"], "--nope"),
    ("sim.breakeven", ["model=nope"], "nope"),
    ("sim.breakeven", ["cost.profile={tmp}/missing.json"], "missing.json"),
    ("sim.breakeven", ["nokey=1"], "nokey"), ("sim.provisional", ["--out", "/proc/x.json"], "--out"),
    ("sim.provisional", ["--nope"], "--nope"),
    ("benchmarks.sim_speed", ["--gpus", "7"], "--gpus"), ("benchmarks.sim_speed", ["--steps", "0"], "--steps"),
    ("benchmarks.sim_speed", ["--policies", "nope"], "nope"), ("benchmarks.sim_speed", ["--repeat", "x"], "--repeat"),
    ("benchmarks.sim_speed", ["--cp-mode", "elastic"], "elastic"),
    ("benchmarks.plan_overhead", ["--steps", "-1"], "--steps"), ("benchmarks.plan_overhead", ["--dp", "0"], "--dp"),
    ("benchmarks.plan_overhead", ["--policy", "nope"], "nope"),
    ("benchmarks.plan_overhead", ["--global-batch", "x"], "--global-batch"),
]
NO_ARGV = {"sim.compare"}  # commands whose main() reads sys.argv


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """Bad inputs on disk, and a working directory that must stay empty."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "note.txt").write_text("not a run\n")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bad.csv").write_text("a,b\n1\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return tmp_path


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if not ln.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.slow  # each composes the config (~0.5 s); tests/sim/test_bad_input.py keeps sim.run in the fast lane
@pytest.mark.parametrize("overrides,needle", RUN, ids=[" ".join(o) for o, _ in RUN])
def test_sim_run(inputs, overrides, needle):
    with pytest.raises(ConfigError) as caught:
        check_composition(pinned(overrides))
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    assert not any((inputs / "cwd").iterdir())


@pytest.mark.parametrize("module,argv,needle", COMMANDS, ids=[f"{m} {' '.join(a)}" for m, a, _ in COMMANDS])
def test_other_commands(inputs, capsys, monkeypatch, module, argv, needle):
    package = "" if module.startswith("benchmarks.") else "sparsebalance."  # benchmarks/ ships in no package
    main = importlib.import_module(f"{package}{module}" + (".cli" if module == "viz" else "")).main
    argv = [a.format(tmp=inputs) for a in argv]
    monkeypatch.setattr(sys, "argv", [module, *argv])  # sim.compare's main reads its command line
    with pytest.raises(SystemExit) as exit_:
        main(*([] if module in NO_ARGV else [argv]))
    assert exit_.value.code == 2
    assert needle.format(tmp=inputs) in one_line(capsys)
    assert not any((inputs / "cwd").iterdir())


def test_the_table_holds_at_least_150_cases():
    print(f"{len(RUN)} sim.run cases, {len(COMMANDS)} of {len({m for m, _, _ in COMMANDS})} other commands")
    assert len(RUN) + len(COMMANDS) >= 150
    json.dumps(RUN)  # plain data: the table is the record of what was tried
