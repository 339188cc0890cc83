"""Dynamic CP in the engine: a hand-computed step of CP groups of different sizes, and static plans giving the
static engine's step times exactly."""
import math
from dataclasses import replace

import numpy as np
import pytest
from omegaconf import OmegaConf

from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.plan import Assignment, Plan
from sparsebalance.sim.run import requests
from sparsebalance.sim.setup import make_planner, prepare
from sparsebalance.sim.workload import truth_of

# 4 GPUs of one node as one dynamic domain of CP degrees up to 4, two micro-batches, the roofline cost without
# checkpointing and one all-reduce after the backward (the style of test_analytic.py).
OVERRIDES = ["cost=roofline", "cluster.nodes=1", "cluster.gpus_per_node=4", "layout.dp=1", "layout.cp=4",
             "layout.cp_mode=dynamic", "layout.micro_batches=2", "memory.activation_checkpointing=false",
             "cluster.grad_bucket_mb=0", "workload.global_batch=4"]


def engine_for(overrides):
    cfg = compose_config(overrides)
    cluster = Cluster.from_config(cfg.cluster)
    layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
    cost = make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)
    return cfg, Engine(layout, cost, cluster)


def hand_ms(length, cp, cfg):
    """Forward + backward of one dense document on a CP group of ``cp`` ranks of one node, from first principles:
    each rank does 1/cp of the attention and of the other layers' FLOPs (the weights are streamed whole), and
    the ring passes K and V shards (forward) and them with their gradients (backward) cp - 1 times per layer,
    hidden behind the attention where it is shorter."""
    m, c, cl = cfg.model, cfg.cost, cfg.cluster
    nb = math.ceil(length / c.block_size)
    attn_flops = 4 * c.block_size**2 * m.head_dim * m.heads * nb * (nb + 1) / 2 / cp
    layer_params = 2 * m.hidden * m.heads * m.head_dim + 2 * m.hidden * m.kv_heads * m.head_dim + 3 * m.hidden * m.ffn
    layer_flops = 2 * (layer_params + m.vocab * m.hidden / m.layers) * length / cp
    attn_rate = cl.peak_tflops * 1e12 * c.attn_efficiency / 1e3  # FLOP per ms
    mm_rate = cl.peak_tflops * 1e12 * c.matmul_efficiency / 1e3
    weights_ms = layer_params * 2 / (cl.hbm_tbps * 1e12 / 1e3)
    shard = length / cp * m.kv_heads * m.head_dim * 2 * 2  # K and V, bf16
    def hop(nbytes):
        return cl.intra.latency_us / 1e3 + nbytes / (cl.intra.bandwidth_gbps * 1e9 / 1e3)

    ring_f, ring_b = (cp - 1) * hop(shard), (cp - 1) * hop(2 * shard)
    fwd = max(attn_flops / attn_rate, ring_f) + max(layer_flops / mm_rate, weights_ms)
    bwd = max(c.attn_bwd_ratio * attn_flops / attn_rate, ring_b) + 2 * max(layer_flops / mm_rate, weights_ms)
    return m.layers * (fwd + bwd)


def hand_allreduce_ms(cfg, n):
    m, tier = cfg.model, cfg.cluster.intra
    embeddings = (1 if m.tie_embeddings else 2) * m.vocab * m.hidden
    params = m.layers * (2 * m.hidden * m.heads * m.head_dim + 2 * m.hidden * m.kv_heads * m.head_dim
                         + 3 * m.hidden * m.ffn) + embeddings
    nbytes = params * cfg.cluster.grad_bytes
    return 2 * (n - 1) * tier.latency_us / 1e3 + 2 * (n - 1) / n * nbytes / (tier.bandwidth_gbps * 1e9 / 1e3)


def dense(plan):
    return {int(i): 0.5 for i in plan.seq_ids}


def two_group_plan():
    """Micro-batch 0: a 16K document on ranks 0-1 (CP 2), a 3K one on rank 2 and a 5K one on rank 3 (CP 1 each);
    micro-batch 1: an 8K document on all four (CP 4), which starts once all four ranks are free."""
    rows = [Assignment(0, 16384, 0, 0, cp_ranks=(0, 1)), Assignment(1, 3000, 0, 0, cp_ranks=(2,)),
            Assignment(2, 5000, 0, 0, cp_ranks=(3,)), Assignment(3, 8192, 0, 1, cp_ranks=(0, 1, 2, 3))]
    return Plan.of(0, 1, 2, rows)


def test_two_cp_groups_of_different_sizes_match_the_hand_computation():
    cfg, engine = engine_for(OVERRIDES)
    outcome = engine.step(two_group_plan(), dense(two_group_plan()))
    first = [hand_ms(16384, 2, cfg), hand_ms(3000, 1, cfg), hand_ms(5000, 1, cfg)]
    expected = max(first) + hand_ms(8192, 4, cfg) + hand_allreduce_ms(cfg, 4)
    assert outcome.record.step_ms == pytest.approx(expected, rel=1e-9)
    # idle: each rank waits for the slowest group of micro-batch 0 before the CP-4 group starts
    idle = sum(max(first) - t for t in (first[0], first[0], first[1], first[2]))
    total = max(first) + hand_ms(8192, 4, cfg)
    assert outcome.record.bubble_fraction == pytest.approx(idle / (4 * total), rel=1e-9)


def test_the_expected_step_of_a_dynamic_plan_is_the_engines_step():
    cfg, engine = engine_for(OVERRIDES)
    plan = two_group_plan()
    step = engine.step(plan, dense(plan)).record.step_ms
    assert engine.expected_step_ms(plan, np.ones((3, len(plan)))) == pytest.approx(step, rel=1e-12)


def test_a_dynamic_plan_reads_back_from_json_with_its_cp_groups():
    plan = two_group_plan()
    text = plan.to_json()
    assert '"cp_ranks":[0,1]' in text and Plan.from_json(text) == plan
    assert Plan.from_json(text).assignments[3].cp_ranks == (0, 1, 2, 3)


def test_bad_cp_groups_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        Plan.of(0, 1, 1, [Assignment(0, 100, 0, 0, cp_ranks=(1, 2))])
    with pytest.raises(ValueError, match="consecutive"):
        Plan.of(0, 1, 1, [Assignment(0, 100, 0, 0, cp_ranks=(0, 2))])
    _, engine = engine_for([*OVERRIDES, "layout.cp=2", "layout.dp=2"])
    wide = Plan.of(0, 2, 2, [Assignment(0, 100, 0, 0, cp_ranks=(0, 1, 2, 3))])
    with pytest.raises(ConfigError, match="at most layout.cp=2"):
        engine.step(wide, dense(wide))


def test_dynamic_cp_needs_a_power_of_two_degree():
    with pytest.raises(ConfigError, match="power of two"):
        Layout(dp=1, cp=3, cp_mode="dynamic")


def identity(preset, steps):
    cfg = OmegaConf.to_object(compose_config(["policy=verl", f"+experiment={preset}"]))
    setup = prepare(cfg)
    planner = make_planner(cfg, setup)
    static = Engine(setup.layout, setup.cost, setup.cluster, setup.memory)
    dynamic = Engine(replace(setup.layout, cp_mode="dynamic"), setup.cost, setup.cluster, setup.memory)
    for step in range(steps):
        batch = setup.workload.batch(step)
        plan = planner.plan(requests(batch), step)
        a, b = static.step(plan, truth_of(batch)), dynamic.step(plan, truth_of(batch))
        assert b.record.step_ms == a.record.step_ms
        assert b.record.peak_memory_gb == a.record.peak_memory_gb
        for column in ("compute_ms", "comm_ms", "tokens", "kept_fraction", "coverage", "peak_memory_gb"):
            assert np.array_equal(a.rows[column], b.rows[column]), column
        kept = plan.budgets.kept(setup.cost, plan.lengths[None], planner.belief.at(plan.seq_ids))
        assert dynamic.expected_step_ms(plan, kept) == static.expected_step_ms(plan, kept)


@pytest.mark.parametrize("preset", ["paper", "paper_4nodes"])
def test_a_static_plan_through_the_dynamic_engine_gives_todays_step_times(preset):
    identity(preset, 2)


@pytest.mark.slow
def test_a_static_plan_through_the_dynamic_engine_gives_todays_step_times_with_cp8():
    identity("paper_64nodes_cp", 2)
