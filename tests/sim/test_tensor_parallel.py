"""Tensor parallelism with sequence parallelism: a hand-computed step of one micro-batch at tp = 2, the GEMMs'
roofline efficiency and a profile's measured one, memory divided as Megatron divides it, and the refusals."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.memory import MemoryModel, selection_bytes
from sparsebalance.sim.plan import Assignment, Plan
from sparsebalance.sim.run import check_composition
from sparsebalance.sim.tensor_parallel import roofline_efficiency

# Two GPUs of one node, Qwen2.5-3B on the roofline, no checkpointing (the recompute is a test of its own), one
# all-reduce after the backward; tp = 2 leaves dp = 1, so the step is the micro-batch's compute alone.
OVERRIDES = ["cost=roofline", "cluster.nodes=1", "cluster.gpus_per_node=2", "layout.micro_batches=1",
             "memory.activation_checkpointing=false", "cluster.grad_bucket_mb=0", "cost.launch_ms=0.01"]


def parts(overrides):
    cfg = compose_config(overrides)
    cluster = Cluster.from_config(cfg.cluster)
    layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
    cost = make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)
    return cfg, layout, cost, cluster


def hand_gemm_ms(tokens, cfg, tp):
    """A layer's forward GEMMs on one TP rank on the roofline: QKV and gate/up by columns, output and down by
    rows, the LM head by vocabulary rows (1/layers of it per layer); each max(FLOPs / peak, bytes / HBM)."""
    m, cl = cfg.model, cfg.cluster
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    shapes = [((q + 2 * kv) / tp, m.hidden, 1), (m.hidden, q / tp, 1), (2 * m.ffn / tp, m.hidden, 1),
              (m.hidden, m.ffn / tp, 1), (m.vocab / tp, m.hidden, 1 / m.layers)]
    return sum(w * max(2 * tokens * n * k / (cl.peak_tflops * 1e9), 2 * (tokens * k + k * n + tokens * n)
                       / (cl.hbm_tbps * 1e9)) for n, k, w in shapes)


def hand_step_ms(length, cfg, tp):
    """One dense document alone on one rank of a tp-wide group, written out: attention over heads / tp, the
    GEMMs' work / (tp x efficiency), the launches whole, and per layer and direction two all-gathers and two
    reduce-scatters of length x hidden bf16 over tp ranks of the node."""
    m, c, cl = cfg.model, cfg.cost, cfg.cluster
    nb = math.ceil(length / c.block_size)
    attn_flops = 4 * c.block_size**2 * m.head_dim * (m.heads / tp) * nb * (nb + 1) / 2
    layer_params = 2 * m.hidden * m.heads * m.head_dim + 2 * m.hidden * m.kv_heads * m.head_dim + 3 * m.hidden * m.ffn
    layer_flops = 2 * (layer_params + m.vocab * m.hidden / m.layers) * length
    attn_rate = cl.peak_tflops * 1e9 * c.attn_efficiency  # FLOP per ms
    mm_rate = cl.peak_tflops * 1e9 * c.matmul_efficiency
    weights_ms = layer_params * 2 / (cl.hbm_tbps * 1e9)
    eff = hand_gemm_ms(length, cfg, 1) / (tp * hand_gemm_ms(length, cfg, tp))
    gemm = max(layer_flops / mm_rate, weights_ms)
    nbytes = length * m.hidden * 2
    collective = (tp - 1) * (cl.intra.latency_us / 1e3 + nbytes / tp / (cl.intra.bandwidth_gbps * 1e6))
    fwd = c.launch_ms + attn_flops / attn_rate + c.launch_ms + gemm / (tp * eff) + 4 * collective
    bwd = c.launch_ms + c.attn_bwd_ratio * attn_flops / attn_rate + c.launch_ms + 2 * gemm / (tp * eff) + 4 * collective
    return m.layers * (fwd + bwd), m.layers * 8 * collective


def one_plan(length):
    return Plan.of(0, 1, 1, [Assignment(0, length, 0, 0)])


def test_one_micro_batch_at_tp2_is_the_hand_computed_step():
    cfg, layout, cost, cluster = parts([*OVERRIDES, "layout.tp=2"])
    assert (layout.dp, layout.tp, layout.gpus) == (1, 2, 2)
    outcome = Engine(layout, cost, cluster).step(one_plan(17000), {0: 0.5})
    step_ms, tp_comm_ms = hand_step_ms(17000, cfg, 2)
    assert outcome.record.step_ms == pytest.approx(step_ms, rel=1e-12)
    assert outcome.rows["comm_ms"][0] == pytest.approx(tp_comm_ms, rel=1e-12)
    # the collective of 17000 x 2048 bf16 (69.632 MB) over 2 ranks: 3 us + 69.632 MB / 2 at 450 GB/s = 0.080371 ms
    assert tp_comm_ms / (8 * 36) == pytest.approx(0.003 + 17000 * 2048 * 2 / 2 / 450e6, rel=1e-12)
    # against the same document on one GPU: compute halves at the efficiency, launches stay, collectives join
    _, layout1, cost1, _ = parts([*OVERRIDES, "layout.dp=1", "cluster.gpus_per_node=1"])
    one, two = cost1.micro_batch_cost([17000], [1.0], layout1), cost.micro_batch_cost([17000], [1.0], layout)
    launches, eff = 36 * cfg.cost.launch_ms, roofline_efficiency([17000], cfg.model, 2, cluster)[0]
    assert two.attn_fwd_ms - launches == pytest.approx((one.attn_fwd_ms - launches) / 2, rel=1e-12)
    assert two.other_fwd_ms - launches == pytest.approx((one.other_fwd_ms - launches) / (2 * eff), rel=1e-12)
    assert two.fwd_ms - two.tp_comm_ms / 2 == pytest.approx(2 * launches + (one.fwd_ms - 2 * launches) / 2, rel=1e-9)


def test_the_recompute_runs_the_forwards_collectives_again():
    overrides = [*OVERRIDES, "layout.tp=2"]
    _, layout, plain, _ = parts(overrides)
    _, _, recomputing, _ = parts([*overrides[:-4], "memory.activation_checkpointing=true", *overrides[-3:]])
    a, b = plain.micro_batch_cost([8192], [1.0], layout), recomputing.micro_batch_cost([8192], [1.0], layout)
    assert b.tp_comm_ms == pytest.approx(1.5 * a.tp_comm_ms, rel=1e-12)
    assert b.bwd_ms - a.bwd_ms == pytest.approx(a.fwd_ms, rel=1e-12)


def test_the_roofline_efficiency_is_the_per_rank_gemm_shapes():
    cfg, _, _, cluster = parts(OVERRIDES)
    for tokens in (16, 256, 17000):
        hand = hand_gemm_ms(tokens, cfg, 1) / (2 * hand_gemm_ms(tokens, cfg, 2))
        assert roofline_efficiency([tokens], cfg.model, 2, cluster)[0] == pytest.approx(hand, rel=1e-12)
    # a few rows stream the halved weights at the same time, but each rank still reads every input row: < 1
    assert roofline_efficiency([16], cfg.model, 2, cluster)[0] < 0.999
    assert roofline_efficiency([17000], cfg.model, 2, cluster)[0] == pytest.approx(1.0, rel=1e-12)


def test_a_profiles_measured_efficiency_replaces_the_roofline(tmp_path):
    profile = json.loads(Path("calibrate/profiles/h200.json").read_text())
    profile["tp_efficiency"] = {"2": 0.8}
    path = tmp_path / "h200_tp.json"
    path.write_text(json.dumps(profile))
    _, layout, cost, _ = parts(["+experiment=paper", f"cost.profile={path}", "layout.dp=1", "layout.tp=2",
                                "layout.pp=4"])
    _, layout1, cost1, _ = parts(["+experiment=paper", "layout.dp=1", "layout.pp=4", "cluster.gpus_per_node=4"])
    one, two = cost1.micro_batch_cost([9000], [1.0], layout1), cost.micro_batch_cost([9000], [1.0], layout)
    const = profile["terms"]["layer_fwd"]["const"] * 9  # 36 layers over 4 stages
    assert two.other_fwd_ms == pytest.approx(const + (one.other_fwd_ms - const) / (2 * 0.8), rel=1e-12)
    profile["tp_efficiency"] = {"2": 1.5}
    path.write_text(json.dumps(profile))
    with pytest.raises(ConfigError, match=r"tp_efficiency.2=1.5: allowed: a number in \(0, 1\]"):
        parts(["cost=calibrated", f"cost.profile={path}"])


def test_memory_is_divided_as_megatron_divides_it():
    overrides = ["+experiment=paper", "layout.dp=1", "layout.pp=4"]
    cfg, layout2, _, _ = parts([*overrides, "layout.tp=2"])
    _, layout1, _, _ = parts([*overrides, "cluster.gpus_per_node=4"])
    two, one = (MemoryModel.from_config(cfg, layout, 128) for layout in (layout2, layout1))
    assert np.allclose(two.static, one.static / 2, rtol=1e-12)  # weights, gradients, optimizer states / tp
    lengths, group = np.array([20000.0, 9000.0]), np.array([0, 0])
    held2, transient2 = two.micro_batch_bytes(lengths, np.ones(2), group, 1)
    t, layers = two.terms, cfg.model.layers // 4
    per_layer, shared = selection_bytes(lengths, np.ones(2), group, 1, cfg.model.kv_heads // 2, 128)
    tokens = lengths.sum() / 2  # each TP rank holds half of every per-token term
    assert held2[0, 0] == pytest.approx(layers * (t.held_layer * tokens + per_layer[0]) + t.held_micro_batch
                                        * tokens + shared[0], rel=1e-12)
    logits = cfg.memory.logits_bytes * cfg.model.vocab * tokens  # vocabulary-parallel: vocab / tp per rank
    assert transient2[0, -1] == pytest.approx(t.transient * tokens + t.transient_bytes / 2 + logits, rel=1e-12)


@pytest.mark.parametrize("overrides,needle", [
    (["layout.tp=3"], ("layout.tp=3: tensor-parallel ranks must sit inside one node of cluster.gpus_per_node=8; "
                       "allowed tp: 1, 2, 4, 8")),
    (["layout.tp=16", "cluster.nodes=2"], "layout.tp=16: tensor-parallel ranks must sit inside one node"),
    (["+experiment=paper", "layout.tp=4", "layout.dp=null", "layout.pp=2"],
     "layout.tp=4 does not divide model.kv_heads=2, which TP splits evenly; allowed tp: 1, 2"),
    (["+experiment=paper", "layout.tp=2"], "layout dp=2 x cp=1 x pp=4 x tp=2 = 16 GPUs, but the cluster has 8"),
    (["layout.tp=2", "layout.cp=3"], "layout cp=3 x pp=1 x tp=2 does not divide the cluster's 8 GPUs"),
])
def test_a_layout_tp_cannot_run_is_one_line(overrides, needle):
    with pytest.raises(ConfigError) as caught:
        check_composition(["steps=2", *overrides])
    assert needle in str(caught.value) and "\n" not in str(caught.value)
