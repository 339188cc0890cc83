import numpy as np
import pytest
from hypothesis import given, strategies as st

from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.core import ConfigError, write_json_atomic
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.cost import OVERLAP_MAX_PROGRAMS_PER_SM, attention_features, make_cost
from sparsebalance.sim.profile import DKDV_SLOTS, PROFILE_SCHEMA_VERSION, WAVE, load_profile
from sparsebalance.sim.provisional import provisional_profile
from sparsebalance.sim.workload import Sequence


def cost_for(*overrides):
    cfg = compose_config(list(overrides))
    cluster = Cluster.from_config(cfg.cluster)
    return make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)


def test_provisional_profile_reproduces_roofline_when_compute_bound(tmp_path):
    # The committed default is the measured H200 profile; the roofline-derived one is rebuilt here.
    cfg = compose_config(["cost=roofline"])
    path = tmp_path / "provisional.json"
    write_json_atomic(path, provisional_profile(cfg.model, Cluster.from_config(cfg.cluster), cfg.cost, "test"))
    roof, cal = cost_for("cost=roofline"), cost_for("cost=calibrated", f"cost.profile={path}")
    lengths, kept = np.array([4096, 9000, 30000, 700]), np.array([1.0, 0.3, 0.5, 1.0])
    layout = Layout(dp=8)
    a = roof.micro_batch_costs(lengths, kept, np.array([0, 0, 1, 2]), 3, layout)
    b = cal.micro_batch_costs(lengths, kept, np.array([0, 0, 1, 2]), 3, layout)
    np.testing.assert_allclose(a.fwd_ms, b.fwd_ms, rtol=1e-9)
    np.testing.assert_allclose(a.bwd_ms, b.bwd_ms, rtol=1e-9)


def test_attention_is_proportional_to_kept_blocks_and_layers_to_tokens():
    cost = cost_for("cost=roofline")
    layout = Layout(dp=8)
    dense = cost.micro_batch_cost([8192], [1.0], layout)
    half = cost.micro_batch_cost([8192], [0.5], layout)
    assert half.attn_fwd_ms == pytest.approx(dense.attn_fwd_ms / 2)
    assert half.other_fwd_ms == dense.other_fwd_ms and half.select_ms > 0 == dense.select_ms
    two = cost.micro_batch_cost([8192, 8192], [1.0, 1.0], layout)
    assert two.other_fwd_ms == pytest.approx(2 * dense.other_fwd_ms)


def test_cp_splits_work_and_overlaps_the_ring():
    """Under CP each rank does 1/cp of a long dense sequence's attention and other work; the ring passes K and V
    shards (forward) and them plus their gradients (backward) over cp - 1 hops, and a layer pays the larger of
    its attention and its transfer: a long sequence hides the ring, a short one waits for it. Activation
    checkpointing adds the forward, ring wait included, to the backward."""
    cfg = compose_config(["cost=roofline"])
    cluster, model, cp = Cluster.from_config(cfg.cluster), cfg.model, 4
    cost, recomputing = (make_cost(cfg.cost, model, cluster, recompute=r) for r in (False, True))
    tier = cluster.tier(cp)

    def ring_ms(length, shards):  # all layers, one direction: K and V (and their gradients) in bf16
        shard_bytes = length / cp * model.kv_heads * model.head_dim * 2 * 2
        return model.layers * (cp - 1) * (tier.latency_us * 1e-3 + shards * shard_bytes / (tier.bandwidth_gbps * 1e6))

    one = cost.micro_batch_cost([32768], [1.0], Layout(dp=1, cp=1))
    long = cost.micro_batch_cost([32768], [1.0], Layout(dp=1, cp=cp))
    for part in ("attn_fwd_ms", "attn_bwd_ms", "other_fwd_ms", "other_bwd_ms"):
        assert getattr(long, part) == pytest.approx(getattr(one, part) / cp), part
    assert one.cp_comm_ms == 0 and long.cp_comm_ms == pytest.approx(ring_ms(32768, 1) + ring_ms(32768, 2))
    assert long.attn_fwd_ms > ring_ms(32768, 1) and long.attn_bwd_ms > ring_ms(32768, 2)
    assert long.fwd_ms == pytest.approx(long.attn_fwd_ms + long.other_fwd_ms)  # the ring costs nothing
    assert long.bwd_ms == pytest.approx(long.attn_bwd_ms + long.other_bwd_ms)
    short = cost.micro_batch_cost([512], [1.0], Layout(dp=1, cp=cp))
    assert short.attn_fwd_ms < ring_ms(512, 1) and short.attn_bwd_ms < ring_ms(512, 2)
    assert short.fwd_ms == pytest.approx(ring_ms(512, 1) + short.other_fwd_ms)  # attention waits for the ring
    assert short.bwd_ms == pytest.approx(ring_ms(512, 2) + short.other_bwd_ms)
    for length, plain in ((32768, long), (512, short)):
        again = recomputing.micro_batch_cost([length], [1.0], Layout(dp=1, cp=cp))
        assert again.fwd_ms == pytest.approx(plain.fwd_ms)
        assert again.bwd_ms == pytest.approx(plain.bwd_ms + plain.fwd_ms)


def test_features_count_causal_blocks():
    cfg = compose_config([])
    feats = attention_features([256, 128], [1.0, 1.0], cfg.model, 128)
    assert feats["blocks"] == (3 + 1) * cfg.model.heads and feats["const"] == 1.0


def test_launch_features_follow_the_kernels_grids():
    """The longest programs of a dense and of a diagonal-only sequence (64 blocks of 128), the dK/dV waves, and
    dQ's path only where it runs before dK/dV (not beside it on the side stream)."""
    model = compose_config([]).model
    hpf, group = 4.0 * 128 * 128 * model.head_dim, model.heads // model.kv_heads
    dense = attention_features([8192], [1.0], model, 128)
    assert dense["fwd_path"] == pytest.approx(64 * hpf)  # the last row's 64 blocks, 128-row tiles
    assert dense["dkdv_path"] == pytest.approx(max(group * 64 * hpf, 2 * dense["flops"] / DKDV_SLOTS))
    assert dense["kv_waves"] == np.ceil(64 * model.kv_heads * 2 / WAVE) and dense["dq_path"] == 0.0
    diagonal = attention_features([8192], [2 / 65], model, 128)
    assert diagonal["fwd_path"] == pytest.approx(hpf / 2)  # one block, 64-row tiles
    assert diagonal["dkdv_path"] == pytest.approx(max(group * hpf, 2 * diagonal["flops"] / DKDV_SLOTS))
    assert diagonal["dq_path"] == 0.0  # 256 dK/dV programs: dQ runs beside them
    long = attention_features([131072], [0.1], model, 128)
    assert long["kv_blocks"] > OVERLAP_MAX_PROGRAMS_PER_SM * WAVE  # so dQ runs before dK/dV
    assert long["dq_path"] == long["fwd_path"] > 0.0
    paths = [attention_features([8192], [kf], model, 128) for kf in np.linspace(2 / 65, 1.0, 40)]
    for key in ("fwd_path", "dkdv_path"):
        assert all(a[key] <= b[key] * (1 + 1e-12) for a, b in zip(paths, paths[1:], strict=False)), key


ROOFLINE = cost_for("cost=roofline")


@given(st.integers(1, 131072), st.floats(0.01, 1.0), st.floats(0.01, 1.0))
def test_coverage_model(length, s, p):
    cost = ROOFLINE
    seq = Sequence(0, length, s)
    kf = cost.kept_fraction(seq, p)
    assert 0 < kf <= 1 and kf >= 2 / (np.ceil(length / 128) + 1) - 1e-12
    assert cost.coverage(seq, kf) >= min(p, 1.0) - 1e-9  # the diagonal floor only adds coverage
    assert cost.coverage(seq, 1.0) == 1.0


def test_load_profile_rejects_wrong_terms(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(f'{{"schema_version": {PROFILE_SCHEMA_VERSION}, "gpu": "x", "provisional": true, "meta": {{}}, '
                   '"block_size": 64, "terms": {}}')
    with pytest.raises(ConfigError, match="terms must be exactly"):
        load_profile(str(bad))
