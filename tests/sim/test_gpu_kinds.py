"""GPU kinds as data: a cluster YAML of conf/cluster/ says a GPU's multiprocessors and peaks, the cost model's launch
features and the profile check read them there, and a new kind is one YAML."""
import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
from omegaconf import OmegaConf

import sparsebalance.sim.gpu_kinds as kinds_module
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.gpu_kinds import default_kind, gpu_kind, gpu_kinds
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import CONF_DIR, ConfigError, ROOT
from sparsebalance.sim.cost import attention_features, make_cost
from sparsebalance.sim.profile import profile_problem

B200 = """name: b200
gpu: b200
nodes: 1
gpus_per_node: 8
peak_tflops: 2250.0
sparse_peak_tflops: 4500.0
sm_count: 148
hbm_tbps: 8.0
hbm_gb: 180.0
intra: {bandwidth_gbps: 900.0, latency_us: 3.0}
inter: {bandwidth_gbps: 50.0, latency_us: 5.0}
"""


@pytest.fixture
def with_b200(tmp_path, monkeypatch):
    """conf/ with one more cluster YAML, a B200's, as gpu_kinds reads it."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "cluster" / "b200.yaml").write_text(B200)
    monkeypatch.setattr(kinds_module, "CONF_DIR", conf)
    gpu_kinds.cache_clear()
    default_kind.cache_clear()
    yield
    gpu_kinds.cache_clear()
    default_kind.cache_clear()


def b200_profile(tflops: float) -> dict:
    """The H200 profile relabelled for a B200, its forward attention executing ``tflops``."""
    profile = json.loads((ROOT / "calibrate" / "profiles" / "h200.json").read_text())
    profile["gpu"] = "b200"
    profile["terms"]["attn_fwd"]["flops"] = 1 / (tflops * 1e9)
    return profile


def test_the_shipped_kinds_say_their_multiprocessors_and_peaks():
    kinds = gpu_kinds()
    assert set(kinds) == {"h100", "h200"} and default_kind().gpu == "h200"
    assert all(k.sm_count == 132 and k.sparse_peak_tflops == 1979.0 for k in kinds.values())
    with pytest.raises(ConfigError, match=r"gpu='b900' is no GPU kind of conf/cluster/; allowed: h100, h200"):
        gpu_kind("b900", "gpu")


def test_a_new_gpu_kind_is_one_cluster_yaml(with_b200):
    assert gpu_kind("b200", "gpu").sm_count == 148
    assert profile_problem(b200_profile(3000.0)) is None  # faster than any H100/H200, within a B200's peak
    assert "faster than any GPU" in profile_problem(b200_profile(5000.0)) and "4,500" in profile_problem(
        b200_profile(5000.0))


def test_without_that_yaml_its_profile_is_refused_as_faster_than_any_gpu():
    problem = profile_problem(b200_profile(3000.0))
    assert "faster than any GPU" in problem and "1,979 TFLOP/s" in problem


def test_the_launch_waves_follow_the_clusters_sm_count():
    cfg = OmegaConf.to_object(compose_config(["cluster.sm_count=66"]))
    assert Cluster.from_config(cfg.cluster).sm_count == 66
    blocks = attention_features([8192], [1.0], cfg.model, 128, 132)["kv_blocks"]
    for sms in (66, 132):
        assert attention_features([8192], [1.0], cfg.model, 128, sms)["kv_waves"] == np.ceil(blocks / sms)
    times = []
    for sms in (66, 132):
        cluster = replace(Cluster.from_config(cfg.cluster), sm_count=sms)
        cost = make_cost(cfg.cost, cfg.model, cluster, recompute=True)
        assert cost.sm_count == sms
        times.append(cost.micro_batch_cost([65536], [1.0], Layout(dp=1)).bwd_ms)
    assert times[0] > times[1]  # half the multiprocessors: more dK/dV waves
