"""sab: equals LBB when sparsity carries no information, learns the paired policy's budgets per length
bucket, stays inside the global batch and is deterministic."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sparsebalance.sim.policy import make_batching, make_sparsity
from sparsebalance.sim.plan import Budget
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.estimate import Observation
from sparsebalance.sim.setup import load_policy
from sparsebalance.sim.workload import Sequence, Workload, requests, truth_of
from oracle import oracle, oracle_planner, planned_step
from pinned import pinned

DENSE = ("fixed", {"p": 1.0})
DST = ("dst", {"p": 0.9, "floor": 0.8})


@pytest.fixture(scope="module")
def cluster():
    return Cluster.from_config(compose_config(pinned(["cluster.nodes=2"])).cluster)


@pytest.fixture(scope="module")
def cost(cluster):
    cfg = compose_config(pinned(["cluster.nodes=2"]))
    return make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)


def placement(plan):
    return [(a.seq_id, a.dp_rank, a.micro_batch) for a in plan.assignments]


@pytest.mark.slow  # 60 examples of two planned steps, over 3 s
@settings(max_examples=60)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.floats(0.01, 1.0), st.data())
def test_sab_equals_lbb_with_equal_sensitivity_and_dense_budgets(cost, cluster, dp, pp, m, sens, data):
    layout = Layout(dp=dp, pp=pp, micro_batches=m)
    engine = Engine(layout, cost, cluster)
    lengths = data.draw(st.lists(st.integers(256, 32768), min_size=1, max_size=4 * dp * m))
    batch = [Sequence(i, n, sens) for i, n in enumerate(lengths)]
    lbb = make_batching("karmarkar_karp", {"equal_count": True})
    sab = oracle_planner(make_batching("sab", {"pipeline_order": "packed"}), make_sparsity(*DENSE), batch, layout, cost)
    ordered = oracle_planner(make_batching("sab", {}), make_sparsity(*DENSE), batch, layout, cost)
    for step in range(2):  # the second step plans with the learned (dense) budgets
        expected = lbb.plan(requests(batch), layout, cost, step, oracle(batch))
        assert placement(planned_step(sab, engine, batch, step)) == placement(expected)
        # Ordering micro-batches for the pipeline moves whole micro-batches, never sequences between them.
        assert micro_batch_sets(planned_step(ordered, engine, batch, step)) == micro_batch_sets(expected)


def micro_batch_sets(plan):
    groups = {}
    for a in plan.assignments:
        groups.setdefault((a.dp_rank, a.micro_batch), set()).add(a.seq_id)
    return sorted((rank, sorted(ids)) for (rank, _), ids in groups.items())


def test_pipeline_order_never_slows_a_rank(cost):
    cfg = compose_config(pinned(["+experiment=paper"]))
    workload = Workload(cfg.workload, cfg.model.max_context, 0)
    layout = Layout(dp=2, pp=4, micro_batches=4)
    engine = Engine(layout, cost, Cluster.from_config(cfg.cluster))
    packed, ordered = (make_batching("sab", {"pipeline_order": o}) for o in ("packed", "search"))
    for step in range(10):
        batch = workload.batch(step)
        finish = [engine.step(s.plan(requests(batch), layout, cost, step, oracle(batch)), truth_of(batch))
                  .timeline.finish_ms.max(axis=1) for s in (packed, ordered)]
        assert (finish[1] <= finish[0] * (1 + 1e-12)).all()


def test_expected_budgets_follow_the_paired_policy(cost, cluster):
    layout = Layout(dp=2, pp=4, micro_batches=4)
    cfg = compose_config(pinned(["+experiment=paper"]))
    workload = Workload(cfg.workload, cfg.model.max_context, 0)
    sab = make_batching("sab", {"ema": 1.0})
    planner = oracle_planner(sab, make_sparsity(*DST), workload, layout, cost)
    tuned = planned_step(planner, Engine(layout, cost, cluster), workload.batch(0), 0)
    lengths = np.array([a.length for a in tuned.assignments])
    p = np.array([a.budget.p for a in tuned.assignments])
    buckets = sab.bucket(lengths)
    for b in np.unique(buckets):  # ema = 1: the newest step's per-bucket mean budget
        assert sab.expected_p[int(b)] == pytest.approx(p[buckets == b].mean())


def test_ema_blends_steps_and_unseen_buckets_take_the_mean(cost):
    sab = make_batching("sab", {"ema": 0.25, "prior_p": 0.7})
    assert sab.expected(np.array([4096])).tolist() == [0.7]
    batch = [Sequence(0, 4096, 0.5)]
    plan = make_batching("karmarkar_karp", {}).plan(requests(batch), Layout(dp=1), cost, 0, oracle(batch))
    for p in (0.9, 0.5):  # SAB learns from the budgets of the plan that ran, not from what the step reported
        sab.observe(Observation(plan.with_budgets({0: Budget(p=p)}), np.array([p]), np.array([p]), 1.0))
    assert sab.expected(np.array([4096, 300])) == pytest.approx([0.8, 0.8])  # 0.9 + 0.25 (0.5 - 0.9)


def test_same_seed_same_plans_and_batches_stay_whole(cost, cluster):
    cfg = compose_config(pinned(["+experiment=paper"]))
    workload = Workload(cfg.workload, cfg.model.max_context, 0)
    layout = Layout(dp=2, pp=4, micro_batches=4)
    engine = Engine(layout, cost, cluster)
    policy = load_policy("sparsebalance")
    runs = []
    for _ in range(2):  # fresh policies replay the same state (the EMA) and so the same Plans
        sab = make_batching("sab", policy.batching.params)
        dst = make_sparsity(policy.sparsity.name, policy.sparsity.params)
        planner = oracle_planner(sab, dst, workload, layout, cost)
        runs.append([planned_step(planner, engine, workload.batch(step), step).to_json() for step in range(5)])
    assert runs[0] == runs[1]
    for step in range(5):  # only this step's sequences, eight per rank (the fit varies micro-batch sizes)
        batch = workload.batch(step)
        plan = make_batching("sab", policy.batching.params).plan(requests(batch), layout, cost, step, oracle(batch))
        assert sorted(a.seq_id for a in plan.assignments) == [s.id for s in workload.batch(step)]
        counts = np.bincount([a.dp_rank for a in plan.assignments], minlength=2)
        assert (counts == 8).all()


@pytest.mark.parametrize("params", [{"ema": 0.0}, {"buckets_per_octave": 0}, {"prior_p": 1.5},
                                    {"nope": 1}])
def test_bad_params_are_a_config_error(params):
    with pytest.raises(ConfigError):
        make_batching("sab", params)
