"""Structured configs: the typed schema Hydra validates every composed config and override against.

Each dataclass mirrors one config group under ``conf/``; ``register()`` stores the top-level schema in
Hydra's ConfigStore so that ``conf/config.yaml`` can extend it and a mistyped override fails at
composition time instead of deep inside a run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class ConfigError(ValueError):
    """Bad user input; the entry point prints its message as one line and exits non-zero."""


@dataclass
class ModelConfig:
    """Transformer shape; enough to count parameters, FLOPs and KV bytes."""

    name: str = MISSING
    hidden: int = MISSING
    layers: int = MISSING
    heads: int = MISSING
    kv_heads: int = MISSING
    head_dim: int = MISSING
    ffn: int = MISSING
    vocab: int = MISSING
    max_context: int = MISSING


@dataclass
class TierConfig:
    """One interconnect tier of the alpha-beta model: per-GPU bus bandwidth and per-hop latency."""

    bandwidth_gbps: float = MISSING  # GB/s (bytes, not bits)
    latency_us: float = MISSING


@dataclass
class ClusterConfig:
    name: str = MISSING
    nodes: int = 1
    gpus_per_node: int = 8
    peak_tflops: float = MISSING  # dense bf16 tensor-core peak per GPU
    hbm_tbps: float = MISSING  # HBM bandwidth per GPU, TB/s
    intra: TierConfig = field(default_factory=TierConfig)  # inside a node
    inter: TierConfig = field(default_factory=TierConfig)  # between nodes
    grad_bytes: int = 2  # bytes per gradient element in the DP all-reduce


@dataclass
class LayoutConfig:
    """Parallel degrees; ``dp: null`` fills the GPUs left over by cp x pp."""

    dp: Optional[int] = None
    cp: int = 1
    pp: int = 1
    micro_batches: int = 8


class LengthDistribution(str, Enum):
    longtail = "longtail"
    bimodal = "bimodal"
    trace = "trace"


@dataclass
class WorkloadConfig:
    name: str = MISSING
    distribution: LengthDistribution = LengthDistribution.longtail
    global_batch: int = 64  # sequences per optimiser step
    min_len: int = 256
    max_len: int = 32768
    median: float = 4096.0  # longtail: lognormal median
    sigma: float = 1.0  # longtail: lognormal shape
    short_median: float = 2048.0  # bimodal: short mode
    long_median: float = 24576.0  # bimodal: long mode
    long_fraction: float = 0.2  # bimodal: share of long sequences
    trace_path: Optional[str] = None  # trace: CSV or JSONL with a `length` column
    # Sensitivity s in (0, 1] ~ Beta(a, b): the exponent of the coverage power law.
    sensitivity_a: float = 2.0
    sensitivity_b: float = 5.0


@dataclass
class CostConfig:
    name: str = MISSING  # a key of sim.cost.COST_MODELS
    block_size: int = 128  # attention block size (roofline; the calibrated profile carries its own)
    attn_efficiency: float = 0.6  # roofline: share of peak the attention kernel reaches
    matmul_efficiency: float = 0.7  # roofline: share of peak the dense layers reach
    attn_bwd_ratio: float = 2.5  # backward/forward attention FLOPs (5 matmuls vs 2)
    launch_ms: float = 0.0  # roofline: fixed overhead per kernel call
    profile: str = "calibrate/profiles/h200.json"  # calibrated: profile file


@dataclass
class PolicyPart:
    """One half of a policy: a registry name and its parameters (type-checked by the policy's Params)."""

    name: str = MISSING
    params: Dict[str, Any] = field(default_factory=dict)


@dataclass
class PolicyConfig:
    name: str = MISSING
    batching: PolicyPart = field(default_factory=PolicyPart)
    sparsity: PolicyPart = field(default_factory=PolicyPart)


@dataclass
class RunConfig:
    policy: PolicyConfig = MISSING
    cluster: ClusterConfig = MISSING
    model: ModelConfig = MISSING
    workload: WorkloadConfig = MISSING
    cost: CostConfig = MISSING
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    seed: int = 0
    steps: int = 20
    baseline: Optional[str] = "baseline"  # policy (conf/policy/<name>) to compare against; null: none
    write_plans: bool = True
    plot: bool = False  # also draw the run's figures (sim.plot) into <run dir>/figures


def register() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
