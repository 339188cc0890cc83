"""sim.memory: each term against hand computation, the 1F1B window, plans that fit (repaired or rejected), and
the one-line error of a sequence that fits under no plan, through ``python -m sim.run``."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from omegaconf import OmegaConf

from pinned import PINNED_OVERRIDES, pinned
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.config import MemoryConfig, ModelConfig, Overflow, Sharding, TokenBytes, compose_config
from sparsebalance.sim.core import ConfigError
from sparsebalance.policies.repack import repack
from sparsebalance.sim.memory import (GB, MemoryLimitError, MemoryModel, first_principles_terms, load_profile_terms,
                                      static_bytes)
from sparsebalance.sim.plan import Assignment, Plan
from sparsebalance.sim.policy import make_batching, make_sparsity
from sparsebalance.sim.run import simulate, summary_table
from sparsebalance.sim.setup import prepare
from sparsebalance.sim.workload import Request, Sequence, requests

from oracle import oracle_planner

ROOT = Path(__file__).resolve().parents[2]
QWEN = ModelConfig(name="qwen2.5-3b", hidden=2048, layers=36, heads=16, kv_heads=2, head_dim=128, ffn=11008,
                   vocab=151936, max_context=32768, tie_embeddings=True)
LLAMA = ModelConfig(name="llama3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336,
                    vocab=128256, max_context=131072, tie_embeddings=False)
QWEN_LAYER = 2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 11008  # Q, O, K, V and the three MLP matrices
QWEN_EMBED = 151936 * 2048


# ----------------------------------------------------------------------------- terms
def test_held_activations_per_token_per_layer_count_the_layer_by_hand():
    h, q, kv, f, heads = 2048, 16 * 128, 2 * 128, 11008, 16
    # x, both norm outputs, x after attention | fused QKV, rope'd q, k, attention output | gate/up, silu, product
    # | fp32 LSE | two fp32 rstd
    by_hand = 2 * 4 * h + (2 * (q + 2 * kv) + 2 * q + 2 * kv + 2 * q) + (2 * 2 * f + 2 * f + 2 * f) + 4 * heads + 8
    terms = first_principles_terms(MemoryConfig(), QWEN)
    assert terms["full"].held_layer == by_hand == 118344
    assert terms["checkpointed"].held_layer == 2 * h  # only the layer input
    assert terms["checkpointed"].transient == by_hand + 4 * h + 4 * f  # one layer recomputed, then its gradients
    assert terms["full"].transient_bytes == 2 * (2 * h * f)  # bf16 gradient of the fused gate/up matrix
    assert terms["full"].held_micro_batch == 4 * 128 + 8  # fp32 cos/sin, int64 token -> block map


def test_static_bytes_per_stage_by_hand_for_each_sharding():
    layout = Layout(dp=2, pp=4, micro_batches=4)
    layer_params = 9 * QWEN_LAYER
    # tied embeddings: stage 0 holds the embedding, the last stage a copy as its LM head
    first = last = layer_params + QWEN_EMBED
    ddp = static_bytes(replace(MemoryConfig(), sharding=Sharding.ddp), QWEN, layout)
    assert ddp.tolist() == [16 * first, 16 * layer_params, 16 * layer_params, 16 * last]
    zero1 = static_bytes(MemoryConfig(), QWEN, layout)
    assert zero1[1] == layer_params * (2 + 2 + 12 / 2)  # optimizer states over the 2 replicas
    fsdp = static_bytes(replace(MemoryConfig(), sharding=Sharding.fsdp), QWEN, layout)
    assert fsdp[1] == layer_params * 16 / 2 + QWEN_LAYER * (2 * 2 + 2)  # two layers gathered, one gradient


def test_tied_embedding_is_one_matrix_without_pipeline_and_two_untied():
    one_stage = Layout(dp=8, pp=1, micro_batches=8)
    ddp = replace(MemoryConfig(), sharding=Sharding.ddp)
    assert static_bytes(ddp, QWEN, one_stage)[0] == 16 * (36 * QWEN_LAYER + QWEN_EMBED)
    llama_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert static_bytes(ddp, LLAMA, one_stage)[0] == 16 * (32 * llama_layer + 2 * 128256 * 4096)


# ----------------------------------------------------------------------------- 1F1B window
def unit_model(pp=4, m=4, dp=1) -> MemoryModel:
    """1 byte per token per layer held, 0.5 per token transient, no micro-batch, logits or weight-gradient terms."""
    cfg = replace(MemoryConfig(), activation_checkpointing=False, grad_bytes=0.0, logits_bytes=0.0,
                  activations=TokenBytes(const=1.0), backward=TokenBytes(const=0.5), micro_batch=TokenBytes())
    model = replace(QWEN, layers=pp)
    return MemoryModel(cfg, model, Layout(dp=dp, pp=pp, micro_batches=m), hbm_gb=141.0, block_size=1024)


def test_stage_s_holds_up_to_pp_minus_s_micro_batches_during_a_backward():
    memory = unit_model()
    tokens = np.array([100.0, 200.0, 300.0, 400.0])  # one one-block document per micro-batch
    got = memory.bytes_of(np.zeros(4), np.arange(4), tokens, np.ones(4)) - memory.static
    # one dense single-block document (NB = W = 1), 2 KV heads: 5 lists and 2 row arrays of one slot per head,
    # the row pointer's + 1 and one fp32 stats entry (sim.memory.selection_bytes)
    selection = 4 * (2 * (5 + 2) + 1 + 1)
    held = tokens + selection  # one layer per stage
    for stage in range(4):
        warmup = 4 - stage - 1
        for i in range(4):
            window = held[i:min(i + warmup, 3) + 1].sum()
            assert got[0, i, stage] == pytest.approx(window + 0.5 * tokens[i]), (stage, i)
    assert got[0, 0, 0] == pytest.approx(held.sum() + 50)  # stage 0 holds all four during the first backward
    assert got[0, :, 3] == pytest.approx(held + 0.5 * tokens)  # the last stage only the one it runs


def test_peak_is_reported_in_steps_rows_and_summary():
    cfg = compose_config(pinned(["+experiment=paper", "steps=3"]))
    out = simulate(cfg)
    rows = out.results.micro_batches()
    steps = out.results.steps_frame()
    per_step = rows.groupby("step")["peak_memory_gb"].max().to_numpy()
    assert np.array_equal(per_step, steps["peak_memory_gb"].to_numpy())
    assert out.summary["peak_memory_gb"] == steps["peak_memory_gb"].max()
    assert 0 < out.summary["peak_memory_gb"] < 133
    # the last stage runs a micro-batch's forward and backward back to back, but its logits dominate it
    by_stage = rows.groupby("stage")["peak_memory_gb"].max()
    assert by_stage[3] > by_stage[0] > by_stage[1]  # stage 0: the embedding and four micro-batches in flight
    assert "peak_GB" in summary_table([out.summary], None).columns


# ----------------------------------------------------------------------------- plans that fit
def over_plan() -> Plan:
    """DP rank 0 of 2: one micro-batch of four 8K sequences, one empty; pp = 1, so one micro-batch in flight."""
    a = [Assignment(i, 8192, 0, 0) for i in range(4)] + [Assignment(4 + i, 1024, 1, i % 2) for i in range(2)]
    return Plan.of(step=0, dp=2, micro_batches=2, assignments=a)


def qwen_memory(overflow: Overflow, fits: list[int], too_much: list[int]) -> tuple[MemoryModel, object]:
    """Qwen2.5-3B without checkpointing on dp2 x 2 micro-batches, with an HBM that holds a micro-batch of the
    lengths ``fits`` but not one of ``too_much``."""
    setup = prepare(OmegaConf.to_object(compose_config(pinned(
        ["layout.dp=2", "cluster.gpus_per_node=2", "layout.micro_batches=2"]))))
    cfg = replace(MemoryConfig(), overflow=overflow, activation_checkpointing=False, logits_bytes=0.0)
    probe = MemoryModel(cfg, QWEN, setup.layout, 141.0, setup.cost.block_size)

    def need(lengths):
        return probe.bytes_of([0] * len(lengths), [0] * len(lengths), lengths, [1.0] * len(lengths)).max()

    hbm_gb = (need(fits) + need(too_much)) / 2 / GB + cfg.margin_gb
    return MemoryModel(cfg, QWEN, setup.layout, hbm_gb, setup.cost.block_size), setup.cost


def test_overfull_plan_is_repaired_inside_its_rank():
    memory, cost = qwen_memory(Overflow.repair, [8192] * 2, [8192] * 3)
    plan = over_plan()
    assert memory.overfull(memory.plan_bytes(plan, cost)) is not None
    fixed = memory.fitted(plan, make_batching("sequential", {}), cost)  # its repair: policies.repack
    assert memory.overfull(memory.plan_bytes(fixed, cost)) is None
    assert sorted(a.seq_id for a in fixed.assignments) == list(range(6))
    # the DP split is untouched: the repair moved sequences between rank 0's micro-batches only
    assert {a.seq_id: a.dp_rank for a in fixed.assignments} == {a.seq_id: a.dp_rank for a in plan.assignments}
    assert sorted(sum(1 for a in fixed.assignments if (a.dp_rank, a.micro_batch) == (0, j)) for j in range(2)) == [2, 2]


def test_a_policy_may_repair_its_own_plan():
    memory, cost = qwen_memory(Overflow.repair, [8192] * 2, [8192] * 3)

    class Splitter:
        name = "splitter"

        def fit_memory(self, plan, memory_model, cost_model):
            assert memory_model is memory
            return repack(plan, memory_model, cost_model)

    assert memory.overfull(memory.plan_bytes(memory.fitted(over_plan(), Splitter(), cost), cost)) is None


def test_a_policy_without_a_repair_is_rejected_under_repair():
    memory, cost = qwen_memory(Overflow.repair, [8192] * 2, [8192] * 3)
    with pytest.raises(MemoryLimitError, match=r"^step 0: the plan of 'plain' \(which has no fit_memory to repair "
                                               r"it\) needs .* on DP rank 0, pipeline stage 0 "):
        memory.fitted(over_plan(), type("P", (), {"name": "plain"})(), cost)


def test_overfull_plan_is_rejected_in_one_line():
    memory, cost = qwen_memory(Overflow.reject, [8192] * 2, [8192] * 3)
    with pytest.raises(MemoryLimitError) as err:
        memory.fitted(over_plan(), type("P", (), {"name": "sequential"})(), cost)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("step 0: the plan of 'sequential' needs ")
    assert "on DP rank 0, pipeline stage 0 (during micro-batch 0's backward)" in message
    assert f"GB available (cluster.hbm_gb={memory.hbm_gb:g} - memory.margin_gb=8)" in message


def test_allow_only_reports():
    memory, cost = qwen_memory(Overflow.allow, [8192] * 2, [8192] * 3)
    assert memory.fitted(over_plan(), object(), cost) == over_plan()
    memory.check_batch([Request(0, 32768)])


def test_a_batch_too_big_for_every_plan_is_rejected_after_the_repair():
    memory, cost = qwen_memory(Overflow.repair, [8192] * 2, [8192] * 3)  # room for 2 x 2 x 2 of them, not 10
    batch = [Sequence(i, 8192, 0.5) for i in range(10)]
    with pytest.raises(MemoryLimitError, match=r"^step 4: the plan of 'sequential' after its repair needs "):
        oracle_planner(make_batching("sequential", {}), make_sparsity("fixed", {}), batch, memory.layout, cost,
                       memory).plan(requests(batch), 4)


def test_the_planner_repairs_through_the_shared_planning_step():
    # a micro-batch holds one 8K sequence and two 1K ones, not two 8K ones: only moves to the other rank help
    memory, cost = qwen_memory(Overflow.repair, [8192, 1024, 1024], [8192] * 2)
    batch = [Sequence(i, 8192, 0.5) for i in range(4)] + [Sequence(4 + i, 1024, 0.5) for i in range(4)]
    batching, sparsity = make_batching("sorted", {}), make_sparsity("fixed", {"p": 0.9})
    unchecked = oracle_planner(batching, sparsity, batch, memory.layout, cost).plan(requests(batch), 0)
    assert memory.overfull(memory.plan_bytes(unchecked, cost)) is not None  # sorted piles the long ones together
    checked = oracle_planner(batching, sparsity, batch, memory.layout, cost, memory).plan(requests(batch), 0)
    assert memory.overfull(memory.plan_bytes(checked, cost)) is None
    assert sorted(a.length for a in checked.assignments if a.dp_rank == 1) == [1024] * 4 + [8192] * 2
    assert all(a.budget.p == 0.9 for a in checked.assignments)  # tuned after the repair


def test_sequence_that_fits_under_no_plan_is_named():
    memory, _ = qwen_memory(Overflow.repair, [8192] * 2, [8192] * 3)
    with pytest.raises(MemoryLimitError, match=r"^sequence 7 \(length 32768 tokens\) needs [0-9.]+ GB on pipeline "
                                               r"stage 0 alone in its micro-batch, above the [0-9.]+ GB available"):
        memory.check_batch([Request(3, 4096), Request(7, 32768)])
    memory.check_batch([Request(3, 8192)])


def run_cli(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, "-m", "sparsebalance.sim.run", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.slow
def test_unfittable_sequence_through_sim_run_is_one_line_and_leaves_nothing(tmp_path):
    # Qwen2.5-3B without checkpointing on one stage: a ~29K-token sequence alone needs about 178 GB
    # the error comes mid-run, after Hydra made the run dir (and its parent): both are removed again
    proc = run_cli(f"hydra.run.dir={tmp_path / 'runs' / 'run'}", *PINNED_OVERRIDES,
                   "memory.activation_checkpointing=false", "steps=3", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert lines[0].startswith("error: sequence ") and " tokens) needs " in lines[0]
    assert ("it fits under no plan; allowed: shorter sequences (workload.max_len), "
            "memory.activation_checkpointing=true") in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overrides,needle", [
    (["memory.margin_gb=-1"], "memory.margin_gb=-1.0 is out of range; allowed: >= 0"),
    (["memory.margin_gb=141"], "memory.margin_gb=141 leaves nothing of cluster.hbm_gb=141; allowed: margin_gb < 141"),
    (["memory.activations.ffn=nan"], "memory.activations.ffn=nan is not allowed"),
    (["memory.sharding=zero9"], "expected one of [ddp, zero1, fsdp]"),
    (["memory.profile=nope.json"], "memory.profile='nope.json': no such file"),
])
def test_bad_memory_config_is_one_line(tmp_path, overrides, needle):
    proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", "steps=2", *overrides, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- measured profile
def profile_for(model: ModelConfig, held_layer=1000.0) -> dict:
    terms = {"held_layer": held_layer, "held_micro_batch": 10.0, "transient": 500.0, "transient_bytes": 1e6}
    shape = {k: getattr(model, k) for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn")}
    return {"schema_version": 1, "gpu": "h200", "meta": {}, "block_size": 128,
            "shapes": {model.name: {"shape": shape,
                                    "modes": {"full": terms, "checkpointed": dict(terms, held_layer=9.0)}}}}


def test_profile_terms_replace_first_principles_for_its_shapes(tmp_path):
    path = tmp_path / "memory.json"
    path.write_text(json.dumps(profile_for(QWEN)))
    terms = load_profile_terms(str(path), replace(QWEN, layers=8, vocab=100))  # per-layer shape only matters
    assert terms["full"].held_layer == 1000.0 and terms["checkpointed"].held_layer == 9.0
    with pytest.raises(ConfigError, match="has no entry for the layer shape of model 'llama3-8b'"):
        load_profile_terms(str(path), LLAMA)


@pytest.mark.parametrize("mutate,needle", [
    (lambda p: p.update(schema_version=2), "schema_version must be 1"),
    (lambda p: p.update(shapes={}), "shapes must be a non-empty object"),
    (lambda p: p["shapes"]["qwen2.5-3b"]["modes"]["full"].update(transient=-1.0), "modes.full.transient=-1.0"),
    (lambda p: p["shapes"]["qwen2.5-3b"]["modes"].pop("checkpointed"), "modes.checkpointed must have the keys"),
])
def test_malformed_profile_is_one_line(tmp_path, mutate, needle):
    profile = profile_for(QWEN)
    mutate(profile)
    path = tmp_path / "memory.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(ConfigError, match="memory.profile=") as err:
        load_profile_terms(str(path), QWEN)
    assert needle in str(err.value) and "\n" not in str(err.value)
