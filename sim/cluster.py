"""Layout (parallel degrees) and the alpha-beta communication model.

Rank placement follows Megatron's order, TP innermost, then CP: global rank =
``tp_rank + tp * (cp_rank + cp * (dp_rank + dp * stage))``, so a stage's dp x cp CP positions are one domain
(domain rank ``cp_rank + cp * dp_rank``, each a group of tp consecutive GPUs). A group whose ranks fit in one node
uses the intra-node tier, otherwise the inter-node tier (the slowest link bounds a ring). Under dynamic CP a group
of c positions starts at a domain rank that c divides (sim.cp_groups), so on nodes of a power-of-two GPU count it
sits in one node exactly when c x tp is at most the node's GPUs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


from sparsebalance.sim.config import ClusterConfig, LayoutConfig, validate
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.gpu_kinds import gpu_kinds


@dataclass(frozen=True)
class Layout:
    dp: int
    cp: int = 1
    pp: int = 1
    micro_batches: int = 1
    gpus: int | None = None  # None: dp * cp * pp * tp
    cp_mode: str = "static"  # dynamic: cp is the largest CP degree of a sequence in the dp x cp domain
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "pp", "micro_batches", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"layout.{name}={value!r} must be a positive integer")
        object.__setattr__(self, "cp_mode", str(getattr(self.cp_mode, "value", self.cp_mode)))
        if self.cp_mode not in ("static", "dynamic"):
            raise ConfigError(f"layout.cp_mode={self.cp_mode!r} is not allowed; allowed: static, dynamic")
        if self.dynamic and self.cp & (self.cp - 1):
            raise ConfigError(f"layout.cp={self.cp} under cp_mode=dynamic must be a power of two (the largest "
                              "of the power-of-two CP degrees a sequence gets)")
        product = self.dp * self.cp * self.pp * self.tp
        if self.gpus is None:
            object.__setattr__(self, "gpus", product)
        elif product != self.gpus:
            tp = f" x tp={self.tp}" if self.tp > 1 else ""
            raise ConfigError(
                f"layout dp={self.dp} x cp={self.cp} x pp={self.pp}{tp} = {product} GPUs, "
                f"but the cluster has {self.gpus}; the product must equal the GPU count"
            )

    @property
    def name(self) -> str:
        """``dp4xcp1xpp4``, with ``xtp2`` where tensor parallelism is on."""
        return f"dp{self.dp}xcp{self.cp}xpp{self.pp}" + (f"xtp{self.tp}" if self.tp > 1 else "")

    @classmethod
    def from_config(cls, cfg: LayoutConfig, gpus: int) -> Layout:
        """The layout for ``gpus`` GPUs; ``dp: null`` takes what cp x pp x tp leave."""
        validate(cfg, "layout.")
        dp = cfg.dp
        if dp is None:
            if gpus % (cfg.cp * cfg.pp * cfg.tp):
                tp, tp_x = (f" x tp={cfg.tp}", " x tp") if cfg.tp > 1 else ("", "")
                raise ConfigError(
                    f"layout cp={cfg.cp} x pp={cfg.pp}{tp} does not divide the cluster's {gpus} GPUs; "
                    f"allowed cp x pp{tp_x}: divisors of {gpus}"
                )
            dp = gpus // (cfg.cp * cfg.pp * cfg.tp)
        return cls(dp=dp, cp=cfg.cp, pp=cfg.pp, micro_batches=cfg.micro_batches, gpus=gpus, cp_mode=cfg.cp_mode,
                   tp=cfg.tp)

    @property
    def dynamic(self) -> bool:
        return self.cp_mode == "dynamic"

    @property
    def domain(self) -> int:
        """GPUs of one pipeline stage: the dp x cp domain."""
        return self.dp * self.cp

    def with_cp(self, cp: int) -> Layout:
        """The static layout of the same domain and stages in which every CP group has ``cp`` ranks (the
        cost model prices a dynamic CP group of that size on it)."""
        return Layout(self.domain // cp, cp, self.pp, self.micro_batches, self.gpus, tp=self.tp)


@dataclass(frozen=True)
class Tier:
    bandwidth_gbps: float  # GB/s per GPU
    latency_us: float

    def transfer_ms(self, nbytes: float) -> float:
        """Point-to-point message: alpha + bytes / beta."""
        return self.latency_us * 1e-3 + nbytes / (self.bandwidth_gbps * 1e6)


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    intra: Tier
    inter: Tier
    peak_tflops: float
    hbm_tbps: float
    grad_bytes: int
    sm_count: int  # streaming multiprocessors per GPU: one wave of a kernel's programs
    grad_bucket_mb: float = 0.0  # MiB per gradient bucket; 0: one all-reduce of the whole stage

    @classmethod
    def from_config(cls, cfg: ClusterConfig) -> Cluster:
        validate(cfg, "cluster.")
        kind = gpu_kinds().get(cfg.gpu)
        if kind is not None and cfg.sparse_peak_tflops != kind.sparse_peak_tflops:
            # profiles are checked against the kinds' YAMLs, before any run's cluster exists
            raise ConfigError(f"cluster.sparse_peak_tflops={cfg.sparse_peak_tflops:g} differs from the {cfg.gpu} "
                              f"kind's {kind.sparse_peak_tflops:g}, which bounds every profile; allowed: "
                              f"{kind.sparse_peak_tflops:g} (another GPU is a cluster YAML of its own)")
        tiers = {name: Tier(getattr(cfg, name).bandwidth_gbps, getattr(cfg, name).latency_us)
                 for name in ("intra", "inter")}
        return cls(cfg.gpus_per_node, tiers["intra"], tiers["inter"], cfg.peak_tflops, cfg.hbm_tbps, cfg.grad_bytes,
                   cfg.sm_count, cfg.grad_bucket_mb)

    @staticmethod
    def gpus(cfg: ClusterConfig) -> int:
        return cfg.nodes * cfg.gpus_per_node

    def tier(self, span: int) -> Tier:
        """The tier of a group whose ranks cover ``span`` consecutive global ranks."""
        return self.intra if span <= self.gpus_per_node else self.inter

    def gather_ms(self, nbytes, n: int, span: int):
        """Ring all-gather (or reduce-scatter) of ``nbytes`` in all over n ranks: n - 1 hops of latency +
        (n - 1)/n * bytes / busbw, half an all-reduce."""
        tier = self.tier(span)
        return (n - 1) * (tier.latency_us * 1e-3 + nbytes / n / (tier.bandwidth_gbps * 1e6))

    def allreduce_ms(self, nbytes: float, n: int, span: int) -> float:
        """Ring all-reduce over n ranks: 2(n-1) hops of latency + 2(n-1)/n * bytes / busbw."""
        if n == 1:
            return 0.0
        tier = self.tier(span)
        return 2 * (n - 1) * tier.latency_us * 1e-3 + 2 * (n - 1) / n * nbytes / (tier.bandwidth_gbps * 1e6)

    def grad_allreduce_ms(self, params_per_stage: float, layout: Layout) -> float:
        """Gradients of one pipeline stage (``params_per_stage``: one TP rank's share), reduced over its dp x cp
        replicas (CP ranks hold the same weights), whose ranks lie tp apart."""
        n = layout.dp * layout.cp
        return self.allreduce_ms(params_per_stage * self.grad_bytes, n, span=n * layout.tp)

    def grad_buckets(self, params_per_stage: float) -> int:
        """How many buckets a stage's gradients are reduced in (DDP: ``bucket_cap_mb`` MiB each)."""
        if self.grad_bucket_mb == 0:
            return 1
        return max(1, math.ceil(params_per_stage * self.grad_bytes / (self.grad_bucket_mb * 2**20)))

    def p2p_ms(self, nbytes: float, layout: Layout) -> float:
        """Activation hand-off between neighbouring pipeline stages (stride dp x cp x tp ranks)."""
        return self.tier(2 * layout.dp * layout.cp * layout.tp).transfer_ms(nbytes)
