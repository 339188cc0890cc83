import numpy as np
import pytest
from hypothesis import given, strategies as st
from omegaconf import OmegaConf

from sparsebalance.sim.policy import BATCHING, SPARSITY, make_batching, make_sparsity, register_batching
from sparsebalance.policies.karmarkar_karp import kk_partition, ldm_partition
from sparsebalance.sim.plan import Assignment, Budget, Plan
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.core import CONF_DIR, ConfigError, group_options
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.workload import Workload, requests

from oracle import oracle

costs_strategy = st.lists(st.floats(0.01, 1000.0, allow_nan=False), min_size=1, max_size=200)


@given(costs_strategy, st.integers(1, 16), st.booleans())
def test_partitions_cover_every_item_once(costs, k, equal):
    for parts in (ldm_partition(np.array(costs), k, equal), kk_partition(np.array(costs), k, equal, refine=True)):
        assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(costs)))
        if equal:
            sizes = [len(p) for p in parts]
            assert max(sizes) - min(sizes) <= 1


@pytest.fixture(scope="module")
def setup():
    cfg = compose_config(["cost=roofline", "cluster.nodes=2"])
    cluster = Cluster.from_config(cfg.cluster)
    layout = Layout(dp=16, micro_batches=4, gpus=16)
    cost = make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)
    return Workload(cfg.workload, cfg.model.max_context, 0), layout, cost


@pytest.mark.parametrize("name", sorted(BATCHING))
def test_every_batching_policy_places_every_sequence_once(name, setup):
    workload, layout, cost = setup
    batch = workload.batch(0)
    policy = make_batching(name, {})
    if getattr(policy, "plans_cp_groups", False):  # a dynamic-CP policy plans the dp x cp domain as one
        layout = Layout(dp=1, cp=layout.dp, micro_batches=layout.micro_batches, gpus=layout.gpus, cp_mode="dynamic")
    plan = policy.plan(requests(batch), layout, cost, step=0, belief=oracle(batch))
    assert sorted(a.seq_id for a in plan.assignments) == sorted(s.id for s in batch)
    assert {a.dp_rank for a in plan.assignments} <= set(range(layout.dp))
    assert {a.micro_batch for a in plan.assignments} <= set(range(layout.micro_batches))
    assert plan == type(plan).from_json(plan.to_json())


def test_equal_count_kk_gives_equal_counts(setup):
    workload, layout, cost = setup
    batch = workload.batch(0)
    plan = make_batching("karmarkar_karp", {"equal_count": True}).plan(requests(batch), layout, cost, 0, oracle(batch))
    counts = np.bincount([a.dp_rank for a in plan.assignments], minlength=layout.dp)
    assert (counts == counts[0]).all()


def test_kk_balances_better_than_sequential(setup):
    workload, layout, cost = setup
    batch = workload.batch(0)

    def max_load(name):
        plan = make_batching(name, {}).plan(requests(batch), layout, cost, 0, oracle(batch))
        seqc = cost.sequence_costs([a.length for a in plan.assignments], np.ones(len(plan.assignments)), layout)
        return np.bincount([a.dp_rank for a in plan.assignments], weights=seqc).max()
    assert max_load("karmarkar_karp") < max_load("sequential")


def test_fixed_sets_every_budget(setup):
    workload, layout, cost = setup
    batch = workload.batch(0)
    plan = make_batching("sequential", {}).plan(requests(batch), layout, cost, 0, oracle(batch))
    tuned = make_sparsity("fixed", {"p": 0.8}).tune(plan, layout, cost, oracle(batch))
    assert {a.budget.p for a in tuned.assignments} == {0.8}


@pytest.mark.parametrize("kind,name,params,needle", [
    ("batching", "karmarkar_karp", {"equal_count": "maybe"}, "equal_count"),
    ("batching", "karmarkar_karp", {"typo": 1}, "typo"),
    ("sparsity", "fixed", {"p": 1.5}, "outside the allowed range"),
    ("batching", "nope", {}, "is unknown; allowed: karmarkar_karp, lpt"),
])
def test_policy_params_are_type_checked(kind, name, params, needle):
    make = make_batching if kind == "batching" else make_sparsity
    with pytest.raises(ConfigError, match=needle):
        make(name, params)


# A plans.jsonl line as sim.run wrote it while Assignment still had per-CP-shard budgets and the sequence's
# sensitivity (which plans no longer carry: it is dropped on reading).
EARLIER_PLAN = ('{"assignments":[{"budget":{"kept_fraction":null,"p":0.9},"cp_budgets":[],"dp_rank":0,'
                '"length":4096,"micro_batch":1,"sensitivity":0.5,"seq_id":7}],"dp":1,"micro_batches":2,"step":3}')


def test_plans_of_earlier_versions_stay_readable():
    plan = Plan.from_json(EARLIER_PLAN)
    assert plan == Plan.of(step=3, dp=1, micro_batches=2, assignments=(Assignment(7, 4096, 0, 1, Budget(p=0.9)),))
    assert plan.to_json() == EARLIER_PLAN.replace('"cp_budgets":[],', "").replace('"sensitivity":0.5,', "")
    with pytest.raises(ValueError, match="^assignment of sequence 7 has cp_budgets="):
        Plan.from_json(EARLIER_PLAN.replace('"cp_budgets":[]', '"cp_budgets":[{"kept_fraction":null,"p":0.5}]'))


def test_the_registries_hold_exactly_the_policies_the_presets_name():
    """Every policy a conf/policy preset names is registered under that name, and every registered one is named
    by a preset, so the tests parametrized over the registries and over the presets reach the same policies;
    a class answers to its name, and a name registered twice is refused."""
    named = {"batching": set(), "sparsity": set()}
    for option in group_options("policy"):
        preset = OmegaConf.load(CONF_DIR / "policy" / f"{option}.yaml")
        for kind in named:
            named[kind].add(preset[kind].name)
    assert named == {"batching": set(BATCHING), "sparsity": set(SPARSITY)}
    assert all(cls.name == name for registry in (BATCHING, SPARSITY) for name, cls in registry.items())
    with pytest.raises(ValueError, match="^policy name 'lpt' is registered twice"):
        register_batching("lpt")(type("AnotherLpt", (), {}))
    assert BATCHING["lpt"].__name__ != "AnotherLpt"
