"""The GPU kinds of conf/cluster/, read from its YAMLs alone (no Hydra, so that calibration's measuring side can
name its defaults on a machine without it): a new kind is one cluster YAML (and its measured profile)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import yaml

from sparsebalance.sim.core import CONF_DIR, ConfigError


@dataclass(frozen=True)
class GpuKind:
    """What the code needs of a GPU beyond one cluster's run: a cluster YAML of conf/cluster/ that names its ``gpu``
    says it, so that a new GPU kind is one YAML (and its measured profile)."""

    gpu: str
    sm_count: int
    peak_tflops: float
    sparse_peak_tflops: float
    profile: str | None  # its measured cost profile


@functools.cache
def gpu_kinds() -> dict[str, GpuKind]:
    """Every GPU kind of conf/cluster/ by its ``gpu`` name (YAMLs that inherit one, as h200_4nodes does, add none)."""
    kinds = {}
    for path in sorted((CONF_DIR / "cluster").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        if raw.get("gpu") and raw["gpu"] not in kinds:
            kinds[raw["gpu"]] = GpuKind(raw["gpu"], raw["sm_count"], raw["peak_tflops"], raw["sparse_peak_tflops"],
                                        raw.get("profile"))
    return kinds


@functools.cache
def default_kind() -> GpuKind:
    """The GPU kind of the default cluster (conf/config.yaml): what calibrate and runner.compare default to."""
    defaults = yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
    name = next(entry["cluster"] for entry in defaults if isinstance(entry, dict) and "cluster" in entry)
    return gpu_kinds()[yaml.safe_load((CONF_DIR / "cluster" / f"{name}.yaml").read_text())["gpu"]]


def gpu_kind(gpu: str, key: str) -> GpuKind:
    """The kind named ``gpu``, or one ConfigError line naming ``key`` and the kinds conf/cluster/ describes."""
    kinds = gpu_kinds()
    if gpu not in kinds:
        raise ConfigError(f"{key}={gpu!r} is no GPU kind of conf/cluster/; allowed: {', '.join(sorted(kinds))} (a new "
                          "kind is one cluster YAML with gpu, sm_count, peak_tflops, sparse_peak_tflops)")
    return kinds[gpu]
