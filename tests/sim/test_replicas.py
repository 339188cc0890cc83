"""Pricing replicas of one batch at once (sim.groups, CostModel.micro_batch_costs with [R, n] kept fractions) gives
the same bits as the replicas laid end to end, in every attention backend mode and with CP; DST's table built
from the distinct (block count, sample) pairs is the one built per sample."""
import numpy as np
import pytest
from omegaconf import OmegaConf
from pinned import SPARSE_PEER_PROFILE
from sparsebalance.policies.dst import (
    DynamicSparsityTuning,
    LevelTable,
    distinct_outcomes,
    level_budgets,
)
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.estimate import Belief
from sparsebalance.sim.groups import Groups
from sparsebalance.sim.plan import Budget, BudgetArrays, Plan

FIELDS = ("fwd_ms", "bwd_ms", "attn_fwd_ms", "attn_bwd_ms", "select_ms", "cp_comm_ms", "tokens", "dense", "backend")


def cost_for(mode):
    cfg = OmegaConf.to_object(compose_config([f"cost.profile={SPARSE_PEER_PROFILE}",
                                              f"cost.attention_backend={mode}"]))
    return make_cost(cfg.cost, cfg.model, Cluster.from_config(cfg.cluster), recompute=True)


def batch(seed=1, n=30, replicas=5):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(100, 40000, n)
    group = np.sort(rng.integers(0, 11, n))  # micro-batch 11 of 12 stays empty
    kept = rng.uniform(0.02, 1.0, (replicas, n))
    kept[2] = 1.0  # a replica all dense
    kept[3, :5] = 1.0  # one partly dense
    kept[4] = np.minimum(kept[4], 0.99)  # one all sparse
    return lengths, group, kept


@pytest.mark.parametrize("mode", ["ours", "dense_best", "hybrid"])
@pytest.mark.parametrize("cp", [1, 4])
def test_replicas_are_priced_as_the_batches_laid_end_to_end(mode, cp):
    cost, (lengths, group, kept) = cost_for(mode), batch()
    layout = Layout(dp=4, cp=cp, micro_batches=3, gpus=4 * cp)
    r = kept.shape[0]
    flat = cost.micro_batch_costs(np.tile(lengths, r), kept.ravel(), (np.arange(r)[:, None] * 12 + group).ravel(),
                                  12 * r, layout)
    replicas = cost.micro_batch_costs(lengths, kept, group, 12, layout)
    for name in FIELDS:
        assert np.array_equal(getattr(replicas, name), getattr(flat, name)), name


def test_group_maxima_are_those_of_maximum_at():
    rng = np.random.default_rng(0)
    group = rng.integers(0, 9, 40)
    values = rng.uniform(-1.0, 5.0, (3, 40))
    expected = np.zeros(27)
    np.maximum.at(expected, (np.arange(3)[:, None] * 9 + group).ravel(), values.ravel())
    assert np.array_equal(Groups(group, 9, 3).max(values), expected)


@pytest.mark.parametrize("family", ["topp", "topk"])
def test_the_level_table_from_distinct_pairs_is_the_one_priced_per_sample(family):
    cost = cost_for("ours")
    lengths, group, _ = batch(n=24)
    dp, m = 4, 3
    plan = Plan(0, dp, m, np.arange(lengths.size), lengths, group // m, group % m,
                BudgetArrays.uniform(Budget(p=0.9), lengths.size))
    rng = np.random.default_rng(3)
    samples = rng.choice([0.2, 0.35, 0.5, 0.8], size=(8, lengths.size))  # few distinct values, as a belief's
    params = DynamicSparsityTuning.Params(family=family)
    budgets, _ = level_budgets(params, cost.block_size, int(lengths.max()))
    layout = Layout(dp=dp, micro_batches=m, gpus=dp)
    table = LevelTable.build(plan, layout, cost, budgets, Belief(plan.seq_ids, samples))
    cols = BudgetArrays.of(budgets)
    g, s, n = len(budgets), samples.shape[0], lengths.size
    kept = cost.kept_fractions(*(np.broadcast_to(x, (g, s, n)) for x in (
        lengths, samples[None], cols.p[:, None, None], cols.kept_fraction[:, None, None], cols.top_k[:, None, None],
        cols.p_floor[:, None, None])))
    costs = cost.micro_batch_costs(np.broadcast_to(lengths, (g, s, n)).ravel(), kept.ravel(),
                                   (np.arange(g * s)[:, None] * dp * m + group[None, :]).ravel(), g * s * dp * m,
                                   layout)
    assert np.array_equal(table.fwd, costs.fwd_ms.reshape(g, s, dp, m))
    assert np.array_equal(table.bwd, costs.bwd_ms.reshape(g, s, dp, m))
    pairs_kept, pairs_coverage, inverse = distinct_outcomes(cost, lengths, samples, cols)
    assert np.array_equal(pairs_kept[:, inverse], kept)
    assert np.array_equal(pairs_coverage[:, inverse], cost.coverages(samples[None], kept))
