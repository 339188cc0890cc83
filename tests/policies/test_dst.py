"""dst: the pipeline estimate is the engine's, makespan never grows, budgets stay in [floor, cap],
zero heterogeneity is a no-op, and the infeasible cases behave as documented."""
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from sparsebalance.policies.base import uniform_budget_plan

from sparsebalance.sim.policy import make_batching, make_sparsity
from sparsebalance.policies.dst import LevelTable, level_budgets
from sparsebalance.sim.plan import Budget
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.engine import Engine, run_pipeline
from sparsebalance.sim.pipeline import pipeline_ms
from sparsebalance.sim.workload import Sequence, requests
from oracle import oracle
from pinned import BACKENDS_PROFILE, pinned


@pytest.fixture(scope="module")
def world():
    cfg = compose_config(pinned(["cluster.nodes=2"]))  # the calibrated (default) cost model
    cluster = Cluster.from_config(cfg.cluster)
    return cluster, make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)


def plan_for(lengths, sens, layout, cost, batching="sequential"):
    """The batch's plan and the belief that knows each sequence's sensitivity (DST then plans on the truth)."""
    batch = [Sequence(i, int(n), float(s)) for i, (n, s) in enumerate(zip(lengths, sens, strict=True))]
    belief = oracle(batch)
    return make_batching(batching, {}).plan(requests(batch), layout, cost, step=0, belief=belief), belief


def barrier_ms(plan, belief, layout, cost, cluster):
    truth = dict(zip(belief.ids.tolist(), belief.samples[0].tolist(), strict=True))
    return float(Engine(layout, cost, cluster).step(plan, truth).timeline.finish_ms.max())


layouts = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4))  # dp, pp, micro-batches
budgets = st.tuples(st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0)).map(
    lambda t: (t[0], t[0] + t[1] * (1 - t[0]), t[0] + t[1] * (1 - t[0]) + t[2] * (1 - t[0] - t[1] * (1 - t[0])))
)  # floor <= p <= cap <= 1


@settings(max_examples=60)
@given(st.integers(1, 8), st.integers(1, 6), st.data())
def test_pipeline_estimate_is_the_engine_schedule(pp, m, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    fwd, bwd = rng.random((3, m)) * 5, rng.random((3, m)) * 9
    p2p = rng.random((3, m)) * data.draw(st.sampled_from([0.0, 1.0]))
    expected = run_pipeline(fwd, bwd, p2p, pp).finish_ms.max(axis=1)
    np.testing.assert_allclose(pipeline_ms(fwd, bwd, p2p, pp), expected, rtol=1e-12)


def test_level_table_makespan_matches_the_engine(world):
    cluster, cost = world
    layout = Layout(dp=2, pp=4, micro_batches=4)
    rng = np.random.default_rng(1)
    plan, belief = plan_for(rng.integers(1024, 32768, 16), rng.uniform(0.05, 1, 16), layout, cost)
    grid = [Budget(p=0.8), Budget(p=0.9), Budget(p=1.0)]
    table = LevelTable.build(plan, layout, cost, grid, belief)
    for level, budget in enumerate(grid):
        fixed = uniform_budget_plan(plan, budget)
        assert table.makespan(np.full((2, 4), level)) == pytest.approx(barrier_ms(fixed, belief, layout, cost, cluster),
                                                                       rel=1e-12)


@pytest.mark.slow
@settings(max_examples=80)
@given(layouts, budgets, st.data())
def test_dst_never_slower_than_fixed_and_budgets_in_range(world, layout_dims, budget, data):
    cluster, cost = world
    dp, pp, m = layout_dims
    floor, p, cap = budget
    n = data.draw(st.integers(1, 3 * dp * m))
    lengths = data.draw(st.lists(st.integers(256, 32768), min_size=n, max_size=n))
    sens = data.draw(st.lists(st.floats(0.01, 1.0), min_size=n, max_size=n))
    layout = Layout(dp=dp, pp=pp, micro_batches=m)
    plan, belief = plan_for(lengths, sens, layout, cost, data.draw(st.sampled_from(["sequential", "karmarkar_karp"])))
    weight = data.draw(st.sampled_from(["sequence", "token", "attention"]))
    dst = make_sparsity("dst", {"p": p, "floor": floor, "cap": cap, "levels": 9, "coverage_weight": weight})
    tuned = dst.tune(plan, layout, cost, belief)
    fixed = uniform_budget_plan(plan, Budget(p=p))
    assert barrier_ms(tuned, belief, layout, cost, cluster) <= \
        barrier_ms(fixed, belief, layout, cost, cluster) * (1 + 1e-12)
    assert all(floor <= a.budget.p <= cap for a in tuned.assignments)
    assert [(a.seq_id, a.dp_rank, a.micro_batch) for a in tuned.assignments] == [
        (a.seq_id, a.dp_rank, a.micro_batch) for a in plan.assignments
    ]
    assert mean_coverage(tuned, belief, cost, weight) >= mean_coverage(fixed, belief, cost, weight) - 1e-12


def mean_coverage(plan, belief, cost, weight="attention"):
    """Coverage over the plan's sequences (at the sensitivities the oracle ``belief`` holds), weighted as DST's
    constraint is (its default: attention work)."""
    lengths = np.array([a.length for a in plan.assignments], dtype=np.float64)
    sens = belief.at([a.seq_id for a in plan.assignments])[0]
    kept = [cost.kept_fraction(Sequence(a.seq_id, a.length, s), a.budget.p)
            for a, s in zip(plan.assignments, sens, strict=True)]
    coverage = cost.coverages(sens, np.array(kept))
    weights = {"sequence": np.ones_like(lengths), "token": lengths, "attention": lengths**2}[weight]
    return float(np.average(coverage, weights=weights))


def test_attention_weighting_keeps_the_long_sequences_covered(world):
    """A straggler of long sequences next to a rank of short ones: the unweighted mean lets DST cut the
    long ones' budgets (the short ones' higher coverage pays for it), attention weighting does not."""
    cluster, cost = world
    layout = Layout(dp=2, micro_batches=2)
    plan, belief = plan_for([32768, 32768, 2048, 2048, 2048, 2048], [0.5] * 6, layout, cost)
    tuned = {w: make_sparsity("dst", {"coverage_weight": w}).tune(plan, layout, cost, belief)
             for w in ("sequence", "attention")}
    fixed = uniform_budget_plan(plan, Budget(p=0.9))
    assert mean_coverage(tuned["sequence"], belief, cost, "attention") < mean_coverage(fixed, belief, cost, "attention")
    assert mean_coverage(tuned["attention"], belief, cost, "attention") >= \
        mean_coverage(fixed, belief, cost, "attention") - 1e-12


@settings(max_examples=60)
@given(layouts, st.integers(1, 3), st.integers(256, 32768), st.floats(0.01, 1.0), budgets)
def test_zero_heterogeneity_is_a_no_op(world, layout_dims, per_mb, length, sens, budget):
    """Identical micro-batches: with pp = 1 there is nothing to rebalance and DST is exactly fixed.

    With pp > 1 identical micro-batches are not interchangeable: 1F1B puts the first one's forward and
    the last one's backward alone on every stage (and hand-offs add slack), so DST may trade budget
    between pipeline positions; then it must still be no slower and cover no less."""
    cluster, cost = world
    dp, pp, m = layout_dims
    floor, p, cap = budget
    layout = Layout(dp=dp, pp=pp, micro_batches=m)
    n = dp * m * per_mb  # every micro-batch gets the same sequences
    plan, belief = plan_for([length] * n, [sens] * n, layout, cost)
    dst = make_sparsity("dst", {"p": p, "floor": floor, "cap": cap})
    # Where selection costs more than sparsity saves (short documents), a higher budget is also faster:
    # DST rightly takes that, so the no-op claim is about costs that grow with the budget.
    rank_ms = LevelTable.build(plan, layout, cost,
                               level_budgets(dst.params, cost.block_size, max(a.length for a in plan.assignments))[0],
                               belief).rank_ms[:, 0]
    assume(np.all(np.diff(rank_ms) >= 0))
    tuned, fixed = dst.tune(plan, layout, cost, belief), uniform_budget_plan(plan, Budget(p=p))
    if pp == 1:
        assert tuned == fixed
    assert barrier_ms(tuned, belief, layout, cost, cluster) <= \
        barrier_ms(fixed, belief, layout, cost, cluster) * (1 + 1e-12)
    assert mean_coverage(tuned, belief, cost) >= mean_coverage(fixed, belief, cost) - 1e-12


def test_straggler_gets_more_sparsity_and_idle_rank_less(world):
    cluster, cost = world
    layout = Layout(dp=2, micro_batches=2)
    plan, belief = plan_for([32768, 16384, 4096, 4096], [0.5] * 4, layout, cost)
    # The plain mean: by attention work the short rank's coverage could not pay for the straggler's sparsity.
    tuned = make_sparsity("dst", {"p": 0.9, "floor": 0.8, "coverage_weight": "sequence"}).tune(plan, layout, cost,
                                                                                               belief)
    by_rank = {a.dp_rank: a.budget.p for a in tuned.assignments}
    assert by_rank[0] < 0.9 < by_rank[1]
    fixed = uniform_budget_plan(plan, Budget(p=0.9))
    assert barrier_ms(tuned, belief, layout, cost, cluster) < barrier_ms(fixed, belief, layout, cost, cluster)


def test_floor_bounds_the_speedup(world):
    """A straggler that is still the slowest at the floor: it sits at the floor, the makespan is its time there."""
    cluster, cost = world
    layout = Layout(dp=2, micro_batches=1)
    plan, belief = plan_for([32768, 1024], [0.9, 0.9], layout, cost)
    tuned = make_sparsity("dst", {"p": 0.9, "floor": 0.85, "coverage_weight": "sequence"}).tune(plan, layout, cost,
                                                                                                belief)
    budgets = {a.dp_rank: a.budget.p for a in tuned.assignments}
    assert budgets == {0: 0.85, 1: 1.0}
    at_floor = uniform_budget_plan(plan, Budget(p=0.85))
    assert barrier_ms(tuned, belief, layout, cost, cluster) == pytest.approx(
        barrier_ms(at_floor, belief, layout, cost, cluster))


def test_coverage_target_sets_the_start_and_an_unreachable_one_gives_the_cap(world):
    """With min_mean_coverage DST starts from the lowest uniform budget that meets it, not from p: here only dense
    (p = 1) covers 0.999 of the attention, and no rank can go sparser without losing it, so DST keeps dense,
    slower than p = 0.9 and at the target. A target that no budget up to the cap meets gives every sequence the
    cap (the most coverage DST may give), at the cap's makespan."""
    cluster, cost = world
    layout = Layout(dp=2, micro_batches=1)
    plan, belief = plan_for([32768, 16384], [0.9, 0.9], layout, cost)
    tuned = make_sparsity("dst", {"p": 0.9, "min_mean_coverage": 0.999}).tune(plan, layout, cost, belief)
    assert tuned == uniform_budget_plan(plan, Budget(p=1.0))
    assert mean_coverage(tuned, belief, cost) >= 0.999
    fixed = uniform_budget_plan(plan, Budget(p=0.9))
    assert barrier_ms(tuned, belief, layout, cost, cluster) > barrier_ms(fixed, belief, layout, cost, cluster)
    capped = make_sparsity("dst", {"p": 0.9, "cap": 0.95, "min_mean_coverage": 0.999}).tune(plan, layout, cost, belief)
    assert capped == uniform_budget_plan(plan, Budget(p=0.95))
    assert mean_coverage(capped, belief, cost) < 0.999


@pytest.mark.parametrize("params", [{"p": 0.7, "floor": 0.8}, {"p": 0.9, "cap": 0.85}, {"levels": 1}, {"floor": 0.0}])
def test_inconsistent_params_are_a_config_error(params):
    with pytest.raises(ConfigError, match="policy.sparsity.params for 'dst'"):
        make_sparsity("dst", params)


def test_same_plan_same_budgets(world):
    _, cost = world
    layout = Layout(dp=2, pp=4, micro_batches=4)
    rng = np.random.default_rng(7)
    plan, belief = plan_for(rng.integers(1024, 32768, 16), rng.uniform(0.05, 1, 16), layout, cost)
    first = make_sparsity("dst", {}).tune(plan, layout, cost, belief).to_json()
    assert make_sparsity("dst", {}).tune(plan, layout, cost, belief).to_json() == first


def test_under_hybrid_dst_plans_dense_where_sparsity_buys_no_time():
    """Under cost.attention_backend=hybrid a level's price is the faster of ours at its budget and the fastest dense
    backend, with every block kept where that is the dense one: the p = 1 level runs at the dense backend's rate,
    and a micro-batch that no budget makes faster on ours (rank 1's short sequences) is dense at every level, so
    DST plans it dense, all its attention covered."""
    costs = {}
    for mode in ("ours", "dense_best", "hybrid"):
        cfg = compose_config([f"cost.profile={BACKENDS_PROFILE}", f"cost.attention_backend={mode}", "cluster.nodes=2"])
        cluster = Cluster.from_config(cfg.cluster)
        costs[mode] = make_cost(cfg.cost, cfg.model, cluster, recompute=False)
    layout = Layout(dp=2, micro_batches=2)
    # rank 0: [32768], [16384, 1024]; rank 1: [1024], [2048, 1024]
    plan, belief = plan_for([32768, 16384, 1024, 1024, 2048, 1024], [0.3, 0.3, 0.5, 0.5, 0.5, 0.5], layout,
                            costs["ours"])
    budgets, _ = level_budgets(make_sparsity("dst", {}).params, costs["hybrid"].block_size)
    assert budgets[-1] == Budget(p=1.0)
    tables = {mode: LevelTable.build(plan, layout, cost, budgets, belief) for mode, cost in costs.items()}
    times = {mode: t.fwd + t.bwd for mode, t in tables.items()}  # [levels, samples, dp, m]
    np.testing.assert_allclose(times["hybrid"], np.minimum(times["ours"], times["dense_best"]), rtol=1e-12)
    np.testing.assert_allclose(times["hybrid"][-1], times["dense_best"][-1], rtol=1e-12)  # p = 1: the dense rate
    np.testing.assert_allclose(times["hybrid"][:, :, 1], times["dense_best"][:, :, 1], rtol=1e-12)
    assert (times["ours"][:-1, :, 1] > times["dense_best"][:-1, :, 1]).all()  # ours at any budget is slower there
    np.testing.assert_allclose(tables["hybrid"].coverage[:, 1], tables["dense_best"].coverage[:, 1], rtol=1e-12)
    assert (tables["hybrid"].coverage[0, 1] > tables["ours"].coverage[0, 1]).all()  # every block kept
    tuned = make_sparsity("dst", {}).tune(plan, layout, costs["hybrid"], belief)
    truth = dict(zip(belief.ids.tolist(), belief.samples[0].tolist(), strict=True))
    step = Engine(layout, costs["hybrid"], cluster).step(tuned, truth)
    short = step.rows["dp_rank"] == 1
    assert (step.rows["attention_backend"][short] == "fa4").all()
    assert (step.rows["coverage"][short] == 1.0).all()
    fixed = Engine(layout, costs["hybrid"], cluster).step(uniform_budget_plan(plan, Budget(p=0.9)), truth)
    assert step.record.step_ms <= fixed.record.step_ms
