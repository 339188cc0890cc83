"""Structured configs: the typed schema Hydra validates every composed config and override against.

Each dataclass mirrors one config group under ``conf/``; ``register()`` stores the top-level schema in
Hydra's ConfigStore so that ``conf/config.yaml`` can extend it and a mistyped override fails at
composition time instead of deep inside a run. Types are OmegaConf's job; ranges are declared beside each
field (``bounded``) and, with the checks that span fields or groups, enforced by ``validate`` on the
composed config, so that every bad value is reported as one line naming its key before anything runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass, replace
from enum import Enum
from typing import Any, Dict, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from sparsebalance.sim.core import CONF_DIR, ConfigError, check_bool_overrides, check_group_overrides, refuse_unread


@dataclass(frozen=True)
class Bound:
    """An interval of allowed values; ``None`` leaves that side open to infinity."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def allows(self, value: float) -> bool:
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


POSITIVE = Bound(0, lo_open=True)
NON_NEGATIVE = Bound(0)
AT_LEAST_ONE = Bound(1)
FRACTION = Bound(0, 1)
OPEN_FRACTION = Bound(0, 1, lo_open=True)  # (0, 1]: a share that cannot be zero


def bounded(default: Any, bound: Bound) -> Any:
    """A dataclass field whose value ``validate`` checks against ``bound``."""
    return field(default=default, metadata={"bound": bound})


def check_value(key: str, value: Any, bound: Optional[Bound] = None) -> None:
    """One field: numbers must be finite and, with a bound, inside it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not allowed; it must be a finite number{f' {bound}' if bound else ''}")
    if bound is not None and not bound.allows(value):
        raise ConfigError(f"{key}={value} is out of range; allowed: {bound}")


def validate(node: Any, prefix: str = "") -> None:
    """Check every numeric field of a config dataclass (recursively) against its bound, then the node's own
    cross-field ``check(prefix)``. Lists of numbers are checked element by element."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_object(node)
    known = {f.name for f in fields(node)}
    # Hydra's ``+key=value`` appends a key the schema lacks, and OmegaConf sets it on the dataclass as an attribute
    unknown = sorted(set(vars(node)) - known)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]} is not a config key; allowed under {prefix.rstrip('.') or 'the top'}: "
                          f"{', '.join(sorted(known))}")
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            validate(value, f"{key}.")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                check_value(f"{key}[{i}]", item, f.metadata.get("bound"))
        elif value is not None:
            check_value(key, value, f.metadata.get("bound"))
    own_check = getattr(node, "check", None)
    if own_check is not None:
        own_check(prefix)


@dataclass
class ModelConfig:
    """Transformer shape; enough to count parameters, FLOPs and KV bytes."""

    name: str = MISSING
    hidden: int = bounded(MISSING, AT_LEAST_ONE)
    layers: int = bounded(MISSING, AT_LEAST_ONE)
    heads: int = bounded(MISSING, AT_LEAST_ONE)
    kv_heads: int = bounded(MISSING, AT_LEAST_ONE)
    head_dim: int = bounded(MISSING, AT_LEAST_ONE)
    ffn: int = bounded(MISSING, AT_LEAST_ONE)
    vocab: int = bounded(MISSING, AT_LEAST_ONE)
    max_context: int = bounded(MISSING, AT_LEAST_ONE)
    tie_embeddings: bool = False  # the LM head shares the input embedding's matrix (one copy of weights)

    def check(self, prefix: str) -> None:
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"{prefix}kv_heads={self.kv_heads} does not divide {prefix}heads={self.heads}; "
                "allowed: a divisor of heads (grouped-query attention)"
            )
        if self.hidden % self.heads:
            raise ConfigError(
                f"{prefix}heads={self.heads} does not divide {prefix}hidden={self.hidden}; allowed: a divisor of hidden"
            )


@dataclass
class TierConfig:
    """One interconnect tier of the alpha-beta model: per-GPU bus bandwidth and per-hop latency."""

    bandwidth_gbps: float = bounded(MISSING, POSITIVE)  # GB/s (bytes, not bits)
    latency_us: float = bounded(MISSING, NON_NEGATIVE)


@dataclass
class ClusterConfig:
    name: str = MISSING
    nodes: int = bounded(1, AT_LEAST_ONE)
    gpus_per_node: int = bounded(8, AT_LEAST_ONE)
    peak_tflops: float = bounded(MISSING, POSITIVE)  # dense bf16 tensor-core peak per GPU
    sparse_peak_tflops: float = bounded(MISSING, POSITIVE)  # the same with 2:4 sparsity: the most the GPU claims
    sm_count: int = bounded(MISSING, AT_LEAST_ONE)  # streaming multiprocessors: one wave of a kernel's programs
    hbm_tbps: float = bounded(MISSING, POSITIVE)  # HBM bandwidth per GPU, TB/s
    intra: TierConfig = field(default_factory=TierConfig)  # inside a node
    inter: TierConfig = field(default_factory=TierConfig)  # between nodes
    grad_bytes: int = bounded(2, Bound(1, 8))  # bytes per gradient element in the DP all-reduce
    # Gradients are reduced in buckets of this many MiB as the last backward produces them (DDP's
    # bucket_cap_mb), overlapping the rest of that backward; 0: one all-reduce after it.
    grad_bucket_mb: float = bounded(25.0, Bound(0, 1e6))
    hbm_gb: float = bounded(MISSING, POSITIVE)  # HBM capacity per GPU, GB (1e9 bytes); sim.memory plans inside it
    gpu: Optional[str] = None  # the GPU as cost profiles name it ("gpu"): a profile of another GPU is refused
    profile: Optional[str] = None  # its measured cost profile: cost=calibrated's default cost.profile


class CPMode(str, Enum):
    """How sequences get their CP degree."""

    static = "static"  # every sequence on its DP rank's whole CP group of layout.cp ranks
    dynamic = "dynamic"  # each sequence on its own power-of-two CP group of at most layout.cp ranks (per plan)


@dataclass
class LayoutConfig:
    """Parallel degrees; ``dp: null`` fills the GPUs left over by cp x pp x tp. Under ``cp_mode: dynamic`` the
    dp x cp GPUs of a stage are one domain and ``cp`` is the largest CP degree a sequence may get (sim.cp_groups).
    ``tp``: tensor parallelism with sequence parallelism, its ranks inside one node (sim.tensor_parallel)."""

    dp: Optional[int] = bounded(None, AT_LEAST_ONE)
    cp: int = bounded(1, AT_LEAST_ONE)
    pp: int = bounded(1, AT_LEAST_ONE)
    micro_batches: int = bounded(8, AT_LEAST_ONE)
    cp_mode: CPMode = CPMode.static
    tp: int = bounded(1, AT_LEAST_ONE)



class LengthDistribution(str, Enum):
    longtail = "longtail"
    bimodal = "bimodal"
    trace = "trace"


@dataclass
class WorkloadConfig:
    name: str = MISSING
    distribution: LengthDistribution = LengthDistribution.longtail
    global_batch: int = bounded(64, AT_LEAST_ONE)  # sequences per optimiser step
    min_len: int = bounded(256, AT_LEAST_ONE)
    max_len: int = bounded(32768, AT_LEAST_ONE)
    median: float = bounded(4096.0, POSITIVE)  # longtail: lognormal median
    sigma: float = bounded(1.0, NON_NEGATIVE)  # longtail: lognormal shape
    short_median: float = bounded(2048.0, POSITIVE)  # bimodal: short mode
    long_median: float = bounded(24576.0, POSITIVE)  # bimodal: long mode
    long_fraction: float = bounded(0.2, FRACTION)  # bimodal: share of long sequences
    trace_path: Optional[str] = None  # trace: CSV or JSONL with a `length` column
    # Sensitivity s in (0, 1]: the exponent of the coverage power law, drawn from the Beta(a, b) prior unless
    # sensitivity_profile names a measured profile (python -m calibrate.sensitivity, sim/sensitivity.py), whose
    # model of s by length then replaces the prior.
    sensitivity_a: float = bounded(2.0, POSITIVE)
    sensitivity_b: float = bounded(5.0, POSITIVE)
    sensitivity_profile: Optional[str] = None  # null: the Beta prior
    sensitivity_task: Optional[str] = None  # the profile's task to draw from; null: its only one

    def check(self, prefix: str) -> None:
        self._check_shape_keys(prefix)
        if self.min_len > self.max_len:
            raise ConfigError(
                f"{prefix}min_len={self.min_len} exceeds {prefix}max_len={self.max_len}; allowed: min_len <= max_len"
            )
        if self.distribution is LengthDistribution.trace and not self.trace_path:
            raise ConfigError(f"{prefix}distribution=trace needs {prefix}trace_path (a CSV or JSONL file)")
        distribution = LengthDistribution(self.distribution)
        if self.trace_path and distribution is not LengthDistribution.trace:
            # Only a trace workload reads the file: the run would draw its lengths elsewhere without a word.
            raise ConfigError(f"{prefix}trace_path={self.trace_path!r} is read only by the trace workload, but "
                              f"{prefix}distribution={distribution.value}; allowed: workload=trace with "
                              f"{prefix}trace_path, or no trace_path")
        if self.sensitivity_task is not None and not self.sensitivity_profile:
            raise ConfigError(f"{prefix}sensitivity_task={self.sensitivity_task!r} needs {prefix}sensitivity_profile "
                              "(a measured profile); the Beta prior has no tasks")

    def _check_shape_keys(self, prefix: str) -> None:
        """Each distribution draws lengths from its own shape keys only; a trace, which reads none, refuses none: a
        preset's shape (paper_64nodes_cp's median) stays under sim.advise's workload=trace."""
        distribution = LengthDistribution(self.distribution)
        for name, keys in {"longtail": ("median", "sigma"),
                           "bimodal": ("short_median", "long_median", "long_fraction")}.items():
            if name != distribution.value and distribution is not LengthDistribution.trace:
                refuse_unread(self, keys, prefix, f"under {prefix}distribution={distribution.value} (only {name} "
                              "draws from it)", f"workload={name} to use it, or leave it out")


class AttentionBackend(str, Enum):
    """Which kernel prices a micro-batch's attention (sim.backends)."""

    ours = "ours"  # our block-sparse kernel at the plan's budgets
    dense_best = "dense_best"  # every micro-batch dense (kept 1) on the fastest dense backend the profile prices
    hybrid = "hybrid"  # each micro-batch on whichever is priced fastest: ours at its budgets or a dense backend


@dataclass
class CostConfig:
    name: str = MISSING  # a key of sim.cost.COST_MODELS
    # Attention block size in tokens: roofline's (conf/cost/roofline.yaml sets it). A calibrated profile carries
    # its own: there it stays null, or names the profile's (sim.cost.CalibratedCost refuses any other).
    block_size: Optional[int] = bounded(None, Bound(16, 1024))
    # Roofline only; a calibrated profile's fitted coefficients price the kernels, and it refuses other values.
    attn_efficiency: float = bounded(0.6, OPEN_FRACTION)  # share of peak the attention kernel reaches
    matmul_efficiency: float = bounded(0.7, OPEN_FRACTION)  # share of peak the dense layers reach
    attn_bwd_ratio: float = bounded(2.5, POSITIVE)  # backward/forward attention FLOPs (5 matmuls vs 2)
    launch_ms: float = bounded(0.0, NON_NEGATIVE)  # fixed overhead per kernel call
    profile: str = "calibrate/profiles/h200.json"  # calibrated: profile file
    attention_backend: AttentionBackend = AttentionBackend.ours
    # hybrid: ours or a sparse peer runs a micro-batch only where priced faster than the fastest dense peer by
    # at least this share; within it the profile's error (the calibration's 3% held-out median target) could
    # decide, and dense attention carries no accuracy question.
    hybrid_margin: float = bounded(0.03, Bound(0, 1, hi_open=True))

    def check(self, prefix: str) -> None:
        if self.name == "roofline":
            if self.block_size is None:
                raise ConfigError(f"{prefix}block_size is not set; cost=roofline needs a block size (allowed: 16 to "
                                  "1024, conf/cost/roofline.yaml sets 128)")
            refuse_unread(self, ["profile"], prefix, "by cost=roofline (it prices from the cluster's peak rates)",
                          f"cost=calibrated {prefix}profile={self.profile}, or leave it out")


@dataclass
class PolicyPart:
    """One half of a policy: a registry name and its parameters (type-checked by the policy's Params)."""

    name: str = MISSING
    params: Dict[str, Any] = field(default_factory=dict)


class EstimatorName(str, Enum):
    """What the policies believe about sequences they have not run (sim.estimate)."""

    prior = "prior"  # the stated prior (policy.prior), nothing learned
    online = "online"  # those updated with what the kernel reported of earlier steps
    oracle = "oracle"  # the data's truth: bound rows of the simulator only


@dataclass
class PriorConfig:
    """What the planner believes of sensitivities before any step has reported (sim.prior): a measured profile
    (``profile``, a ``python -m calibrate.sensitivity`` file) or a stated mean and spread of s, with a stated trend
    by length. Never the generator the simulator draws the data's truth from."""

    profile: Optional[str] = None  # a measured sensitivity profile: its mean and spread of logit s by length
    task: Optional[str] = None  # the profile's task; null: its only one
    mean: float = bounded(0.5, Bound(0, 1, lo_open=True, hi_open=True))  # stated mean of s (no profile)
    spread: float = bounded(0.25, POSITIVE)  # stated standard deviation of s (no profile)
    trend: float = bounded(0.0, Bound(-4, 4))  # stated change of logit s per doubling of the length from `pivot`
    pivot: int = bounded(4096, AT_LEAST_ONE)  # the length at which s has the stated mean

    def check(self, prefix: str) -> None:
        stated = {k: getattr(self, k) for k in ("mean", "spread", "trend", "pivot")}
        changed = [k for k, v in stated.items() if v != getattr(PriorConfig, k)]
        if self.profile is not None and changed:
            raise ConfigError(f"{prefix}{changed[0]}={stated[changed[0]]} with {prefix}profile={self.profile!r}: a "
                              f"profile states its own mean and spread by length; allowed: one of the two")
        if self.task is not None and self.profile is None:
            raise ConfigError(f"{prefix}task={self.task!r} needs {prefix}profile (a measured profile); a stated prior "
                              "has no tasks")
        if self.trend == 0 and "pivot" in changed:
            raise ConfigError(f"{prefix}pivot={self.pivot} is read only with a trend ({prefix}trend=0 here); allowed: "
                              f"a nonzero {prefix}trend, or no pivot")


@dataclass
class PolicyConfig:
    name: str = MISSING
    batching: PolicyPart = field(default_factory=PolicyPart)
    sparsity: PolicyPart = field(default_factory=PolicyPart)
    estimator: EstimatorName = EstimatorName.online
    # The attention backend this policy trains on (verl_dense: dense_best); null: the run's cost.attention_backend.
    attention_backend: Optional[AttentionBackend] = None
    # dynamic: this policy plans its own CP groups over the whole dp x cp domain of a static layout (megatron_dcp:
    # Megatron's groups of every power of two up to the whole DP x CP group); null: the run's layout.cp_mode.
    cp_mode: Optional[CPMode] = None
    prior: PriorConfig = field(default_factory=PriorConfig)  # where the estimator starts (sim.prior)


def policy_cost(cost: CostConfig, policy: PolicyConfig) -> CostConfig:
    """The cost config a policy runs under: its own attention backend where it names one."""
    return cost if policy.attention_backend is None else replace(cost, attention_backend=policy.attention_backend)


def policy_layout(layout: LayoutConfig, gpus: int, policy: PolicyConfig) -> LayoutConfig:
    """The layout a policy runs under: with ``cp_mode: dynamic`` on a static layout, its dp x cp GPUs of a stage as
    one dynamic domain (dp 1, cp the domain's size), else the run's own."""
    if policy.cp_mode is None or CPMode(policy.cp_mode) is CPMode(layout.cp_mode):
        return layout
    if CPMode(policy.cp_mode) is CPMode.static:
        raise ConfigError(f"policy {policy.name!r} sets cp_mode=static, but layout.cp_mode=dynamic; allowed: a "
                          "policy without cp_mode, or layout.cp_mode=static")
    dp = layout.dp if layout.dp is not None else gpus // (layout.cp * layout.pp)
    return replace(layout, dp=1, cp=dp * layout.cp, cp_mode=CPMode.dynamic)


class Sharding(str, Enum):
    """How the dp x cp replicas of a pipeline stage split its weights, gradients and optimizer states."""

    ddp = "ddp"  # plain data parallelism: every replica holds all three
    zero1 = "zero1"  # ZeRO-1 / distributed optimizer: the optimizer states are sharded
    fsdp = "fsdp"  # FSDP / ZeRO-3: all three are sharded; a layer's weights are gathered when it runs


class Overflow(str, Enum):
    """What planning does with a plan whose peak memory exceeds the HBM left after the margin."""

    repair = "repair"  # the batching policy moves sequences until it fits; an error if it cannot
    reject = "reject"  # an error, one line
    allow = "allow"  # nothing: the peak is only reported


@dataclass
class TokenBytes:
    """Bytes per token as a linear form in one layer's widths: the sum of each coefficient times its width
    (``q`` = heads x head_dim, ``kv`` = kv_heads x head_dim, ``const`` = 1)."""

    hidden: float = bounded(0.0, NON_NEGATIVE)
    q: float = bounded(0.0, NON_NEGATIVE)
    kv: float = bounded(0.0, NON_NEGATIVE)
    ffn: float = bounded(0.0, NON_NEGATIVE)
    heads: float = bounded(0.0, NON_NEGATIVE)
    head_dim: float = bounded(0.0, NON_NEGATIVE)
    const: float = bounded(0.0, NON_NEGATIVE)


@dataclass
class MemoryConfig:
    """The memory model of sim/memory.py. The per-token defaults count, from first principles, what the
    runner's layer (sparsebalance.model.Block, bf16, fused RMSNorm) and the sparse-attention kernel keep; a measured
    ``profile`` (``python -m calibrate.memory``) replaces them for the layer shapes it was fitted on."""

    overflow: Overflow = Overflow.repair
    margin_gb: float = bounded(8.0, NON_NEGATIVE)  # kept free: CUDA context, NCCL buffers, allocator fragmentation
    sharding: Sharding = Sharding.zero1
    # Each layer keeps only its input and recomputes the rest in its backward (the cost model does not charge
    # the recompute's time).
    activation_checkpointing: bool = True
    weight_bytes: float = bounded(2.0, POSITIVE)  # per parameter: bf16 weights
    grad_bytes: float = bounded(2.0, NON_NEGATIVE)  # per parameter: bf16 gradient accumulation
    optimizer_bytes: float = bounded(12.0, NON_NEGATIVE)  # per parameter: Adam's fp32 master weights and two moments
    # Per token and vocabulary entry on the last stage while a micro-batch's loss and backward run: the fp32
    # log-softmax and its gradient (8; PyTorch's F.cross_entropy over fp32 logits peaks at 12, a fused or
    # chunked loss near 0, the runner's loss over a few answer tokens about 0).
    logits_bytes: float = bounded(8.0, NON_NEGATIVE)
    # Held per token per layer from a micro-batch's forward to its backward, without checkpointing: the
    # layer input and both norm outputs, x after attention (hidden 8); the fused QKV output, RoPE'd q and k
    # and the attention output (q 6, kv 6); the gate/up output, SiLU output and their product (ffn 8); the
    # kernel's fp32 LSE (heads 4); two fp32 RMSNorm rstd (const 8).
    activations: TokenBytes = field(
        default_factory=lambda: TokenBytes(hidden=8.0, q=6.0, kv=6.0, ffn=8.0, heads=4.0, const=8.0))
    checkpointed: TokenBytes = field(default_factory=lambda: TokenBytes(hidden=2.0))  # with it: the layer input
    # Extra while one layer's backward runs: the incoming and the norm's gradient (hidden 4), the MLP's
    # gradients alive beside its not yet freed activations (ffn 4).
    backward: TokenBytes = field(default_factory=lambda: TokenBytes(hidden=4.0, ffn=4.0))
    # Per token per micro-batch and stage, not per layer: fp32 RoPE cos/sin (head_dim 4) and the kernel's int64
    # token -> block map, cached with the block layout (const 8).
    micro_batch: TokenBytes = field(default_factory=lambda: TokenBytes(head_dim=4.0, const=8.0))
    profile: Optional[str] = None  # measured terms, e.g. calibrate/profiles/h200_memory.json; null: first principles

    def check(self, prefix: str) -> None:
        if self.profile:
            refuse_unread(self, ("activations", "checkpointed", "backward", "micro_batch"), prefix,
                          f"under {prefix}profile={self.profile} (its measured terms replace the per-token counts)",
                          f"{prefix}profile=null to use the counts, or leave them out")
        if not self.activation_checkpointing:
            refuse_unread(self, ["checkpointed"], prefix, f"under {prefix}activation_checkpointing=false (every "
                          "activation is kept)", f"{prefix}activation_checkpointing=true to use it, or leave it out")


# A run on more GPUs than this, or larger than this many simulated GPU-steps (GPUs x steps) or sequences
# (global batch x steps), takes many minutes to hours and gigabytes; it needs ``force=true``. The simulator runs
# ~50,000 GPU-steps/s.
MAX_GPUS = 131_072
MAX_GPU_STEPS = 5_000_000
MAX_SEQUENCES = 2_000_000
GPU_STEPS_PER_S = 50_000


@dataclass
class RunConfig:
    policy: PolicyConfig = MISSING
    cluster: ClusterConfig = MISSING
    model: ModelConfig = MISSING
    workload: WorkloadConfig = MISSING
    cost: CostConfig = MISSING
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    seed: int = bounded(0, NON_NEGATIVE)
    steps: int = bounded(20, AT_LEAST_ONE)
    baseline: Optional[str] = "baseline"  # policy (conf/policy/<name>) to compare against; null: none
    write_plans: bool = True
    plot: bool = False  # also draw the run's figures into <run dir>/figures (viz.callbacks.RunFigures)
    force: bool = False  # run even when the size guard (MAX_GPUS, MAX_GPU_STEPS, MAX_SEQUENCES) says it is too big
    overwrite: bool = False  # sim.run: replace the results an earlier run left in hydra.run.dir (else refused)

    def check(self, prefix: str) -> None:
        self.check_size(prefix)
        self._check_layout(prefix)
        self._check_hybrid_margin(prefix)
        if self.plot and not self.write_plans:
            raise ConfigError(f"{prefix}plot=true needs {prefix}write_plans=true (the timeline replays the Plans)")

    def _check_hybrid_margin(self, prefix: str) -> None:
        backends = {AttentionBackend(b) for b in (self.cost.attention_backend, self.policy.attention_backend) if b}
        if AttentionBackend.hybrid not in backends:
            refuse_unread(self.cost, ["hybrid_margin"], f"{prefix}cost.", "unless an attention backend is hybrid",
                          f"{prefix}cost.attention_backend=hybrid to use it, or leave it out")

    def _check_layout(self, prefix: str) -> None:
        """What spans the model and workload groups; whether the degrees fit the GPUs is sim.cluster.Layout's
        check, made when the layout is built."""
        layout, model = self.layout, self.model
        gpus = self.cluster.nodes * self.cluster.gpus_per_node
        dp = layout.dp if layout.dp is not None else gpus // (layout.cp * layout.pp * layout.tp)
        self._check_tp(prefix)
        if model.layers % layout.pp:
            allowed = [d for d in range(1, model.layers + 1) if model.layers % d == 0]
            raise ConfigError(
                f"{prefix}layout.pp={layout.pp} does not split the model's {model.layers} layers evenly; "
                f"allowed pp: {', '.join(map(str, allowed))}"
            )
        if self.workload.global_batch < dp:
            raise ConfigError(
                f"{prefix}workload.global_batch={self.workload.global_batch} is smaller than the DP degree {dp}, "
                f"so some ranks would get no sequence; allowed: global_batch >= {dp}"
            )
        per_rank, micro_batches = self.workload.global_batch // dp, layout.micro_batches
        if micro_batches > per_rank:  # the rank with the fewest sequences has at most per_rank
            raise ConfigError(
                f"{prefix}layout.micro_batches={micro_batches} is more than the {per_rank} sequences a DP rank gets "
                f"(workload.global_batch={self.workload.global_batch} over dp={dp}), so micro-batches would be "
                f"empty; allowed: layout.micro_batches <= {per_rank}, or workload.global_batch >= "
                f"{dp * micro_batches}"
            )

    def _check_tp(self, prefix: str) -> None:
        """TP ranks share one node's link, and each holds whole heads, KV heads and FFN columns (Megatron's
        split)."""
        tp, per_node = self.layout.tp, self.cluster.gpus_per_node
        if tp > per_node or per_node % tp:
            allowed = [d for d in range(1, per_node + 1) if per_node % d == 0]
            raise ConfigError(f"{prefix}layout.tp={tp}: tensor-parallel ranks must sit inside one node of "
                              f"cluster.gpus_per_node={per_node}; allowed tp: {', '.join(map(str, allowed))}")
        for name in ("heads", "kv_heads", "ffn"):
            width = getattr(self.model, name)
            if width % tp:
                allowed = [d for d in range(1, per_node + 1) if per_node % d == 0 and self._splits(d)]
                raise ConfigError(f"{prefix}layout.tp={tp} does not divide model.{name}={width}, which TP splits "
                                  f"evenly; allowed tp: {', '.join(map(str, allowed))}")

    def _splits(self, tp: int) -> bool:
        return all(getattr(self.model, name) % tp == 0 for name in ("heads", "kv_heads", "ffn"))

    def check_size(self, prefix: str = "", runs: int = 1, across: str = "") -> None:
        """The size guard (MAX_GPUS, MAX_GPU_STEPS, MAX_SEQUENCES) of ``runs`` runs of this config, unless
        ``force``: sim.compare simulates each of its policies on each of its seeds (``across`` names them)."""
        if self.force:
            return
        gpus = self.cluster.nodes * self.cluster.gpus_per_node
        gpu_steps, sequences = gpus * self.steps * runs, self.workload.global_batch * self.steps * runs
        times, fewer = (f" x {across}", f" or runs ({across})") if runs > 1 else ("", "")
        if gpus > MAX_GPUS:
            raise ConfigError(
                f"cluster.nodes={self.cluster.nodes} x gpus_per_node={self.cluster.gpus_per_node} = {gpus:,} GPUs, "
                f"above the limit {MAX_GPUS:,}; allowed: fewer nodes, or {prefix}force=true"
            )
        if gpu_steps > MAX_GPU_STEPS:
            raise ConfigError(
                f"{gpus:,} GPUs x {self.steps} steps{times} = {gpu_steps:.3g} simulated GPU-steps, about "
                f"{gpu_steps / GPU_STEPS_PER_S / 60:,.0f} min at ~{GPU_STEPS_PER_S:,}/s, above the limit "
                f"{MAX_GPU_STEPS:.0e}; allowed: fewer cluster.nodes or steps{fewer}, or {prefix}force=true"
            )
        if sequences > MAX_SEQUENCES:
            raise ConfigError(
                f"{prefix}workload.global_batch={self.workload.global_batch:,} x {self.steps} steps{times} = "
                f"{sequences:.3g} sequences, above the limit {MAX_SEQUENCES:.0e}; allowed: a smaller "
                f"global_batch or fewer steps{fewer}, or {prefix}force=true"
            )


def register() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def compose_config(overrides: Sequence[str] = (), config_name: str = "config"):
    """The composed run config outside a Hydra app (tests, benchmarks, notebooks, sim.compare)."""
    from hydra import compose, initialize_config_dir

    register()
    check_group_overrides(overrides, config_name)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    check_bool_overrides(cfg, overrides)
    return cfg
