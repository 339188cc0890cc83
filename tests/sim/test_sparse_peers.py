"""Sparse peers in the cost model (sim.backends, ``"sparse": true``): a peer that computes the blocks our selection
keeps with its own kernels, priced by a fixture profile whose sparse peer is made up (tests/fixtures/README.md)."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from pinned import BACKENDS_PROFILE, SPARSE_PEER_PROFILE
from sparsebalance.sim.backends import DENSE_FEATURES
from sparsebalance.sim.breakeven import main as breakeven_main
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import _head_pair_flops, attention_features, make_cost, sparse_features
from sparsebalance.sim.profile import load_profile, profile_problem
from sparsebalance.sim.run import simulate

PEER = "fa4_sparse"
# each document alone in a micro-batch: near dense (fa4), moderately sparse (the peer), sparsest (ours)
LENGTHS = np.array([32768, 32768, 32768, 8192, 1024, 30000])
KEPT = np.array([1.0, 0.5, 0.05, 0.3, 1.0, 0.4])
TERMS = load_profile(str(SPARSE_PEER_PROFILE))["backends"][PEER]["terms"]
# a stated prior under which the planned choice uses ours, the sparse peer and dense FA4 on 3 small steps
SPARSE_PRIOR = ("policy.prior.mean=0.3", "policy.prior.spread=0.2")


def cost_for(mode, profile=SPARSE_PEER_PROFILE, recompute=True):
    cfg = OmegaConf.to_object(compose_config([f"cost.profile={profile}", f"cost.attention_backend={mode}"]))
    return make_cost(cfg.cost, cfg.model, Cluster.from_config(cfg.cluster), recompute=recompute)


def costs(cost, lengths=LENGTHS, kept=KEPT, group=None, n_groups=None, layout=Layout(dp=8)):
    group = np.arange(len(lengths)) if group is None else group
    return cost.micro_batch_costs(lengths, kept, group, n_groups or int(group.max()) + 1, layout)


def priced(term, feats):
    return sum(c * feats[f] for f, c in TERMS[term].items())


def layers_priced(cost, term, i):
    """Sequence i alone on the sparse peer: its ``term`` over the model's layers."""
    return cost.model.layers * priced(term, sparse_features(LENGTHS[i:i + 1], KEPT[i:i + 1], cost.model, 128))


def test_hybrid_runs_each_micro_batch_on_its_cheapest_option_the_sparse_peer_included():
    cost = cost_for("hybrid")
    mb = costs(cost)
    assert mb.backend.tolist() == ["fa4", PEER, "ours", "ours", "fa4", PEER]
    options = cost.attention_options(LENGTHS, KEPT, Layout(dp=8))
    assert list(options) == ["ours", "cudnn", "fa4", PEER]
    assert mb.backend.tolist() == [min(options, key=lambda name: options[name][i]) for i in range(LENGTHS.size)]


def test_a_micro_batch_on_the_sparse_peer_keeps_its_budget_and_pays_our_selection():
    hybrid, ours = costs(cost_for("hybrid")), costs(cost_for("ours"))
    on_peer = hybrid.backend == PEER
    np.testing.assert_array_equal(hybrid.dense, np.isin(hybrid.backend, ["cudnn", "fa4"]))
    assert hybrid[1].backend == PEER and hybrid[1].dense is False
    np.testing.assert_array_equal(hybrid.select_ms[on_peer], ours.select_ms[on_peer])
    assert (hybrid.select_ms[on_peer] > 0).all()
    for i in np.flatnonzero(on_peer):
        assert hybrid.attn_fwd_ms[i] == pytest.approx(layers_priced(cost_for("hybrid"), "attn_fwd", i))
        assert hybrid.attn_bwd_ms[i] == pytest.approx(layers_priced(cost_for("hybrid"), "attn_bwd", i))
    # the other layers' work is the same whichever kernel runs attention
    np.testing.assert_array_equal(hybrid.other_fwd_ms, ours.other_fwd_ms)


def test_sparse_features_pad_each_document_to_whole_blocks_and_count_the_kept_flops():
    model = cost_for("ours").model
    feats = sparse_features([1000, 129, 128], [0.5, 1.0, 1.0], model, 128)
    assert set(feats) == set(DENSE_FEATURES)
    assert feats["tokens"] == 1024 + 256 + 128
    assert feats["head_tokens"] == feats["tokens"] * (model.heads + model.kv_heads)
    assert (feats["const"], feats["docs"], feats["doc_heads"]) == (1.0, 3.0, 3.0 * model.heads)
    assert feats["flops"] == pytest.approx(attention_features([1000, 129, 128], [0.5, 1.0, 1.0], model, 128,
                                                         cost_for("ours").sm_count)["flops"])
    assert feats["flops"] == pytest.approx((0.5 * 36 + 3 + 1) * model.heads * _head_pair_flops(model, 128))


@pytest.mark.parametrize("mode", ["ours", "dense_best"])
def test_ours_and_dense_best_never_run_the_sparse_peer_and_price_as_without_it(mode):
    with_peer, without = costs(cost_for(mode)), costs(cost_for(mode, BACKENDS_PROFILE))
    for name in ("fwd_ms", "bwd_ms", "attn_fwd_ms", "attn_bwd_ms", "select_ms", "dense", "backend"):
        np.testing.assert_array_equal(getattr(with_peer, name), getattr(without, name))
    assert PEER not in with_peer.backend


COSTS = {(mode, profile): cost_for(mode, profile) for mode in ("ours", "dense_best", "hybrid")
         for profile in (BACKENDS_PROFILE, SPARSE_PEER_PROFILE)}


@settings(max_examples=40)
@given(st.lists(st.tuples(st.integers(1, 40000), st.floats(0.02, 1.0), st.integers(0, 3)), min_size=1, max_size=8),
       st.sampled_from([1, 2, 4]))
def test_a_sparse_peer_only_ever_makes_hybrid_faster(docs, cp):
    lengths, kept, group = (np.array([d[i] for d in docs]) for i in range(3))
    layout = Layout(dp=8 // cp, cp=cp)
    total = {key: (lambda c: c.fwd_ms + c.bwd_ms)(cost.micro_batch_costs(lengths, kept, group, 4, layout))
             for key, cost in COSTS.items()}
    hybrid = total["hybrid", SPARSE_PEER_PROFILE]
    assert (hybrid <= total["hybrid", BACKENDS_PROFILE] * (1 + 1e-12)).all()
    assert (hybrid <= total["dense_best", SPARSE_PEER_PROFILE] * (1 + 1e-12)).all()
    # dense where a sparse option is not priced faster by the margin: never slower than ours beyond it
    margin = COSTS["hybrid", SPARSE_PEER_PROFILE].hybrid_margin
    assert margin > 0
    assert (hybrid <= total["ours", SPARSE_PEER_PROFILE] / (1 - margin) * (1 + 1e-12)).all()


def test_break_even_options_price_the_sparse_peer_at_each_sequences_kept_fraction():
    cost = cost_for("hybrid", recompute=False)
    lengths = np.array([8192, 8192, 32768])
    low, high = (cost.attention_options(lengths, np.full(3, kf), Layout(dp=1)) for kf in (0.2, 0.8))
    assert (low[PEER] < high[PEER]).all() and (low["fa4"] == high["fa4"]).all()
    for i, n in enumerate(lengths):
        feats = sparse_features([n], [0.2], cost.model, cost.block_size)
        select = cost.micro_batch_cost([n], [0.2], Layout(dp=1)).select_ms / cost.model.layers
        assert select > 0
        assert low[PEER][i] == pytest.approx(priced("attn_fwd", feats) + priced("attn_bwd", feats) + select)


def test_break_even_table_adds_the_sparse_peers_columns_and_the_best_sparse_option():
    from sparsebalance.sim.breakeven import break_even, table

    cost = cost_for("ours", recompute=False)
    frame = table(cost, lengths=(8192, 32768, 131072))
    assert list(frame.columns) == ["length", "ours vs cudnn", "ours vs fa4", "fastest dense", "dense: cudnn/fa4",
                                   f"{PEER} vs cudnn", f"{PEER} vs fa4", f"{PEER}: fastest dense",
                                   "best sparse: fastest dense"]
    best = np.maximum(frame["fastest dense"], frame[f"{PEER}: fastest dense"])
    np.testing.assert_array_equal(frame["best sparse: fastest dense"], best)
    # the fixture's peer never pays at 8K, and pays from higher kept fractions than ours at 32K and 128K
    assert frame[f"{PEER}: fastest dense"][0] == 0.0
    assert frame["best sparse: fastest dense"][0] == frame["fastest dense"][0]
    assert (frame[f"{PEER}: fastest dense"][1:] > frame["fastest dense"][1:]).all()
    lengths = np.array([32768, 131072])
    kept = break_even(cost, lengths, "fa4", PEER)
    at = cost.attention_options(lengths, kept, Layout(dp=1))
    np.testing.assert_allclose(at[PEER], at["fa4"], rtol=1e-9)  # where the peer costs what dense FA4 costs


def test_the_engine_keeps_the_budget_on_the_sparse_peers_micro_batches():
    small = ["steps=3", "workload.global_batch=8", "layout.micro_batches=1", f"cost.profile={SPARSE_PEER_PROFILE}",
             "cost.attention_backend=hybrid", "policy=sparsebalance_topk", *SPARSE_PRIOR]
    rows = simulate(compose_config(small)).results.micro_batches().query("tokens > 0")
    assert set(rows.attention_backend) == {"ours", "fa4", PEER}
    peer, dense = rows[rows.attention_backend == PEER], rows[rows.attention_backend == "fa4"]
    assert (peer.kept_fraction < 1.0).all() and (peer.coverage < 1.0).all()
    assert (dense.kept_fraction == 1.0).all() and (dense.coverage == 1.0).all()


def test_hybrid_with_only_a_sparse_peer_is_priced_and_dense_best_is_refused(tmp_path):
    profile = json.loads(SPARSE_PEER_PROFILE.read_text())
    profile["backends"] = {PEER: profile["backends"][PEER]}
    path = tmp_path / "sparse_only.json"
    path.write_text(json.dumps(profile))
    cost = cost_for("hybrid", path)
    assert cost.dense_backends() == () and cost.sparse_backends() == (PEER,)
    assert set(costs(cost).backend) == {"ours", PEER}
    with pytest.raises(ConfigError, match=f"cost.attention_backend=dense_best: the profile {path} prices no dense "
                                          "backend; allowed: ours, or"):
        cost_for("dense_best", path)


@pytest.mark.parametrize("value, ok", [(True, True), (False, True), ("true", False), (1, False), (None, False)])
def test_the_sparse_flag_is_true_or_false(value, ok):
    profile = json.loads(SPARSE_PEER_PROFILE.read_text())
    profile["backends"][PEER]["sparse"] = value
    problem = profile_problem(profile)
    assert problem is None if ok else problem == (
        f"backends.{PEER}.sparse={value!r}: must be true (a sparse peer) or false (dense; the default where the key "
        "is missing)")


def test_a_profile_with_a_malformed_sparse_flag_is_one_line(tmp_path, capsys):
    profile = json.loads(SPARSE_PEER_PROFILE.read_text())
    profile["backends"][PEER]["sparse"] = "yes"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(SystemExit) as exited:
        breakeven_main([f"cost.profile={path}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert f"backends.{PEER}.sparse='yes': must be true (a sparse peer) or false" in err and str(path) in err


def test_a_replay_prices_the_backend_each_micro_batch_ran_whatever_the_mode_would_choose():
    """runner.compare replays a run on what ran: hybrid chose from the kept fractions its plan expected, so at the
    ones realised the mode's choice may differ, and the time model is tested on the backend that ran."""
    ran = np.array(["ours", "ours", PEER, "cudnn", PEER, "fa4"])
    by_mode = {mode: costs(cost_for(mode)) for mode in ("ours", "hybrid")}
    on_peer = by_mode["hybrid"].backend == PEER  # micro-batches 1 and 5 in the test above
    for mode in ("ours", "dense_best", "hybrid"):
        cost = cost_for(mode)
        replayed = cost.micro_batch_costs(LENGTHS, KEPT, np.arange(LENGTHS.size), LENGTHS.size, Layout(dp=8), ran=ran)
        assert replayed.backend.tolist() == ran.tolist()
        np.testing.assert_array_equal(replayed.dense, np.isin(ran, ["cudnn", "fa4"]))
        np.testing.assert_allclose(replayed.fwd_ms[:2], by_mode["ours"].fwd_ms[:2])
        np.testing.assert_allclose(replayed.attn_fwd_ms[2], layers_priced(cost, "attn_fwd", 2))
        assert not np.allclose(replayed.fwd_ms[on_peer], by_mode["hybrid"].fwd_ms[on_peer])  # not hybrid's choice


def test_a_replay_of_a_backend_the_profile_does_not_price_is_one_config_error():
    ran = np.array(["ours", PEER, "ours", "ours", "ours", "ours"])
    with pytest.raises(ConfigError, match=f"a micro-batch ran its attention on {PEER}, which the cost profile does "
                                          "not price; allowed: ours, cudnn, fa4 "):
        cost_for("hybrid", BACKENDS_PROFILE).micro_batch_costs(LENGTHS, KEPT, np.arange(LENGTHS.size), LENGTHS.size,
                                                               Layout(dp=8), ran=ran)


def test_a_micro_batch_on_the_sparse_peer_holds_its_padded_copies_for_each_layer():
    """fa4_sparse runs on the documents padded to whole blocks and FlexAttention keeps its own copies of q, k, v,
    the output (bf16) and the log-sum-exp (fp32) for the backward: per padded token and layer, beside ours' bytes.
    On an H100 the runner measured 9.9-10.2 KB per token and layer above ours for qwen2.5-3b, this 9.3 KB."""
    from sparsebalance.sim.memory import MemoryModel, sparse_peer_bytes

    lengths, kept, group = np.array([1000, 300, 5000]), np.array([0.5, 0.5, 0.5]), np.array([0, 0, 1])
    copies = 9280 * (1024 + 384)  # the first micro-batch's two documents, padded to whole blocks
    for checkpointing in (False, True):
        cfg = OmegaConf.to_object(compose_config(["model=qwen2.5-3b", "layout.dp=1", "layout.micro_batches=2",
                                                  f"memory.activation_checkpointing={str(checkpointing).lower()}"]))
        assert sparse_peer_bytes(cfg.model) == 2 * 2 * (16 + 2) * 128 + 4 * 16 == 9280
        memory = MemoryModel.from_config(cfg, Layout(dp=1, micro_batches=2), block_size=128)
        plain = memory.micro_batch_bytes(lengths, kept, group, 2)
        for on_peer in (None, np.array([False, False])):
            got = memory.micro_batch_bytes(lengths, kept, group, 2, on_sparse_peer=on_peer)
            np.testing.assert_array_equal(got[0], plain[0])
            np.testing.assert_array_equal(got[1], plain[1])
        held, transient = memory.micro_batch_bytes(lengths, kept, group, 2, on_sparse_peer=np.array([True, False]))
        # every layer keeps them; under checkpointing only the layer being recomputed, while its backward runs
        grew = (transient - plain[1]) if checkpointing else (held - plain[0])
        kept_too = (held - plain[0]) if checkpointing else (transient - plain[1])
        np.testing.assert_allclose(grew[:, 0], [copies * (1 if checkpointing else memory.layers), 0.0])
        np.testing.assert_array_equal(kept_too, 0.0)


def test_the_engine_counts_the_sparse_peers_copies_where_it_runs(monkeypatch):
    small = ["steps=3", "workload.global_batch=8", "layout.micro_batches=1", f"cost.profile={SPARSE_PEER_PROFILE}",
             "cost.attention_backend=hybrid", "policy=sparsebalance_topk", *SPARSE_PRIOR]
    with_copies = simulate(compose_config(small)).results.micro_batches().query("tokens > 0")
    monkeypatch.setattr("sparsebalance.sim.memory.sparse_peer_bytes", lambda model: 0.0)
    without = simulate(compose_config(small)).results.micro_batches().query("tokens > 0")
    assert with_copies.attention_backend.tolist() == without.attention_backend.tolist()
    peer = (with_copies.attention_backend == PEER).to_numpy()
    assert peer.any() and (~peer).any()
    grew = with_copies.peak_memory_gb.to_numpy() - without.peak_memory_gb.to_numpy()
    assert (grew[peer] > 0).all() and (grew[~peer] == 0).all()


def test_the_planners_memory_check_counts_the_copies_where_hybrid_would_run_the_sparse_peer():
    from sparsebalance.sim.memory import MemoryModel
    from sparsebalance.sim.plan import Budget, BudgetArrays, Plan

    layout = Layout(dp=1, micro_batches=2)
    plan = Plan(0, 1, 2, [1, 2], [32768, 32768], [0, 0], [0, 1],
                BudgetArrays.of([Budget(kept_fraction=0.5), Budget(kept_fraction=0.05)]))
    by_mode = {}
    for mode in ("hybrid", "ours"):
        cfg = OmegaConf.to_object(compose_config([f"cost.profile={SPARSE_PEER_PROFILE}",
                                                  f"cost.attention_backend={mode}", "layout.dp=1",
                                                  "layout.micro_batches=2"]))
        cost = make_cost(cfg.cost, cfg.model, Cluster.from_config(cfg.cluster), recompute=True)
        by_mode[mode] = MemoryModel.from_config(cfg, layout, cost.block_size).plan_bytes(plan, cost)
        if mode == "hybrid":  # the sparse peer at kept 0.5, ours at 0.05 (the first test's choices)
            chosen = cost.micro_batch_costs(plan.lengths, np.array([0.5, 0.05]), np.array([0, 1]), 2, layout)
            assert chosen.backend.tolist() == [PEER, "ours"]
    grew = (by_mode["hybrid"] - by_mode["ours"])[0, :, 0]
    assert grew[0] > 0 and grew[1] == 0
