"""The cluster names its measured profile: cost=calibrated prices on it unless cost.profile names another of the
same GPU; a profile of another GPU is refused in one line; the summary records the profile's path and hash."""
import hashlib

import pytest
from omegaconf import OmegaConf
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import ConfigError, resolve_path
from sparsebalance.sim.run import simulate
from sparsebalance.sim.setup import prepare


def config(*overrides):
    return OmegaConf.to_object(compose_config(list(overrides)))


@pytest.mark.parametrize("cluster, profile", [("h100", "calibrate/profiles/h100.json"),
                                              ("h200", "calibrate/profiles/h200.json"),
                                              ("h200_4nodes", "calibrate/profiles/h200.json")])
def test_a_cluster_prices_on_its_own_measured_profile(cluster, profile):
    cfg = config(f"cluster={cluster}", "layout.micro_batches=2")
    assert cfg.cost.profile == profile
    assert prepare(cfg).cost.profile["gpu"] == cfg.cluster.gpu


def test_a_profile_of_another_gpu_is_refused_in_one_line():
    cfg = config("cluster=h100", "cost.profile=calibrate/profiles/h200.json")
    with pytest.raises(ConfigError) as error:
        prepare(cfg)
    assert str(error.value) == ("cost.profile='calibrate/profiles/h200.json' was measured on h200, but cluster=h100 "
                                "is h100; allowed: a profile of h100 (the cluster's own: calibrate/profiles/h100.json)")


def test_the_summary_records_the_profile_and_its_hash():
    summary = simulate(config("cluster=h100", "steps=1", "workload.global_batch=16", "layout.micro_batches=2",
                              "baseline=null")).summary
    digest = hashlib.sha256(resolve_path("calibrate/profiles/h100.json").read_bytes()).hexdigest()
    assert (summary["profile"], summary["profile_sha256"]) == ("calibrate/profiles/h100.json", digest)
    roofline = simulate(config("cost=roofline", "steps=1", "workload.global_batch=16", "layout.micro_batches=2",
                               "baseline=null")).summary
    assert (roofline["profile"], roofline["profile_sha256"]) == (None, None)
