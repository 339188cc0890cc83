import numpy as np
import pytest

from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.workload import Workload


@pytest.mark.parametrize("kwargs,needle", [
    (dict(dp=0), "layout.dp=0"), (dict(dp=2, cp=-1), "layout.cp=-1"),
    (dict(dp=2, cp=2, gpus=8), "= 4 GPUs, but the cluster has 8"), (dict(dp=2, micro_batches=0), "micro_batches"),
])
def test_layout_rejects_bad_degrees(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        Layout(**kwargs)


def test_layout_fills_dp():
    cfg = compose_config(["layout.cp=2", "layout.pp=2", "cluster.nodes=4"])
    layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
    assert layout == Layout(dp=8, cp=2, pp=2, micro_batches=8, gpus=32)


def test_tiers_follow_placement():
    cluster = Cluster.from_config(compose_config([]).cluster)
    assert cluster.tier(8) is cluster.intra and cluster.tier(16) is cluster.inter
    assert cluster.allreduce_ms(1e9, 1, 1) == 0.0


@pytest.mark.parametrize("workload", ["longtail", "bimodal", "trace"])
def test_workload_is_seeded_and_bounded(workload):
    cfg = compose_config([f"workload={workload}"])
    a, b = (Workload(cfg.workload, cfg.model.max_context, seed=3) for _ in range(2))
    assert a.batch(5) == b.batch(5) and a.batch(5) != a.batch(6)
    lengths = np.array([s.length for s in a.batch(1)])
    assert lengths.max() <= cfg.workload.max_len and lengths.min() >= 1
    assert all(0 < s.sensitivity <= 1 for s in a.batch(1))


def test_longtail_is_mostly_short_with_a_tail():
    cfg = compose_config(["workload.global_batch=4096"])
    lengths = np.array([s.length for s in Workload(cfg.workload, cfg.model.max_context, 0).batch(0)])
    assert np.median(lengths) < 6000 and lengths.max() > 25000
