"""Memory per (DP rank, pipeline stage): the bytes a plan needs on each GPU, against the HBM it has.

Per GPU of stage s (a CP rank holds 1/cp of every per-token term, zigzag sharding; a TP rank under sequence
parallelism 1/tp of every per-token term and of the stage's weights, as Megatron-LM splits them: heads, FFN
columns and vocabulary rows over the tp ranks, the activations between them cut along the tokens):

* static: the stage's weights, gradients and optimizer states (``memory.sharding``: ``ddp`` keeps all three
  on every replica, ``zero1`` shards the optimizer states over the stage's dp x cp replicas, ``fsdp`` shards
  all three and holds two layers' weights gathered, the running one and the prefetched next, and one
  layer's gradient before its reduce-scatter). Stage 0 holds the embedding, the last stage the LM head
  (a copy of the embedding when they are tied and pp > 1, as Megatron keeps it);
* held, per micro-batch in flight: what its forward keeps for its backward, per token per layer
  (``memory.activations``, or with ``activation_checkpointing`` each layer's input, ``memory.checkpointed``),
  per token once per stage (``memory.micro_batch``) and the attention kernel's block selection;
* transient, while a micro-batch's backward runs: one layer's activation gradients (``memory.backward``;
  with checkpointing also that layer's recomputed activations and selection), the gradient of the largest
  weight matrix before it is accumulated, on the last stage the loss's logits (``logits_bytes`` per token
  and vocabulary entry), and with cp > 1 the ring's K/V send and receive buffers;
* in flight, as sim/engine.py schedules 1F1B: stage s runs w = min(pp - s - 1, m) warm-up forwards, so
  during micro-batch i's backward it holds micro-batches i .. min(i + w, m - 1), up to pp - s of them. The
  peak of a (rank, stage) is the largest of those moments.

The block selection (kernels/sparse_attention/selection.py) is int32 lists per KV head, priced at the sizes
the GPU path allocates (``selection_bytes``): forward lists ``q2k_idx`` and ``q2k_start`` [NB, width] (NB blocks
of the micro-batch; a top-p or dense selection is as wide as its longest document's blocks, whatever p keeps,
a top-k one as its budgets' widest row plus the tie slots) and reverse lists ``k2q_idx`` / ``k2q_start`` /
``k2q_end`` (top-p: every causal block pair). A dense micro-batch's selection depends on the block layout alone
and is shared by all its layers; a sparse one is built per layer. The block layout itself (``token_block``, 8
bytes per token) is a per-micro-batch term (``memory.micro_batch.const``). The kernel's fp32 LSE ``[Hq, T]``
is held per layer (``activations.heads``); its fp32 delta lives only inside one layer's backward.

Per-token terms come from the config (first principles) or, for the layer shapes it was fitted on, from a
measured profile (``memory.profile``, written by ``python -m calibrate.memory --fit``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sparsebalance.sim.config import MemoryConfig, ModelConfig, Overflow, Sharding, TokenBytes
from sparsebalance.sim.core import ConfigError, read_checked_json
from sparsebalance.sim.cost import BF16
from sparsebalance.sim.cp_groups import Units, plan_units, unit_costs, unit_rows
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.shapes import ModelShape, StageSpan

if TYPE_CHECKING:
    from sparsebalance.sim.cluster import Layout
    from sparsebalance.sim.cost import CostModel
    from sparsebalance.sim.workload import Request

GB = 1e9  # bytes; capacities and reports are decimal GB, as the datasheet's 141 GB
INT32 = 4
FP32 = 4
TIE_SLOTS = 16  # list slots the kernel adds to a sparse row for score ties (selection._topk_host_bounds)
MODES = ("full", "checkpointed")  # activation storage without and with checkpointing (profile keys)
TERMS = ("held_layer", "held_micro_batch", "transient", "transient_bytes")
SHAPE_KEYS = ("hidden", "heads", "kv_heads", "head_dim", "ffn")  # what per-token activation bytes depend on
PROFILE_SCHEMA_VERSION = 1


class MemoryLimitError(ConfigError):
    """A batch or plan that does not fit in the HBM left after the margin; one line, exit code 2."""


@dataclass(frozen=True)
class TokenTerms:
    """Activation bytes of one storage mode (per CP rank, before the 1/cp share)."""

    held_layer: float  # per token per layer, from a micro-batch's forward to its backward
    held_micro_batch: float  # per token per micro-batch and stage
    transient: float  # per token, while one layer's backward runs
    transient_bytes: float  # per micro-batch, while its backward runs


def widths(model: ModelConfig) -> dict[str, float]:
    """The widths TokenBytes coefficients multiply."""
    return {"hidden": model.hidden, "q": model.heads * model.head_dim, "kv": model.kv_heads * model.head_dim,
            "ffn": model.ffn, "heads": model.heads, "head_dim": model.head_dim, "const": 1.0}


def sparse_peer_bytes(model: ModelConfig) -> float:
    """Bytes per padded token and layer that a micro-batch on a sparse peer holds for its backward beside what our
    kernel's does: the peer (fa4_sparse) runs on the documents padded to whole blocks, and FlexAttention saves its
    own padded copies of q, k, v and the output (bf16) and the log-sum-exp (fp32) while the unpadded ones stay
    alive too. On an H100 (qwen2.5-3b, 18-33K documents) the runner measured 9.9-10.2 KB per token and layer
    above the same micro-batches on ours, this 9.3 KB (results/MANIFEST.md)."""
    return BF16 * 2 * (model.heads + model.kv_heads) * model.head_dim + FP32 * model.heads


def per_token(coefs: TokenBytes, model: ModelConfig) -> float:
    w = widths(model)
    return float(sum(getattr(coefs, name) * width for name, width in w.items()))


def largest_matrix(model: ModelConfig) -> float:
    """Parameters of the layer's largest weight matrix (the fused gate/up projection in these models)."""
    h, q, kv = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim
    return float(max(h * (q + 2 * kv), q * h, 2 * h * model.ffn, model.ffn * h))


def first_principles_terms(cfg: MemoryConfig, model: ModelConfig) -> dict[str, TokenTerms]:
    """Both storage modes from the config's per-token coefficients. Checkpointing holds each layer's input
    and, in the backward, recomputes one layer's full activations on top of its gradients."""
    full, backward = per_token(cfg.activations, model), per_token(cfg.backward, model)
    once, grad_temp = per_token(cfg.micro_batch, model), cfg.grad_bytes * largest_matrix(model)
    return {
        "full": TokenTerms(full, once, backward, grad_temp),
        "checkpointed": TokenTerms(per_token(cfg.checkpointed, model), once, full + backward, grad_temp),
    }


# ----------------------------------------------------------------------------- profile
def shape_of(model) -> dict[str, int]:
    return {key: int(getattr(model, key)) for key in SHAPE_KEYS}


def load_profile_terms(path: str, model: ModelConfig, key: str = "memory.profile") -> dict[str, TokenTerms]:
    """The measured terms of the profile entry whose layer shape is the model's; one ConfigError line for
    a missing or malformed file and for a shape the profile was not fitted on."""
    profile = read_checked_json(path, key, "python -m calibrate.memory --fit writes one", profile_problem)
    wanted = shape_of(model)
    for entry in profile["shapes"].values():
        if entry["shape"] == wanted:
            return {mode: TokenTerms(**entry["modes"][mode]) for mode in MODES}
    fitted = ", ".join(sorted(profile["shapes"]))
    raise ConfigError(f"{key}={path!r} has no entry for the layer shape of model {model.name!r} ({wanted}); "
                      f"allowed: a model of the shapes fitted ({fitted}), or memory.profile=null (first principles)")


def profile_problem(profile) -> str | None:
    """What makes a parsed profile unusable, or None."""
    if not isinstance(profile, dict) or profile.get("schema_version") != PROFILE_SCHEMA_VERSION:
        return f"schema_version must be {PROFILE_SCHEMA_VERSION} (a JSON object written by calibrate.memory)"
    shapes = profile.get("shapes")
    if not isinstance(shapes, dict) or not shapes:
        return "shapes must be a non-empty object of model name -> {shape, modes}"
    for name, entry in shapes.items():
        if not isinstance(entry, dict) or set(entry.get("shape", {})) != set(SHAPE_KEYS):
            return f"shapes.{name}.shape must have the keys {', '.join(SHAPE_KEYS)}"
        for mode in MODES:
            terms = entry.get("modes", {}).get(mode)
            if not isinstance(terms, dict) or set(terms) != set(TERMS):
                return f"shapes.{name}.modes.{mode} must have the keys {', '.join(TERMS)}"
            bad = [t for t in TERMS
                   if not isinstance(terms[t], (int, float)) or not math.isfinite(terms[t]) or terms[t] < 0]
            if bad:
                return f"shapes.{name}.modes.{mode}.{bad[0]}={terms[bad[0]]!r}; allowed: a finite number >= 0"
    return None


# ----------------------------------------------------------------------------- static bytes
def stage_params(model: ModelConfig, pp: int) -> np.ndarray:
    """Parameters held by each pipeline stage (``ModelShape.stage_params``)."""
    shape = ModelShape.from_config(model)
    return np.array([shape.stage_params(StageSpan(s, pp)) for s in range(pp)], dtype=np.float64)


def static_bytes(cfg: MemoryConfig, model: ModelConfig, layout: Layout) -> np.ndarray:
    """Weights, gradients and optimizer states per GPU of each stage, [pp] (a TP rank's share of them)."""
    params = stage_params(model, layout.pp) / layout.tp
    replicas = layout.dp * layout.cp
    sharding = Sharding(cfg.sharding)
    opt_share = 1.0 if sharding is Sharding.ddp else 1.0 / replicas
    share = 1.0 / replicas if sharding is Sharding.fsdp else 1.0
    total = params * (share * (cfg.weight_bytes + cfg.grad_bytes) + opt_share * cfg.optimizer_bytes)
    if sharding is Sharding.fsdp:
        total += ModelShape.from_config(model).params_per_layer / layout.tp * (2 * cfg.weight_bytes + cfg.grad_bytes)
    return total


# ----------------------------------------------------------------------------- selection bytes
def selection_bytes(lengths, kept, group, n_groups: int, kv_heads: int, block_size: int,
                    topk=None) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's block selection of each micro-batch, as the GPU path allocates it (``select_blocks``'
    dense and fused Triton selections): (bytes per layer, bytes per micro-batch), [n_groups].

    Per KV head, over the micro-batch's NB blocks, n documents, C causal block pairs and W blocks of its
    longest document, int32 lists: forward ``q2k_idx`` and ``q2k_start`` [NB, width] with their counts [NB],
    reverse ``k2q_idx`` / ``k2q_start`` / ``k2q_end`` [entries] with one row pointer [Hkv * NB + 1] over
    all heads; fp32 per-document kept fraction and coverage [n].

    * dense (every sequence keeps every block): built from the block layout alone and shared by the layers;
      width W, entries NB x W (the reverse lists come from one sort over every forward slot), one stats
      tensor;
    * top-p (a ``p`` budget): built per layer. The fused selection never waits for the GPU to learn its
      widest row, so the lists are W wide and the reverse lists hold C entries however few blocks p keeps;
      also the two row-class block ends [NB] that stand in for the widest row;
    * top-k (``topk``: the budget fixes the kept fraction, the micro-batch's lists are sized on the host):
      built per layer, width min(W, k + TIE_SLOTS) with k the most any document's last row keeps
      (round(kept x nb), at least one), entries the host's bound: per document of nb blocks, rows of up to
      that width hold their causal blocks, longer rows the width.

    ``topk`` per sequence (None: every budget is a ``p``); a micro-batch's lists are top-k where any of its
    sequences is (a Plan gives one kind of budget)."""
    nb = np.ceil(np.asarray(lengths, dtype=np.float64) / block_size)
    kept = np.asarray(kept, dtype=np.float64)
    group = np.asarray(group, dtype=np.int64)
    topk = np.zeros(nb.size, dtype=bool) if topk is None else np.asarray(topk, dtype=bool)

    def per_group(values) -> np.ndarray:
        return np.bincount(group, weights=np.asarray(values, dtype=np.float64), minlength=n_groups)

    def group_max(values) -> np.ndarray:
        out = np.zeros(n_groups)
        np.maximum.at(out, group, values)
        return out

    docs, blocks, causal = per_group(np.ones(nb.size)), per_group(nb), per_group(nb * (nb + 1.0) / 2.0)
    widest = group_max(nb)
    rows_of = 2.0 * blocks  # per head: the forward counts and the reverse row pointer (its + 1 is once)

    dense = kv_heads * (5.0 * blocks * widest + rows_of) + 1.0 + docs
    top_p = kv_heads * (2.0 * blocks * widest + rows_of + 3.0 * causal) + 1.0 + 2.0 * blocks + 2.0 * docs
    rows = np.minimum(nb, np.maximum(1.0, np.floor(kept * nb + 0.5)))
    width = np.minimum(widest, group_max(rows) + TIE_SLOTS)
    short = np.minimum(nb, width[group])
    bound = per_group(short * (short + 1.0) / 2.0 + (nb - short) * width[group])
    top_k = kv_heads * (2.0 * blocks * width + rows_of + 3.0 * bound) + 1.0 + 2.0 * docs

    all_dense = per_group(kept < 1.0) == 0
    sparse = INT32 * np.where(per_group(topk) > 0, top_k, top_p)
    busy = docs > 0
    return (np.where(busy & ~all_dense, sparse, 0.0),
            np.where(busy & all_dense, INT32 * dense, 0.0))


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Overfull:
    """The worst (rank, stage) of a plan that does not fit."""

    rank: int
    micro_batch: int
    stage: int
    need_bytes: float


class MemoryModel:
    """Bytes per (DP rank, micro-batch, stage) of a plan: the memory of that stage while that micro-batch's
    backward runs, static bytes included."""

    def __init__(self, cfg: MemoryConfig, model: ModelConfig, layout: Layout, hbm_gb: float, block_size: int,
                 terms: TokenTerms | None = None) -> None:
        """``terms``: the activation terms of the config's storage mode, instead of the profile's or the
        config's own (calibrate.memory evaluates fitted terms through this)."""
        if cfg.margin_gb >= hbm_gb:
            raise ConfigError(f"memory.margin_gb={cfg.margin_gb:g} leaves nothing of cluster.hbm_gb={hbm_gb:g}; "
                              f"allowed: margin_gb < {hbm_gb:g}")
        self.cfg, self.model, self.layout, self.block_size = cfg, model, layout, block_size
        self.hbm_gb, self.overflow = hbm_gb, Overflow(cfg.overflow)
        self.available_bytes = (hbm_gb - cfg.margin_gb) * GB
        if terms is None:
            by_mode = load_profile_terms(cfg.profile, model) if cfg.profile else first_principles_terms(cfg, model)
            terms = by_mode["checkpointed" if cfg.activation_checkpointing else "full"]
        self.terms = terms
        self.static = static_bytes(cfg, model, layout)
        self.layers = model.layers // layout.pp
        pp, m = layout.pp, layout.micro_batches
        self.warmup = np.array([min(pp - s - 1, m) for s in range(pp)])
        self.by_cp: dict[int, MemoryModel] = {}  # the model of each CP group size (dynamic CP)

    @classmethod
    def from_config(cls, cfg, layout: Layout, block_size: int) -> MemoryModel:
        """From a run config (its ``memory``, ``model`` and ``cluster.hbm_gb``)."""
        return cls(cfg.memory, cfg.model, layout, cfg.cluster.hbm_gb, block_size)

    # --- per micro-batch
    def micro_batch_bytes(self, lengths, kept, group, n_groups: int, topk=None,
                          on_sparse_peer=None) -> tuple[np.ndarray, np.ndarray]:
        """(held, transient) bytes per micro-batch and stage, [n_groups, pp]; ``topk`` as ``selection_bytes``;
        ``on_sparse_peer`` ([n_groups] bool, None: none) the micro-batches whose attention runs on a sparse peer,
        which hold :func:`sparse_peer_bytes` per padded token more in each layer whose activations are kept (under
        checkpointing, the one layer being recomputed)."""
        # a TP rank holds 1/tp of each per-token term (sequence parallelism), its KV heads' selection
        cp, tp, t, model = self.layout.cp, self.layout.tp, self.terms, self.model
        tokens = np.bincount(group, weights=np.asarray(lengths, dtype=np.float64), minlength=n_groups) / (cp * tp)
        per_layer, shared = selection_bytes(lengths, kept, group, n_groups, model.kv_heads // tp, self.block_size,
                                            topk)
        per_layer, shared = per_layer / cp, shared / cp
        peer_layer = 0.0
        if on_sparse_peer is not None:
            padded = np.ceil(np.asarray(lengths, dtype=np.float64) / self.block_size) * self.block_size
            padded = np.bincount(group, weights=padded, minlength=n_groups) / (cp * tp)
            peer_layer = np.where(on_sparse_peer, sparse_peer_bytes(model) * padded, 0.0)
        busy = tokens > 0
        held = self.layers * (t.held_layer * tokens + per_layer) + t.held_micro_batch * tokens + shared
        transient = np.where(busy, t.transient * tokens + t.transient_bytes / tp, 0.0)
        if self.cfg.activation_checkpointing:
            # the recomputed layer builds its selection again, and a sparse peer its padded copies
            transient = transient + per_layer + peer_layer
        else:
            held = held + self.layers * peer_layer
        if cp > 1:
            transient = transient + 2 * 2 * model.kv_heads * model.head_dim * BF16 * tokens  # K/V send + receive
        held = np.repeat(held[:, None], self.layout.pp, axis=1)
        transient = np.repeat(transient[:, None], self.layout.pp, axis=1)
        # The last stage runs each micro-batch's backward right after its forward, so the loss's logits are
        # counted once, as the transient of that micro-batch.
        transient[:, -1] += self.cfg.logits_bytes * model.vocab * tokens
        return held, transient

    def stage_bytes(self, held: np.ndarray, transient: np.ndarray) -> np.ndarray:
        """[dp, m, pp] from held/transient [dp, m, pp]: static + the micro-batches in flight + the transient."""
        m = held.shape[1]
        cumulative = np.concatenate([np.zeros_like(held[:, :1]), np.cumsum(held, axis=1)], axis=1)
        end = np.minimum(np.arange(m)[:, None] + self.warmup[None, :], m - 1) + 1  # [m, pp]
        window = np.take_along_axis(cumulative, np.broadcast_to(end, held.shape), axis=1) - cumulative[:, :m]
        return self.static[None, None, :] + window + transient

    def bytes_of(self, dp_rank, micro_batch, lengths, kept, topk=None, on_sparse_peer=None) -> np.ndarray:
        """[dp, m, pp] bytes of a plan given as one row per sequence; ``topk`` as ``selection_bytes``,
        ``on_sparse_peer`` ([dp * m] bool) as ``micro_batch_bytes``."""
        dp, m, pp = self.layout.dp, self.layout.micro_batches, self.layout.pp
        group = np.asarray(dp_rank, dtype=np.int64) * m + np.asarray(micro_batch, dtype=np.int64)
        held, transient = self.micro_batch_bytes(lengths, kept, group, dp * m, topk, on_sparse_peer)
        return self.stage_bytes(held.reshape(dp, m, pp), transient.reshape(dp, m, pp))

    def with_cp(self, cp: int) -> MemoryModel:
        """This model on ``layout.with_cp(cp)``: a rank's bytes in a CP group of ``cp`` ranks."""
        if cp not in self.by_cp:
            self.by_cp[cp] = MemoryModel(self.cfg, self.model, self.layout.with_cp(cp), self.hbm_gb, self.block_size,
                                         self.terms)
        return self.by_cp[cp]

    def unit_bytes(self, units: Units, lengths, kept, topk=None, on_sparse_peer=None) -> np.ndarray:
        """[domain, m, pp] bytes under dynamic CP (sim.cp_groups): each unit's per-rank bytes on a CP group of its
        size, held bytes summed and transients the largest over the units a rank runs in one micro-batch;
        ``on_sparse_peer`` per unit."""
        pp = self.layout.pp
        held, transient = np.zeros((units.count, pp)), np.zeros((units.count, pp))
        for size in np.unique(units.size).tolist():
            members = np.flatnonzero(units.size == size)
            local = np.full(units.count, -1)
            local[members] = np.arange(members.size)
            rows = np.flatnonzero(local[units.row_unit] >= 0)
            held[members], transient[members] = self.with_cp(size).micro_batch_bytes(
                np.asarray(lengths)[rows], np.asarray(kept)[rows], local[units.row_unit[rows]], members.size,
                None if topk is None else np.asarray(topk)[rows],
                None if on_sparse_peer is None else np.asarray(on_sparse_peer)[members])
        per_rank = [np.stack([unit_rows(units, self.layout, values[:, stage], reduce) for stage in range(pp)], axis=-1)
                    for values, reduce in ((held, "sum"), (transient, "max"))]
        return self.stage_bytes(*per_rank)

    def plan_bytes(self, plan: Plan, cost: CostModel) -> np.ndarray:
        """[dp, m, pp] bytes of a plan at the kept fractions its budgets give, on the backends the cost model
        runs its micro-batches on there (a sparse peer's hold more: ``micro_batch_bytes``); [domain, m, pp] for a
        dynamic-CP plan (``unit_bytes``)."""
        rows = plan_rows(plan, cost)
        on_peer = None
        if plan.dynamic_cp:
            units = plan_units(plan, self.layout)
            if cost.attention_backend == "hybrid" and cost.sparse_backends():
                backend = unit_costs(cost, units, rows.length, rows.kept, self.layout)[0].backend
                on_peer = np.isin(backend, cost.sparse_backends())
            return self.unit_bytes(units, rows.length, rows.kept, rows.topk, on_peer)
        if cost.attention_backend == "hybrid" and cost.sparse_backends():
            n = self.layout.dp * self.layout.micro_batches
            group = np.asarray(rows.rank, dtype=np.int64) * self.layout.micro_batches + rows.micro_batch
            backend = cost.micro_batch_costs(rows.length, rows.kept, group, n, self.layout).backend
            on_peer = np.isin(backend, cost.sparse_backends())
        return self.bytes_of(rows.rank, rows.micro_batch, rows.length, rows.kept, rows.topk, on_peer)

    def overfull(self, nbytes: np.ndarray) -> Overfull | None:
        """The worst (rank, micro-batch, stage) above the available bytes, or None when everything fits."""
        worst = np.unravel_index(int(np.argmax(nbytes)), nbytes.shape)
        need = float(nbytes[worst])
        return Overfull(*map(int, worst), need) if need > self.available_bytes else None

    # --- checks
    def check_batch(self, batch: list[Request]) -> None:
        """Fail, naming the sequence, when one sequence alone in a micro-batch (dense) exceeds a stage; nothing
        under ``overflow=allow``."""
        if self.overflow is Overflow.allow:
            return
        lengths = np.fromiter((s.length for s in batch), dtype=np.float64, count=len(batch))
        held, transient = self.micro_batch_bytes(lengths, np.ones(lengths.size), np.arange(lengths.size), lengths.size)
        alone = self.static[None, :] + held + transient
        over = np.flatnonzero(alone.max(axis=1, initial=0.0) > self.available_bytes)
        if over.size:
            i = int(over[np.argmax(lengths[over])])
            stage = int(np.argmax(alone[i]))
            seq = batch[i]
            raise MemoryLimitError(
                f"sequence {seq.id} (length {seq.length} tokens) needs {alone[i, stage] / GB:.1f} GB on pipeline "
                f"stage {stage} alone in its micro-batch, above the {self._available()}; it fits under no plan; "
                f"allowed: {self._remedies('shorter sequences (workload.max_len)')}")

    def fitted(self, plan: Plan, batching, cost: CostModel) -> Plan:
        """The batching policy's plan if it fits; else, under ``overflow=repair``, the policy's repair of it
        (its ``fit_memory(plan, memory, cost)``; the built-in policies move sequences, policies.repack); an
        error when it still does not fit or the policy has no repair."""
        if self.overflow is Overflow.allow:
            return plan
        over, who = self.overfull(self.plan_bytes(plan, cost)), repr(getattr(batching, "name", type(batching).__name__))
        if over is not None and self.overflow is Overflow.repair:
            repair = getattr(batching, "fit_memory", None)
            if repair is None:
                who = f"{who} (which has no fit_memory to repair it)"
            else:
                plan = repair(plan, self, cost)
                over, who = self.overfull(self.plan_bytes(plan, cost)), f"{who} after its repair"
        if over is not None:
            self._reject(plan, over, who)
        return plan

    def check(self, plan: Plan, cost: CostModel, who: str) -> None:
        """Fail when a plan (e.g. after its budgets were tuned) does not fit; nothing under ``overflow=allow``."""
        if self.overflow is Overflow.allow:
            return
        over = self.overfull(self.plan_bytes(plan, cost))
        if over is not None:
            self._reject(plan, over, repr(who))

    def _reject(self, plan: Plan, over: Overfull, who: str) -> None:
        raise MemoryLimitError(
            f"step {plan.step}: the plan of {who} needs {over.need_bytes / GB:.1f} GB on "
            f"{'domain' if plan.dynamic_cp else 'DP'} rank {over.rank}, "
            f"pipeline stage {over.stage} (during micro-batch {over.micro_batch}'s backward), above the "
            f"{self._available()}; allowed: {self._remedies('more micro-batches (layout.micro_batches)')}")

    def _available(self) -> str:
        return (f"{self.available_bytes / GB:.1f} GB available (cluster.hbm_gb={self.hbm_gb:g} - "
                f"memory.margin_gb={self.cfg.margin_gb:g})")

    def _remedies(self, first: str) -> str:
        cfg, options = self.cfg, [first]
        if not cfg.activation_checkpointing:
            options.append("memory.activation_checkpointing=true")
        if Sharding(cfg.sharding) is not Sharding.fsdp:
            options.append("memory.sharding=fsdp")
        options.append("more pipeline stages or context parallelism (layout.pp, layout.cp)")
        return ", ".join(options)


# ----------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class PlanRows:
    """A plan's sequences as arrays, in plan order."""

    rank: np.ndarray
    micro_batch: np.ndarray
    length: np.ndarray
    kept: np.ndarray
    topk: np.ndarray  # the budget fixes the kept fraction (the kernel's top-k selection)


def plan_rows(plan: Plan, cost: CostModel) -> PlanRows:
    """A plan's rows at the most blocks its budgets can keep: a planner does not know how a sequence's
    attention spreads, and the kept fraction grows with the sensitivity s (p ** (1 / s)), so s = 1 bounds it."""
    return PlanRows(plan.dp_ranks, plan.micro_batch_ids, plan.lengths,
                    plan.budgets.kept(cost, plan.lengths, np.ones(len(plan))), plan.budgets.fixes_blocks)
