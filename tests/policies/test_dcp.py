"""Dynamic-CP policies: Megatron's degrees and grouping, verl's order, the sparsity-aware degrees and budgets, and the
matched fixed-top-k baseline of sim.compare."""
import numpy as np
import pytest
from omegaconf import OmegaConf

from sparsebalance.policies.dcp import cp_degrees
from sparsebalance.policies.sparse_dcp import chosen_degrees
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.compare import matched_k
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.policy import make_batching
from sparsebalance.sim.setup import prepare
from sparsebalance.sim.workload import Request, truth_of

from oracle import oracle

LAYOUT = Layout(dp=1, cp=8, pp=2, micro_batches=2, gpus=16, cp_mode="dynamic")
LENGTHS = [30000, 20000, 9000, 8000, 5000, 4000, 3000, 2500, 2000, 1500, 1200, 1000]


@pytest.fixture(scope="module")
def cost():
    cfg = compose_config(["cost=roofline", "cluster.nodes=2"])
    return make_cost(cfg.cost, cfg.model, Cluster.from_config(cfg.cluster), recompute=True)


def batch():
    return [Request(i, n) for i, n in enumerate(LENGTHS)]


def sequences():
    class Seq:
        def __init__(self, i, n):
            self.id, self.length, self.sensitivity = i, n, 0.3
    return [Seq(i, n) for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("name", ["megatron_dcp", "verl_dcp"])
def test_megatrons_degrees_fit_the_tokens_and_groups_do_not_overlap(name, cost):
    plan = make_batching(name, {"max_seq_len_per_rank": 8192}).plan(batch(), LAYOUT, cost, 0, oracle(sequences()))
    assert sorted(plan.seq_ids.tolist()) == list(range(len(LENGTHS)))
    least = {i: max(1, 2 ** int(np.ceil(np.log2(n / 8192)))) for i, n in enumerate(LENGTHS)}
    for seq, size in zip(plan.seq_ids.tolist(), plan.cp_size.tolist(), strict=True):
        assert size >= least[seq] and size & (size - 1) == 0  # widened groups may be larger, never smaller
    for mb in range(LAYOUT.micro_batches):
        taken = np.zeros(LAYOUT.domain, dtype=int)
        for first, size in {(f, c) for f, c, m in zip(plan.cp_first.tolist(), plan.cp_size.tolist(),
                                                       plan.micro_batch_ids.tolist(), strict=True) if m == mb}:
            taken[first:first + size] += 1
        assert taken.max() <= 1  # the groups of one micro-batch are disjoint
    outcome = Engine(LAYOUT, cost, cost.cluster).step(plan, truth_of(sequences()))
    assert np.isfinite(outcome.record.step_ms) and outcome.record.step_ms > 0


def test_a_sequence_needing_more_than_layout_cp_ranks_is_refused():
    with pytest.raises(ConfigError, match=r"sequence 7 of 70000 tokens needs 16 CP ranks .* layout.cp=8"):
        cp_degrees(np.array([1000, 70000]), 8192, LAYOUT, np.array([6, 7]))


def test_a_dynamic_policy_on_a_static_layout_is_refused(cost):
    with pytest.raises(ConfigError, match="layout.cp_mode=dynamic"):
        make_batching("megatron_dcp", {}).plan(batch(), Layout(dp=8, cp=1, micro_batches=2, gpus=8), cost, 0,
                                               oracle(sequences()))


def test_the_sparsity_aware_degree_is_the_cheapest_in_gpu_time_within_the_cap():
    layout = Layout(dp=1, cp=4, micro_batches=1, gpus=4, cp_mode="dynamic")
    # sequence 0 scales perfectly (long, dense-like), sequence 1 barely (short and sparse): 1 needs no CP
    times = {1: np.array([400.0, 100.0]), 2: np.array([200.0, 90.0]), 4: np.array([100.0, 85.0])}
    degrees = chosen_degrees(times, np.array([1, 1]), layout)
    # cap: max(even share of the least GPU time (400 + 100) / 4 = 125, slowest fastest time 100) = 125
    assert degrees.tolist() == [4, 1]


def test_sparsebalance_dcp_keeps_the_start_coverage_it_expects(cost):
    policy = make_batching("sparsebalance_dcp", {})
    belief = oracle(sequences())
    plan = policy.plan(batch(), LAYOUT, cost, 0, belief)
    lengths = plan.lengths.astype(float)
    expected = cost.coverages(belief.at(plan.seq_ids), plan.budgets.kept(cost, plan.lengths, 1.0)).mean(axis=0)
    start_k = min(k for k in range(1, 256) if np.average(
        cost.coverages(belief.at(plan.seq_ids), cost.kept_fractions(plan.lengths, np.ones(len(plan)), 1.0, None,
                                                                    np.full(len(plan), float(k)))).mean(axis=0),
        weights=lengths**2) >= 0.905)
    start = cost.coverages(belief.at(plan.seq_ids), cost.kept_fractions(plan.lengths, np.ones(len(plan)), 1.0, None,
                                                                        np.full(len(plan), float(start_k))))
    assert np.average(expected, weights=lengths**2) >= np.average(start.mean(axis=0), weights=lengths**2) * (1 - 1e-9)


def test_the_matched_fixed_k_is_the_fewest_blocks_reaching_the_coverage():
    cfg = compose_config(["+experiment=paper", "steps=3"])
    setup = prepare(OmegaConf.to_object(cfg))
    batches = [setup.workload.batch(step) for step in range(3)]

    def reached(k):
        total = 0.0
        for b in batches:
            lengths = np.array([s.length for s in b], dtype=float)
            sens = np.array([s.sensitivity for s in b])
            kept = setup.cost.kept_fractions(lengths, sens, 1.0, None, np.full(lengths.size, float(k)))
            total += np.average(setup.cost.coverages(sens, kept), weights=lengths**2)
        return total / len(batches)

    target = reached(40)
    k = matched_k(cfg, target)
    assert reached(k) >= target - 1e-12 and reached(k - 1) < target
