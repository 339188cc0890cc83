"""Hand-computed step times, zero bubble when balanced, exact event traces and the 1F1B bubble."""
import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sparsebalance.sim.plan import Assignment, Plan
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.engine import Engine, run_pipeline
from sparsebalance.sim.config import compose_config

# 2 GPUs on one node: DP=2 with the roofline cost.
# Without activation checkpointing, so that the backward is exactly the hand-written one (see the recompute test).
# One all-reduce after the backward (no buckets), so that the step is compute plus the whole all-reduce.
OVERRIDES = ["cost=roofline", "cluster.nodes=1", "cluster.gpus_per_node=2", "layout.dp=2", "layout.micro_batches=1",
             "memory.activation_checkpointing=false", "cluster.grad_bucket_mb=0"]


def engine_for(overrides):
    cfg = compose_config(overrides)
    cluster = Cluster.from_config(cfg.cluster)
    layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
    cost = make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)
    return cfg, Engine(layout, cost, cluster)


@functools.cache
def shared_engine() -> Engine:
    """One engine for every hypothesis example: composing the config is what costs, and each example sets the
    two attributes that reduced_ms reads before it calls it."""
    return engine_for(OVERRIDES)[1]


def hand_seq_ms(length, cfg):
    """Forward + backward of one dense document, written out from first principles."""
    m, c, cl = cfg.model, cfg.cost, cfg.cluster
    nb = math.ceil(length / c.block_size)
    attn_flops = 4 * c.block_size**2 * m.head_dim * m.heads * nb * (nb + 1) / 2
    layer_params = 2 * m.hidden * m.heads * m.head_dim + 2 * m.hidden * m.kv_heads * m.head_dim + 3 * m.hidden * m.ffn
    # The LM head is a matmul spread over the layers; the input embedding is a lookup (no FLOPs).
    layer_flops = 2 * (layer_params + m.vocab * m.hidden / m.layers) * length
    attn_rate = cl.peak_tflops * 1e12 * c.attn_efficiency / 1e3  # FLOP per ms
    mm_rate = cl.peak_tflops * 1e12 * c.matmul_efficiency / 1e3
    weights_ms = layer_params * 2 / (cl.hbm_tbps * 1e12 / 1e3)
    fwd = attn_flops / attn_rate + max(layer_flops / mm_rate, weights_ms)
    bwd = c.attn_bwd_ratio * attn_flops / attn_rate + 2 * max(layer_flops / mm_rate, weights_ms)
    return m.layers * (fwd + bwd)


def hand_allreduce_ms(cfg, n):
    m, tier = cfg.model, cfg.cluster.intra
    embeddings = (1 if m.tie_embeddings else 2) * m.vocab * m.hidden  # Qwen2.5-3B ties them: one matrix
    per_layer = 2 * m.hidden * m.heads * m.head_dim + 2 * m.hidden * m.kv_heads * m.head_dim + 3 * m.hidden * m.ffn
    params = m.layers * per_layer + embeddings
    nbytes = params * cfg.cluster.grad_bytes
    return 2 * (n - 1) * tier.latency_us / 1e3 + 2 * (n - 1) / n * nbytes / (tier.bandwidth_gbps * 1e9 / 1e3)


def two_rank_plan(lengths):
    return Plan.of(0, 2, 1, [Assignment(i, n, i, 0) for i, n in enumerate(lengths)])


def half(plan):
    """Every sequence's sensitivity 0.5 (the plans here are dense, which no sensitivity changes)."""
    return {a.seq_id: 0.5 for a in plan.assignments}


def test_dp2_step_time_matches_hand_computation():
    cfg, engine = engine_for(OVERRIDES)
    plan = two_rank_plan([3000, 17000])
    outcome = engine.step(plan, half(plan))
    expected = max(hand_seq_ms(3000, cfg), hand_seq_ms(17000, cfg)) + hand_allreduce_ms(cfg, 2)
    assert outcome.record.step_ms == pytest.approx(expected, rel=1e-9)
    idle = hand_seq_ms(17000, cfg) - hand_seq_ms(3000, cfg)
    assert outcome.record.bubble_fraction == pytest.approx(idle / (2 * hand_seq_ms(17000, cfg)), rel=1e-9)


def bucket_by_bucket_ms(start, busy, t, b):
    """The reduction written out bucket by bucket: bucket j is ready on a rank at start + busy (j+1)/b and
    starts once every rank has it and bucket j-1 is done."""
    done = -np.inf
    for j in range(b):
        ready = (start + busy * (j + 1) / b).max(axis=0)
        done = np.maximum(done, ready) + t
    return float(done.max())


@settings(max_examples=200)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 40), st.floats(0.0, 5.0),
       st.randoms(use_true_random=False))
def test_bucketed_reduction_matches_bucket_by_bucket(dp, pp, buckets, bucket_ms, rnd):
    start = np.array([[rnd.uniform(0, 10) for _ in range(pp)] for _ in range(dp)])
    busy = np.array([[rnd.uniform(0, 10) for _ in range(pp)] for _ in range(dp)])
    engine = shared_engine()
    engine.buckets, engine.bucket_ms = buckets, bucket_ms
    assert engine.reduced_ms(start, busy) == pytest.approx(bucket_by_bucket_ms(start, busy, bucket_ms, buckets))


def test_buckets_hide_the_all_reduce_behind_the_last_backward():
    """Qwen2.5-3B's 3.1e9 bf16 gradients in 25 MiB buckets over two GPUs: all but the last bucket are reduced
    while the long backward still runs, so the step is the slow rank's compute plus one bucket."""
    cfg, whole = engine_for(OVERRIDES)
    _, bucketed = engine_for(OVERRIDES[:-1])
    m = cfg.model
    embeddings = (1 if m.tie_embeddings else 2) * m.vocab * m.hidden
    params = m.layers * (2 * m.hidden * m.heads * m.head_dim + 2 * m.hidden * m.kv_heads * m.head_dim
                         + 3 * m.hidden * m.ffn) + embeddings
    assert bucketed.buckets == math.ceil(params * 2 / (25 * 2**20))
    plan = two_rank_plan([3000, 17000])
    compute = max(hand_seq_ms(3000, cfg), hand_seq_ms(17000, cfg))
    t = bucketed.bucket_ms
    assert bucketed.step(plan, half(plan)).record.step_ms == pytest.approx(compute + t, rel=1e-9)
    assert t < hand_allreduce_ms(cfg, 2) / 100 < whole.step(plan, half(plan)).record.step_ms - compute


def test_balanced_batch_has_zero_bubble():
    _, engine = engine_for(OVERRIDES)
    plan = two_rank_plan([8192, 8192])
    assert engine.step(plan, half(plan)).record.bubble_fraction == 0.0


def test_exact_event_trace_1f1b_two_stages():
    timeline = run_pipeline(np.ones((1, 2)), 2 * np.ones((1, 2)), np.zeros((1, 2)), pp=2, trace=True)
    assert timeline.trace == [
        (0.0, 1.0, 0, 0, "F", 0),
        (1.0, 2.0, 0, 0, "F", 1),
        (1.0, 2.0, 0, 1, "F", 0),
        (2.0, 4.0, 0, 1, "B", 0),
        (4.0, 5.0, 0, 1, "F", 1),
        (4.0, 6.0, 0, 0, "B", 0),
        (5.0, 7.0, 0, 1, "B", 1),
        (7.0, 9.0, 0, 0, "B", 1),
    ]
    assert timeline.finish_ms.tolist() == [[9.0, 7.0]]
    # Stage 0 waits for both gradients (2 + 1); stage 1 waits for its first input (1) and the barrier (2).
    assert timeline.idle_ms[0].sum(axis=0).tolist() == [3.0, 3.0]


def test_exact_event_trace_gradient_accumulation():
    fwd, bwd = np.array([[1.0, 2.0], [3.0, 0.5]]), np.array([[2.0, 4.0], [6.0, 1.0]])
    timeline = run_pipeline(fwd, bwd, np.zeros((2, 2)), pp=1, trace=True)
    assert timeline.trace == [
        (0.0, 1.0, 0, 0, "F", 0), (0.0, 3.0, 1, 0, "F", 0), (1.0, 3.0, 0, 0, "B", 0),
        (3.0, 5.0, 0, 0, "F", 1), (3.0, 9.0, 1, 0, "B", 0), (5.0, 9.0, 0, 0, "B", 1),
        (9.0, 9.5, 1, 0, "F", 1), (9.5, 10.5, 1, 0, "B", 1),
    ]
    assert timeline.idle_ms[:, :, 0].tolist() == [[0.0, 1.5], [0.0, 0.0]]


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (8, 16), (3, 5)])
def test_1f1b_bubble_is_textbook(pp, m):
    timeline = run_pipeline(np.full((2, m), 1.0), np.full((2, m), 2.0), np.zeros((2, m)), pp=pp)
    barrier = timeline.finish_ms.max()
    assert barrier == pytest.approx((m + pp - 1) * 3.0)
    bubble = timeline.idle_ms.sum() / (2 * pp * barrier)
    assert bubble == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)


def test_pipeline_layout_runs_end_to_end():
    cfg, engine = engine_for(["cost=roofline", "layout.pp=4", "layout.micro_batches=8"])
    from oracle import oracle
    from sparsebalance.sim.policy import make_batching
    from sparsebalance.sim.workload import Workload, requests, truth_of

    workload = Workload(cfg.workload, cfg.model.max_context, 0)
    batch = workload.batch(0)
    plan = make_batching("karmarkar_karp", {}).plan(requests(batch), engine.layout, engine.cost, 0, oracle(batch))
    outcome = engine.step(plan, truth_of(batch))
    assert outcome.rows["stage"].max() == 3
    assert 0 < outcome.record.bubble_fraction < 1
    # Each stage runs every micro-batch once, forward and backward.
    assert len(outcome.rows["stage"]) == engine.layout.dp * 8 * 4


def test_activation_checkpointing_adds_the_recomputed_forward_to_the_backward():
    _, plain = engine_for(OVERRIDES)
    _, checkpointed = engine_for([*OVERRIDES[:-1], "memory.activation_checkpointing=true"])
    layout = plain.layout
    lengths, kept = np.array([3000, 17000]), np.array([1.0, 0.3])
    off = plain.cost.micro_batch_costs(lengths, kept, np.arange(2), 2, layout)
    on = checkpointed.cost.micro_batch_costs(lengths, kept, np.arange(2), 2, layout)
    recomputed = off.attn_fwd_ms + off.other_fwd_ms  # no CP: the ring transfer is zero
    assert np.allclose(on.fwd_ms, off.fwd_ms) and np.allclose(on.bwd_ms, off.bwd_ms + recomputed)
