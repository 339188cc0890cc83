"""CP cost under a sparse selection: each rank's share of the kept work over the zigzag shards, against a
plain count over rows and chunks, and the cost model priced on the most loaded rank."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pinned import pinned
from sparsebalance.runner.cp import shard_bounds
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.cost import _launch_features, _sequence_attention, attention_features, make_cost
from sparsebalance.sim.profile import ATTENTION_FEATURES
from sparsebalance.sim.cp_shards import distinct_gaps, kept_rows, kept_share_shift, slowest_rank_extra, zigzag_bounds


# ----------------------------------------------------------------------------- a plain count, written apart
def counted_rows(nb: int, kept: float) -> list[float]:
    """Kept blocks per row, ``min(r + 1, max(1, c (r + 1)))``, with ``c`` found by bisection so that the rows
    sum to the kept fraction (at least the diagonal) of the causal blocks."""
    causal = nb * (nb + 1) / 2
    target = min(max(kept, 2 / (nb + 1)) * causal, causal)

    def total(c):
        return sum(min(r + 1, max(1.0, c * (r + 1))) for r in range(nb))

    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < target else (lo, mid)
    c = (lo + hi) / 2
    return [min(r + 1, max(1.0, c * (r + 1))) for r in range(nb)]


def counted_shift(length: int, kept: float, cp: int, block_size: int) -> list[float]:
    """Each rank's kept share minus its dense share, counting every (chunk, row) overlap's tokens: a token
    of row r does the row's kept blocks (dense: r + 1)."""
    nb = -(-length // block_size)
    rows = counted_rows(nb, kept)
    cuts = [j * length // (2 * cp) for j in range(2 * cp + 1)]
    sparse, dense = [0.0] * cp, [0.0] * cp
    for rank in range(cp):
        for chunk in (rank, 2 * cp - 1 - rank):
            for r in range(nb):
                tokens = max(0, min(cuts[chunk + 1], (r + 1) * block_size) - max(cuts[chunk], r * block_size))
                sparse[rank] += tokens * rows[r]
                dense[rank] += tokens * (r + 1)
    return [s / sum(sparse) - d / sum(dense) for s, d in zip(sparse, dense, strict=True)]


# ----------------------------------------------------------------------------- shards and rows
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_chunks_are_the_runners(cp):
    lengths = [1, 5, 63, 130, 333, 4097, 131071]
    bounds = zigzag_bounds(lengths, cp)
    for s, length in enumerate(lengths):
        np.testing.assert_array_equal(bounds[:, s], shard_bounds(length, cp))


@pytest.mark.parametrize("nb", [1, 2, 3, 7, 64, 1024])
@pytest.mark.parametrize("kept", [0.0, 0.01, 0.05, 0.2, 0.5, 0.93, 1.0])
def test_rows_sum_to_the_kept_fraction_and_floor_at_one_block(nb, kept):
    floored, slope = kept_rows(np.array([nb]), np.array([kept]))
    r = np.arange(nb)
    rows = np.where(r < floored[0], 1.0, slope[0] * (r + 1))
    np.testing.assert_allclose(rows, counted_rows(nb, kept), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(rows.sum(), max(kept, 2 / (nb + 1)) * nb * (nb + 1) / 2, rtol=1e-12)
    assert (rows >= 1.0).all() and (rows <= r + 1 + 1e-9).all()


# ----------------------------------------------------------------------------- shares against the count
LENGTHS = [1, 5, 63, 130, 200, 333, 1000, 4097, 12345]  # not multiples of 64; up to 333: < 2 cp blocks at cp 3, 4


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("kept", [0.05, 0.2, 0.5])
def test_shares_sum_to_the_whole_and_match_the_count(length, cp, kept):
    shift = kept_share_shift([length], [kept], cp, 64)[:, 0]
    expected = counted_shift(length, kept, cp, 64)
    np.testing.assert_allclose(shift, expected, rtol=0, atol=1e-12)
    shares = 1 / cp + shift
    assert shares.sum() == pytest.approx(1.0, abs=1e-12) and (shares >= 0).all()
    assert shares.max() - 1 / cp == pytest.approx(max(expected), abs=1e-12)


@pytest.mark.parametrize("length, kept, cp, block, excess, rank", [
    (4096, 0.07, 4, 128, 0.033531594456, 0),  # the first chunk's rank: its floored rows
    (4097, 0.05, 3, 64, 0.041386255690, 0),
    (333, 0.05, 4, 64, 0.009252026593, 2),  # 6 blocks over 8 chunks: the middle rank holds the most rows
    (12345, 0.2, 2, 64, 0.000267552336, 0),  # long: the floor covers few rows, the excess is small
])
def test_the_most_loaded_rank_does_more_than_its_share(length, kept, cp, block, excess, rank):
    shift = kept_share_shift([length], [kept], cp, block)[:, 0]
    assert int(np.argmax(shift)) == rank and shift.max() == pytest.approx(excess, abs=1e-11)


def test_dense_sequences_and_one_rank_shift_nothing():
    lengths, kept = [130, 4097, 333], [1.0, 1.0, 0.3]
    shift = kept_share_shift(lengths, kept, 4, 64)
    assert (shift[:, :2] == 0.0).all() and (shift[:, 2] != 0.0).any()
    assert (kept_share_shift(lengths, [0.1, 0.2, 0.3], 1, 64) == 0.0).all()


def test_pairs_too_close_to_tell_apart_by_key_are_worked_out_one_by_one():
    kept = np.array([0.3, np.nextafter(0.3, 1.0), 0.3])
    assert 4096 + kept[0] == 4096 + kept[1]  # one key for two pairs
    gaps, inverse = distinct_gaps([4096, 4096, 4096], kept, 4, 128)
    for s in range(3):
        np.testing.assert_array_equal(gaps[:, inverse[s]], distinct_gaps([4096], kept[s:s + 1], 4, 128)[0][:, 0])


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(1, 3000), st.floats(0.0, 1.0)), min_size=1, max_size=6),
       st.integers(2, 5), st.sampled_from([16, 64, 128]), st.data())
def test_shares_and_slowest_rank_match_the_count(seqs, cp, block, data):
    lengths = [length for length, _ in seqs]
    kept = [kf for _, kf in seqs]
    shift = kept_share_shift(lengths, kept, cp, block)
    expected = np.array([counted_shift(length, kf, cp, block) for length, kf in seqs]).T
    np.testing.assert_allclose(shift, expected, rtol=0, atol=1e-9)
    np.testing.assert_allclose(shift.sum(axis=0), 0.0, atol=1e-12)
    assert (1 / cp + shift >= -1e-12).all()
    assert (shift[:, np.array(kept) >= 1.0] == 0.0).all()
    group = np.array(data.draw(st.lists(st.integers(0, 2), min_size=len(seqs), max_size=len(seqs))))
    values = np.array(data.draw(st.lists(st.floats(0.0, 1e6), min_size=len(seqs), max_size=len(seqs))))
    extra = slowest_rank_extra(values, lengths, kept, group, 3, cp, block)
    for g in range(3):
        per_rank = [sum(values[s] * expected[i, s] for s in range(len(seqs)) if group[s] == g) for i in range(cp)]
        assert extra[g] == pytest.approx(max(0.0, *per_rank), rel=1e-9, abs=1e-6)


# ----------------------------------------------------------------------------- the cost model
def cost_for(*overrides):
    cfg = compose_config(pinned(list(overrides)))
    return make_cost(cfg.cost, cfg.model, Cluster.from_config(cfg.cluster), recompute=False)


def summed(per_seq, group, n_groups, cp):
    """Every rank 1/cp of every summed feature (one call per non-empty micro-batch)."""
    out = {k: np.bincount(group, weights=per_seq[k], minlength=n_groups) / cp
           for k in ATTENTION_FEATURES + ("pairs",) if k in per_seq}
    out["const"] = np.minimum(out["const"] * cp, 1.0)
    return out


def largest(per_seq, group, n_groups):
    """Each micro-batch's longest row and busiest key block (blocks)."""
    row, busiest = np.zeros(n_groups), np.zeros(n_groups)
    np.maximum.at(row, group, per_seq["row"])
    np.maximum.at(busiest, group, per_seq["busiest"])
    return row, busiest


def balanced_attention(self, per_seq, _summed, groups, cp, lengths, kept):
    """The CP price before the selection's shards were modelled: every rank 1/cp of every feature."""
    group, n_groups = groups.group, groups.n_groups
    return _launch_features(summed(per_seq, group, n_groups, cp), *largest(per_seq, group, n_groups), self.model,
                            self.block_size, cp)


BATCH = dict(lengths=np.array([4097, 130, 333, 20000, 9000, 64]), group=np.array([0, 0, 1, 1, 2, 2]), n_groups=3)


def costs(cost, kept, cp, attention_fn=None):
    if attention_fn is not None:
        cost._attention = attention_fn.__get__(cost)
    return cost.micro_batch_costs(BATCH["lengths"], kept, BATCH["group"], BATCH["n_groups"], Layout(dp=1, cp=cp))


@pytest.mark.parametrize("name", ["roofline", "calibrated"])
@pytest.mark.parametrize("cp, kept", [
    (1, [0.05, 0.3, 0.2, 0.1, 1.0, 0.5]),  # one rank: nothing to shard
    (2, [1.0] * 6), (3, [1.0] * 6), (4, [1.0] * 6),  # dense: zigzag balances it
])
def test_one_rank_and_dense_costs_are_the_balanced_price_exactly(name, cp, kept):
    new = costs(cost_for(f"cost={name}"), kept, cp)
    old = costs(cost_for(f"cost={name}"), kept, cp, balanced_attention)
    for field in new.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(new, field), getattr(old, field), err_msg=field)


def test_sparse_cp_changes_attention_only_and_leaves_dense_micro_batches_alone():
    kept = np.array([0.05, 0.2, 1.0, 1.0, 0.1, 0.3])  # micro-batch 1 is dense
    new = costs(cost_for("cost=calibrated"), kept, 4)
    old = costs(cost_for("cost=calibrated"), kept, 4, balanced_attention)
    for field in ("select_ms", "other_fwd_ms", "other_bwd_ms", "cp_comm_ms", "tokens"):
        np.testing.assert_array_equal(getattr(new, field), getattr(old, field), err_msg=field)
    assert new.attn_fwd_ms[1] == old.attn_fwd_ms[1] and new.fwd_ms[1] == old.fwd_ms[1]
    assert (new.attn_fwd_ms[[0, 2]] > old.attn_fwd_ms[[0, 2]]).all()


@pytest.mark.parametrize("length, kept, cp", [(4096, 0.07, 4), (4097, 0.05, 3), (333, 0.05, 4), (30001, 0.1, 8)])
def test_attention_is_priced_on_the_most_loaded_rank(length, kept, cp):
    cost = cost_for("cost=roofline")
    flops = attention_features([length], [kept], cost.model, cost.block_size)["flops"]
    share = 1 / cp + max(counted_shift(length, kept, cp, cost.block_size))
    per_layer = cost.cfg.launch_ms + flops * share / cost.attn_flops_per_ms
    got = cost.micro_batch_cost([length], [kept], Layout(dp=1, cp=cp))
    assert got.attn_fwd_ms == pytest.approx(cost.model.layers * per_layer, rel=1e-12)


def test_the_slowest_rank_is_the_one_with_the_most_kept_flops():
    """Every rank's features and term times, the ranks differing in kept FLOPs only: the largest time is
    the price, for both directions (the calibrated coefficients are all >= 0)."""
    cost = cost_for("cost=calibrated")
    cp, kept = 4, np.array([0.05, 0.2, 0.08, 0.1, 0.1, 0.3])
    per_seq = _sequence_attention(BATCH["lengths"], kept, cost.model, cost.block_size)
    shift = np.array([counted_shift(int(n), kf, cp, cost.block_size)
                      for n, kf in zip(BATCH["lengths"], kept, strict=True)]).T
    even = summed(per_seq, BATCH["group"], 3, cp)
    got = costs(cost, kept, cp)
    for term, field in (("attn_fwd", "attn_fwd_ms"), ("attn_bwd", "attn_bwd_ms")):
        times = []
        for rank in range(cp):
            flops = np.bincount(BATCH["group"], weights=per_seq["flops"] * (1 / cp + shift[rank]), minlength=3)
            feats = _launch_features({**even, "flops": flops}, *largest(per_seq, BATCH["group"], 3), cost.model,
                                     cost.block_size, cp)
            times.append(cost._term(term, feats))
        np.testing.assert_allclose(getattr(got, field), cost.model.layers * np.max(times, axis=0), rtol=1e-12)


def test_costs_are_deterministic():
    kept = np.array([0.05, 0.2, 0.08, 0.1, 0.1, 0.3])
    a, b = costs(cost_for("cost=calibrated"), kept, 8), costs(cost_for("cost=calibrated"), kept, 8)
    for field in a.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
