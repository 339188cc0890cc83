"""Dense attention backends in the cost model (sim.backends, cost.attention_backend), the verl_dense policy and
the break-even table, on a fixture profile whose dense terms are made up (tests/fixtures/README.md)."""
import copy
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from pinned import BACKENDS_PROFILE, PINNED_PROFILE
from sparsebalance.sim.backends import choose
from sparsebalance.sim.breakeven import ALWAYS, NEVER, break_even, table
from sparsebalance.sim.breakeven import main as breakeven_main
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.compare import default_lists
from sparsebalance.sim.config import AttentionBackend, compose_config, policy_cost
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import _head_pair_flops, dense_features, make_cost
from sparsebalance.sim.profile import load_profile, profile_problem
from sparsebalance.sim.run import simulate
from sparsebalance.sim.setup import load_policy

LENGTHS = np.array([1024, 8192, 32768, 32768, 4096, 4096, 2048])
KEPT = np.array([1.0, 0.5, 0.9, 0.1, 0.3, 1.0, 0.05])


def cost_for(mode="ours", profile=BACKENDS_PROFILE, *overrides, recompute=True):
    cfg = OmegaConf.to_object(compose_config([f"cost.profile={profile}", f"cost.attention_backend={mode}",
                                              *overrides]))
    return make_cost(cfg.cost, cfg.model, Cluster.from_config(cfg.cluster), recompute=recompute)


def costs(cost, layout=Layout(dp=8), group=None):
    group = np.arange(LENGTHS.size) if group is None else group
    return cost.micro_batch_costs(LENGTHS, KEPT, group, int(group.max()) + 1, layout)


def test_ours_is_unchanged_by_dense_terms_in_the_profile():
    plain, with_dense = costs(cost_for(profile=PINNED_PROFILE)), costs(cost_for())
    for field in ("fwd_ms", "bwd_ms", "attn_fwd_ms", "attn_bwd_ms", "select_ms", "tokens"):
        np.testing.assert_array_equal(getattr(plain, field), getattr(with_dense, field))
    assert not with_dense.dense.any() and with_dense[0].dense is False


def test_dense_best_prices_every_micro_batch_dense_on_its_fastest_backend():
    cost = cost_for("dense_best")
    mb = costs(cost)
    assert mb.dense.all() and mb[1].dense is True
    assert (mb.select_ms == 0).all()
    terms = load_profile(str(BACKENDS_PROFILE))["backends"]
    layers = cost.model.layers
    for i, length in enumerate(LENGTHS):
        feats = dense_features([length], cost.model, cost.block_size)
        nb = -(-length // cost.block_size)
        assert feats["flops"] == pytest.approx(nb * (nb + 1) / 2 * cost.model.heads
                                               * _head_pair_flops(cost.model, cost.block_size))
        by_backend = {name: [sum(c * feats[f] for f, c in t[term].items()) for term in ("attn_fwd", "attn_bwd")]
                      for name, t in ((n, e["terms"]) for n, e in terms.items())}
        name = min(by_backend, key=lambda n: by_backend[n][0] * 2 + by_backend[n][1])  # recompute: forward twice
        best = by_backend[name]
        assert mb.attn_fwd_ms[i] == pytest.approx(layers * best[0])
        assert mb.attn_bwd_ms[i] == pytest.approx(layers * best[1])
        assert mb.backend[i] == name and mb[i].backend == name


def test_hybrid_takes_the_faster_of_ours_and_the_best_dense_per_micro_batch():
    ours, dense, hybrid = (costs(cost_for(mode)) for mode in ("ours", "dense_best", "hybrid"))
    total = {name: c.fwd_ms + c.bwd_ms for name, c in (("ours", ours), ("dense", dense), ("hybrid", hybrid))}
    np.testing.assert_allclose(total["hybrid"], np.minimum(total["ours"], total["dense"]))
    np.testing.assert_array_equal(hybrid.dense, total["dense"] < total["ours"])
    # both kinds occur on this batch: the fixture's dense backends beat ours dense, not ours at kept 0.1
    assert hybrid.dense.any() and not hybrid.dense.all()
    assert hybrid.dense[0] and not hybrid.dense[3]
    # a dense micro-batch runs on the dense backend dense_best picks for it, the others on ours
    np.testing.assert_array_equal(hybrid.backend, np.where(hybrid.dense, dense.backend, "ours"))
    assert (ours.backend == "ours").all()


def test_choose_takes_the_fastest_allowed_option_and_the_first_on_a_tie():
    times = {"ours": np.array([1.0, 5.0, 2.0, 3.0]), "cudnn": np.array([2.0, 4.0, 2.0, 3.0]),
             "fa4": np.array([3.0, 3.0, 2.0, 1.0])}
    assert choose("ours", times).tolist() == ["ours"] * 4
    assert choose("dense_best", times).tolist() == ["cudnn", "fa4", "cudnn", "fa4"]
    assert choose("hybrid", times).tolist() == ["ours", "fa4", "ours", "fa4"]
    assert choose("hybrid", times, ("cudnn", "fa4")).tolist() == ["ours", "fa4", "ours", "fa4"]
    # a sparse option runs only where it beats the fastest dense one by the margin: 1.0 against 2.0 does, a
    # tie (2.0) and 0.98 against 1.0 do not
    near = {"ours": np.array([1.0, 0.98, 0.97, 2.0]), "fa4": np.array([2.0, 1.0, 1.0, 2.0])}
    assert choose("hybrid", near, ("fa4",), 0.03).tolist() == ["ours", "fa4", "ours", "fa4"]
    assert choose("hybrid", near, ("fa4",), 0.0).tolist() == ["ours", "ours", "ours", "ours"]
    with pytest.raises(ValueError, match="no dense backend is priced"):
        choose("dense_best", {"ours": times["ours"]})
    with pytest.raises(ValueError, match="'flash' is unknown; allowed: ours, dense_best, hybrid"):
        choose("flash", times)


@pytest.mark.parametrize("mode", ["ours", "dense_best", "hybrid"])
def test_the_engine_records_which_backend_ran_each_micro_batch(mode):
    small = ["steps=2", "workload.global_batch=8", "layout.micro_batches=1", f"cost.profile={BACKENDS_PROFILE}",
             f"cost.attention_backend={mode}"]
    rows = simulate(compose_config(small)).results.micro_batches().query("tokens > 0")
    ran = set(rows.attention_backend)
    assert ran == {"ours"} if mode == "ours" else ran <= {"ours", "cudnn", "fa4"}
    dense = rows[rows.attention_backend != "ours"]
    assert len(dense) == 0 if mode == "ours" else (dense.kept_fraction == 1.0).all() and (dense.coverage == 1.0).all()
    assert mode != "dense_best" or len(dense) == len(rows)
    assert mode != "hybrid" or 0 < len(dense) < len(rows)


COSTS = {mode: cost_for(mode) for mode in ("ours", "dense_best", "hybrid")}


@settings(max_examples=40)
@given(st.lists(st.tuples(st.integers(1, 40000), st.floats(0.02, 1.0), st.integers(0, 3)), min_size=1, max_size=8),
       st.sampled_from([1, 2, 4]))
def test_hybrid_is_never_slower_than_either_alone(docs, cp):
    lengths = np.array([d[0] for d in docs])
    kept = np.array([d[1] for d in docs])
    group = np.array([d[2] for d in docs])
    layout = Layout(dp=8 // cp, cp=cp)
    total = {mode: (lambda c: c.fwd_ms + c.bwd_ms)(COSTS[mode].micro_batch_costs(lengths, kept, group, 4, layout))
             for mode in COSTS}
    assert (total["hybrid"] <= total["dense_best"] * (1 + 1e-12)).all()
    # where it runs dense, ours was not priced faster by the margin: never slower than ours beyond it
    assert (total["hybrid"] <= total["ours"] / (1 - COSTS["hybrid"].hybrid_margin) * (1 + 1e-12)).all()


@pytest.mark.parametrize("mode", ["dense_best", "hybrid"])
def test_a_dense_mode_without_dense_backends_is_one_config_error(mode):
    with pytest.raises(ConfigError, match=f"cost.attention_backend={mode}: the profile .* prices no dense backend"):
        cost_for(mode, PINNED_PROFILE)
    with pytest.raises(ConfigError, match="cost.name=roofline prices no dense backend"):
        cost_for(mode, PINNED_PROFILE, "cost=roofline")


def test_unknown_attention_backend_is_refused():
    with pytest.raises(Exception, match="attention_backend"):
        compose_config(["cost.attention_backend=flash"])


def _with_backends(**change):
    profile = json.loads(BACKENDS_PROFILE.read_text())
    entry = profile["backends"]["fa4"]
    for key, value in change.items():
        if key == "name":
            profile["backends"][value] = profile["backends"].pop("fa4")
        elif key == "drop_feature":
            del entry["terms"]["attn_fwd"][value]
        else:
            entry[key] = value
    return profile


@pytest.mark.parametrize("change, message", [
    ({"name": "ours"}, "backends.ours: not a peer backend's name"),
    ({"name": "FA 4"}, "backends.FA 4: not a peer backend's name"),
    ({"version": ""}, "backends.fa4.version='': must be a non-empty string"),
    ({"drop_feature": "docs"},
     "backends.fa4.terms.attn_fwd=.* must map exactly the features const, tokens, head_tokens, docs, doc_heads"),
    ({"terms": {"attn_fwd": {}}}, "backends.fa4.terms=.*exactly attn_fwd, attn_bwd"),
])
def test_profile_backends_section_is_checked(change, message):
    assert profile_problem(json.loads(BACKENDS_PROFILE.read_text())) is None
    assert __import__("re").search(message, profile_problem(_with_backends(**change)))


def test_negative_or_non_finite_dense_coefficients_are_refused():
    profile = json.loads(BACKENDS_PROFILE.read_text())
    for bad in (-1e-6, float("nan"), True):
        broken = copy.deepcopy(profile)
        broken["backends"]["cudnn"]["terms"]["attn_bwd"]["flops"] = bad
        assert "backends.cudnn.terms.attn_bwd.flops=" in profile_problem(broken)


def test_profiles_without_backends_still_load():
    assert "backends" not in load_profile(str(PINNED_PROFILE))
    assert cost_for(profile=PINNED_PROFILE).dense_backends() == ()
    assert cost_for().dense_backends() == ("cudnn", "fa4")


def test_verl_dense_trains_dense_on_the_fastest_dense_backend():
    policy = load_policy("verl_dense")
    assert policy.attention_backend == AttentionBackend.dense_best
    assert policy.sparsity.params["p"] == 1.0 and policy.batching.name == "verl"
    cfg = OmegaConf.to_object(compose_config([f"cost.profile={BACKENDS_PROFILE}"]))
    assert policy_cost(cfg.cost, OmegaConf.to_object(policy)).attention_backend == AttentionBackend.dense_best
    assert policy_cost(cfg.cost, OmegaConf.to_object(load_policy("verl"))) is cfg.cost
    small = ["steps=2", "workload.global_batch=8", "layout.micro_batches=1", f"cost.profile={BACKENDS_PROFILE}"]
    dense = simulate(compose_config(small), policy).summary["step_ms"]
    ours_dense = simulate(compose_config(small), OmegaConf.merge(policy, {"attention_backend": None}))
    assert dense < ours_dense.summary["step_ms"]  # the fixture's dense backends beat our kernel dense
    with pytest.raises(ConfigError, match="cost.attention_backend=dense_best"):
        simulate(compose_config(["steps=1", "workload.global_batch=8", "layout.micro_batches=1",
                                 f"cost.profile={PINNED_PROFILE}"]), policy)


def test_compare_counts_verl_dense_only_where_the_profile_prices_a_dense_backend():
    policies, baselines, notes = default_lists(compose_config([f"cost.profile={BACKENDS_PROFILE}"]))
    assert "verl_dense" in baselines and "verl_dense" in policies and notes == []
    policies, baselines, notes = default_lists(compose_config([f"cost.profile={PINNED_PROFILE}"]))
    assert "verl_dense" not in baselines + policies
    assert notes == [f"verl_dense: left out, the profile {PINNED_PROFILE} prices no dense attention backend"]


def test_break_even_is_where_ours_costs_what_the_dense_backend_costs():
    cost = cost_for(recompute=False)
    lengths = np.array([8192, 32768, 131072])
    for backend in cost.dense_backends():
        kept = break_even(cost, lengths, backend)
        assert ((kept > 0.2) & (kept < 1.0)).all()  # the fixture's dense backends beat ours dense at these lengths
        at = cost.attention_options(lengths, kept, Layout(dp=1))
        np.testing.assert_allclose(at["ours"], at[backend], rtol=1e-9)
        above = cost.attention_options(lengths, np.minimum(kept + 0.01, 0.999), Layout(dp=1))
        assert (above["ours"] > above[backend]).all()


def test_break_even_table_says_always_and_never(tmp_path):
    frame = table(cost_for(recompute=False), lengths=(1024, 65536))
    assert list(frame.columns) == ["length", "ours vs cudnn", "ours vs fa4", "fastest dense", "dense: cudnn/fa4"]
    assert frame["ours vs fa4"][0] == NEVER  # 1K: ours loses even keeping only the diagonal
    assert frame["fastest dense"].tolist() == frame["ours vs fa4"].tolist()  # fa4 is the faster one here
    fast = json.loads(BACKENDS_PROFILE.read_text())
    for terms in fast["backends"].values():  # dense backends 100x slower: ours wins even dense
        for coefs in terms["terms"].values():
            coefs.update({k: v * 100 for k, v in coefs.items()})
    slow = tmp_path / "slow_backends.json"
    slow.write_text(json.dumps(fast))
    assert (table(cost_for(profile=slow), lengths=(65536,))["ours vs fa4"] == ALWAYS).all()


def test_break_even_command_prints_the_table_and_refuses_a_profile_without_dense_backends(capsys):
    assert breakeven_main([f"cost.profile={BACKENDS_PROFILE}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "ours vs fa4" in lines[1] and lines[2].split()[0] == "1K" and lines[-1].split()[0] == "128K"
    with pytest.raises(SystemExit) as exited:
        breakeven_main([f"cost.profile={PINNED_PROFILE}"])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and stderr.count("\n") == 1 and "prices no dense" in stderr
