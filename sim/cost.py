"""Cost models: time of a micro-batch on one pipeline stage and one CP rank, plus the coverage model.

Both models share one decomposition, per transformer layer and direction:
attention (proportional to the kept causal blocks of each document), block selection (only for
sequences that are sparse), the other layers (proportional to tokens) and the CP ring KV exchange,
which overlaps attention (a layer pays ``max(attention, transfer)``). They differ only in how a
term's time follows from its features: ``roofline`` divides FLOPs (and bytes) by peak rates,
``calibrated`` applies the fitted coefficients of a profile file (``time = sum(coef[f] * feature[f])``).

Every entry point is vectorised over micro-batches (flat arrays of sequences plus a group index),
because the engine costs thousands of micro-batches per simulated second.

Coverage (the accuracy side) is a power law per sequence: ``coverage(kf) = kf ** s`` with
``s = sensitivity`` in (0, 1]; ``kept_fraction(seq, p) = max(p ** (1/s), diag_fraction(length))``
since the diagonal block of every query block is always kept.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields

import numpy as np

from sparsebalance.sim.backends import (DENSE_FEATURES, OURS, choose, grouped_dense, grouped_sparse, is_sparse,
                                        missing_peers, peer_options)
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.config import CostConfig, ModelConfig
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cp_shards import kept_in_row, kept_rows, slowest_rank_extra
from sparsebalance.sim.groups import Groups
from sparsebalance.sim.profile import ATTENTION_FEATURES, DKDV_SLOTS, PROFILE_FEATURES, WAVE, load_profile
from sparsebalance.sim.shapes import ModelShape
from sparsebalance.sim import tensor_parallel as tp_split
from sparsebalance.sim.workload import Sequence

# Launch rules of the calibrated kernel, mirrored from kernels/sparse_attention/launch.py (tests check they
# match): keys per dK/dV program (DEFAULT_CONFIG["dkdv"]["BN"], at most the block size: a key block is split
# over block_size / DKDV_KEYS programs); the row length below which the forward and dQ take their short-row
# tiles (64 query rows per program instead of 128); and when dQ runs beside dK/dV on a side stream instead of
# before it (at most that many dK/dV programs per SM).
DKDV_KEYS = 64
SHORT_ROW_TOKENS = 2048
OVERLAP_MAX_PROGRAMS_PER_SM = 16
# The busiest key block of a selection (the dK/dV program that runs longest): the number of query rows that
# keep a key block has a mean of about the longest row's kept blocks and a variance of about (row - 1)(1 - slope)
# where rows keep their other blocks at random, and the most any of a sequence's KV heads x key blocks reaches
# is about mean + BUSIEST_Z sqrt(variance ln(KV heads x key blocks)). BUSIEST_Z is fitted to a Monte Carlo of
# the kernel's top-k rule on random scores (what calibrate.run times) over the calibration grid (6% rms), not to
# timings. A learned selection that every row shares (an attention sink) makes that block's count the rows.
BUSIEST_Z = 0.75
BF16 = 2  # bytes per element of activations, K/V and weights


# ----------------------------------------------------------------------------- features
def diag_fraction(lengths: np.ndarray, block_size: int) -> np.ndarray:
    """Share of a document's causal blocks that lie on the diagonal: nb / (nb (nb+1) / 2)."""
    nb = np.ceil(np.asarray(lengths, dtype=np.float64) / block_size)
    return 2.0 / (nb + 1.0)


def topk_kept_fraction(lengths, top_k, block_size: int) -> np.ndarray:
    """Share of a document's causal blocks that top-k keeps: row r (of nb query blocks) keeps min(k, r + 1)
    blocks, so k (k + 1) / 2 + (nb - k) k of nb (nb + 1) / 2 when k < nb, and every block otherwise."""
    nb = np.ceil(np.asarray(lengths, dtype=np.float64) / block_size)
    k = np.minimum(np.asarray(top_k, dtype=np.float64), nb)
    return (k * (k + 1.0) / 2.0 + (nb - k) * k) / np.maximum(nb * (nb + 1.0) / 2.0, 1.0)


def _head_pair_flops(model: ModelConfig, block_size: int) -> float:
    """FLOPs of QK^T and PV of one (query block, key block) pair for one head: 2 matmuls x 2 FLOPs per MAC."""
    return 4.0 * block_size * block_size * model.head_dim


def _sequence_attention(lengths: np.ndarray, kept: np.ndarray, model: ModelConfig, block_size: int) -> dict:
    """Per-sequence attention features of one layer's forward: those a micro-batch sums
    (ATTENTION_FEATURES), and ``row``/``busiest``, of which it takes the largest
    (see _launch_features)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    nb = np.ceil(lengths / block_size)
    causal = nb * (nb + 1.0) / 2.0
    kept = np.asarray(kept, dtype=np.float64)
    head_pair_flops = _head_pair_flops(model, block_size)
    tiles = block_size / min(DKDV_KEYS, block_size)
    # Rows keep the diagonal and about a fixed share of their other blocks (sim.cp_shards.kept_rows): the
    # last row keeps the most, ``row`` blocks; a key block is kept by about that many rows, spread as below.
    floored, slope = kept_rows(nb, kept)
    row = np.where(nb > 0, kept_in_row(nb - 1.0, floored, slope), 0.0)
    spread = np.maximum(row - 1.0, 0.0) * (1.0 - np.clip(slope, 0.0, 1.0))
    busiest = np.minimum(nb, row + BUSIEST_Z * np.sqrt(spread * np.log(np.maximum(model.kv_heads * nb, 1.0))))
    return {
        "const": np.ones_like(lengths),
        "tokens": lengths,
        "blocks": causal * model.heads,
        "flops": kept * causal * head_pair_flops * model.heads,
        "q_blocks": nb * model.heads,  # forward and dQ programs: one per (query block, head)
        "kv_blocks": nb * model.kv_heads * tiles,  # dK/dV programs: per (key tile, KV head)
        "row": row,
        "busiest": busiest,
    }


def _launch_features(feats: dict, row, busiest, model: ModelConfig, block_size: int, cp: int = 1) -> dict:
    """Add the kernels' launch features to summed features ``feats`` (one entry per micro-batch, per CP rank)
    given each micro-batch's longest row and busiest key block (blocks; largest over its sequences).

    A kernel lasts at least its longest program (its critical path; LPT-ordered grids put it first):

    * ``fwd_path``: the longest forward (or dQ) program, one head's query tile (64 rows when every row is
      shorter than SHORT_ROW_TOKENS, else 128) over the longest row's kept blocks;
    * ``dq_path``: the same for the dQ kernel, where it runs before dK/dV (not overlapped with it);
    * ``dkdv_path``: the larger of the longest dK/dV program (the GQA group's query heads over the busiest key
      block's query blocks, for one key tile, four matmuls each) and the dK/dV work (twice the forward's
      matmuls) spread over DKDV_SLOTS resident programs;
    * ``kv_waves``: the dK/dV programs in whole waves of WAVE (each wave loads and stores its tiles).

    FLOP features are forward-FLOP-like units of one call. Under CP (``feats`` already 1/cp each) the longest
    programs are 1/cp as well; the tile class follows the undivided row, as one rank holds whole rows.
    """
    row = np.asarray(row, dtype=np.float64)
    head_pair_flops = _head_pair_flops(model, block_size)
    tile_rows = np.where(row * block_size < SHORT_ROW_TOKENS, min(64, block_size), min(128, block_size))
    fwd_path = row * head_pair_flops * tile_rows / block_size / cp
    overlapped = feats["kv_blocks"] <= OVERLAP_MAX_PROGRAMS_PER_SM * WAVE
    group = model.heads // model.kv_heads
    longest_dkdv = group * np.asarray(busiest, dtype=np.float64) * 2.0 * head_pair_flops \
        * min(DKDV_KEYS, block_size) / block_size / cp
    return feats | {
        "fwd_path": fwd_path,
        "dq_path": np.where(overlapped, 0.0, fwd_path),
        "dkdv_path": np.maximum(longest_dkdv, 2.0 * np.asarray(feats["flops"], dtype=np.float64) / DKDV_SLOTS),
        "kv_waves": np.ceil(np.asarray(feats["kv_blocks"], dtype=np.float64) / WAVE),
    }


def summed_features(per_seq: dict, groups: Groups, cp: int = 1) -> dict[str, np.ndarray]:
    """Per-sequence features summed per micro-batch, 1/cp each on CP ranks (zigzag sharding balances the dense
    causal work); ``const`` counts one kernel call per non-empty micro-batch."""
    out = {k: groups.sum(per_seq[k]) / cp for k in ATTENTION_FEATURES}
    out["const"] = np.minimum(out["const"] * cp, 1.0)
    return out


def grouped_attention(per_seq: dict, groups: Groups, model: ModelConfig, block_size: int, cp: int = 1,
                      extra_flops=0.0, summed: dict | None = None) -> dict[str, np.ndarray]:
    """Attention features of the micro-batches of ``groups`` from _sequence_attention's ``per_seq``: the summed
    ones (``summed``, else :func:`summed_features`; ``flops`` plus ``extra_flops``, the slowest CP rank's excess)
    and the launch features of each micro-batch's longest row and busiest key block (_launch_features)."""
    out = dict(summed_features(per_seq, groups, cp) if summed is None else summed)
    out["flops"] = out["flops"] + extra_flops
    return _launch_features(out, groups.max(per_seq["row"]), groups.max(per_seq["busiest"]), model, block_size, cp)


def select_features(per_seq: dict, summed: dict, kept: np.ndarray, groups: Groups, cp: int = 1) -> dict:
    """The selection's features per micro-batch: :func:`summed_features` over the sparse sequences (kept < 1)
    only. ``summed``: those over every sequence, which a replica whose sequences are all sparse has as they
    are; one whose sequences are all dense has none."""
    sparse = np.broadcast_to(kept < 1.0, (groups.replicas, groups.group.size))
    every, some = sparse.all(axis=1), sparse.any(axis=1)
    out = {k: np.where(every[:, None], v.reshape(groups.replicas, -1), 0.0) for k, v in summed.items()}
    mixed = np.flatnonzero(some & ~every)
    if mixed.size:
        weights = sparse[mixed].astype(np.float64)
        rows = {k: np.broadcast_to(per_seq[k], sparse.shape)[mixed] * weights for k in ATTENTION_FEATURES}
        for k, v in summed_features(rows, Groups(groups.group, groups.n_groups, mixed.size), cp).items():
            out[k][mixed] = v.reshape(mixed.size, -1)
    return {k: v.reshape(-1) for k, v in out.items()}


def attention_features(lengths, kept_fractions, model: ModelConfig, block_size: int) -> dict[str, float]:
    """Features of one attention call (one layer, forward) over a micro-batch of documents.

    ``const`` counts the call, ``tokens`` the tokens, ``blocks`` the causal (query, key) block
    pairs times heads (the selection's scoring work), ``flops`` the FLOPs of the kept blocks,
    ``q_blocks``/``kv_blocks`` the kernel's forward/dQ and dK/dV programs, and the launch features of
    _launch_features (``fwd_path``, ``dq_path``, ``dkdv_path``, ``kv_waves``: what bounds small batches).
    """
    per_seq = _sequence_attention(np.asarray(lengths), np.asarray(kept_fractions), model, block_size)
    feats = grouped_attention(per_seq, Groups(np.zeros(per_seq["tokens"].size, dtype=np.int64), 1), model, block_size)
    return {k: float(v[0]) for k, v in feats.items()}


def dense_features(lengths, model: ModelConfig, block_size: int) -> dict[str, float]:
    """Features of one dense attention call (one layer, forward) over a micro-batch of documents: those of
    sim.backends.DENSE_FEATURES, which a dense backend's terms are priced on."""
    lengths = np.asarray(lengths, dtype=np.float64)
    per_seq = _sequence_attention(lengths, np.ones(lengths.size), model, block_size)
    feats = grouped_dense(per_seq, Groups(np.zeros(lengths.size, dtype=np.int64), 1),
                          _head_pair_flops(model, block_size), model.heads, model.kv_heads)
    return {k: float(feats[k][0]) for k in DENSE_FEATURES}


def sparse_features(lengths, kept_fractions, model: ModelConfig, block_size: int) -> dict[str, float]:
    """Features of one sparse peer's attention call (one layer, forward) over a micro-batch of documents at these
    kept fractions: sim.backends.DENSE_FEATURES with the tokens padded to whole blocks and the kept blocks' FLOPs
    (sim.backends.grouped_sparse), which a sparse peer's terms are priced on."""
    lengths = np.asarray(lengths, dtype=np.float64)
    per_seq = _sequence_attention(lengths, np.asarray(kept_fractions, dtype=np.float64), model, block_size)
    feats = grouped_sparse(per_seq, Groups(np.zeros(lengths.size, dtype=np.int64), 1),
                           per_seq["flops"].sum(keepdims=True),
                           block_size, model.heads, model.kv_heads)
    return {k: float(feats[k][0]) for k in DENSE_FEATURES}


def layer_features(tokens: float, model: ModelConfig) -> dict[str, float]:
    """Features of one layer's non-attention work (forward). The LM head's matmul is spread over the layers;
    the input embedding is a lookup and costs no FLOPs."""
    shape = ModelShape.from_config(model)
    per_token = 2.0 * (shape.params_per_layer + shape.lm_head_params / shape.layers)
    return {"const": float(tokens > 0), "tokens": float(tokens), "flops": per_token * tokens}


def training_flops(lengths, kept_fractions, model: ModelConfig, block_size: int) -> float:
    """FLOPs a training step executes for these documents (backward counted as 2x forward, as in MFU)."""
    attn = attention_features(lengths, kept_fractions, model, block_size)["flops"]
    layer = layer_features(float(np.sum(lengths)), model)["flops"]
    return 3.0 * model.layers * (attn + layer)


# ----------------------------------------------------------------------------- cost records
@dataclass(frozen=True)
class MicroBatchCost:
    """One micro-batch on one pipeline stage, one CP rank and one TP rank, in milliseconds.

    ``fwd_ms``/``bwd_ms`` are what the stage is busy for: per layer, ``max(attention, CP transfer)``
    plus selection (forward only) plus the other layers plus the TP collectives. The component fields are
    totals over the stage's layers; ``cp_comm_ms`` is the (overlapped) ring transfer time of both directions,
    ``tp_comm_ms`` the (exposed) TP collectives of both (sim.tensor_parallel).
    """

    fwd_ms: float
    bwd_ms: float
    attn_fwd_ms: float
    attn_bwd_ms: float
    select_ms: float
    other_fwd_ms: float
    other_bwd_ms: float
    cp_comm_ms: float
    tokens: int
    dense: bool = False  # its attention runs on a dense peer (cost.attention_backend): kept 1, coverage 1
    backend: str = OURS  # the backend that runs its attention: ours or a peer's name (sim.backends.choose)
    tp_comm_ms: float = 0.0  # the TP collectives of both directions (and the recompute's), exposed


@dataclass(frozen=True)
class MicroBatchCosts:
    """MicroBatchCost for many micro-batches at once: each field an array indexed by group."""

    fwd_ms: np.ndarray
    bwd_ms: np.ndarray
    attn_fwd_ms: np.ndarray
    attn_bwd_ms: np.ndarray
    select_ms: np.ndarray
    other_fwd_ms: np.ndarray
    other_bwd_ms: np.ndarray
    cp_comm_ms: np.ndarray
    tokens: np.ndarray
    dense: np.ndarray  # bool per group: its attention runs on a dense peer (kept 1, coverage 1)
    backend: np.ndarray  # str per group: the backend that runs its attention (ours or a peer's name)
    tp_comm_ms: np.ndarray

    def __getitem__(self, group: int) -> MicroBatchCost:
        values = {f.name: float(getattr(self, f.name)[group]) for f in fields(self) if f.name not in NOT_TIMES}
        return MicroBatchCost(**values, tokens=int(self.tokens[group]), dense=bool(self.dense[group]),
                              backend=str(self.backend[group]))


NOT_TIMES = ("tokens", "dense", "backend")  # the MicroBatchCosts fields that are no times


# ----------------------------------------------------------------------------- models
class CostModel(ABC):
    """Shared decomposition; subclasses say how a term's per-layer time follows from its features."""

    # Activation checkpointing: the backward recomputes the layers' forward (attention and the other work, not
    # the selection, whose block lists are kept), so it is charged to the backward.
    recompute: bool = False
    # Which kernel runs each micro-batch's attention (CostConfig.attention_backend; sim.backends), and by how
    # much a sparse option must beat the fastest dense one under hybrid (CostConfig.hybrid_margin).
    attention_backend: str = OURS
    hybrid_margin: float = 0.0
    # The GEMMs' measured TP efficiency by degree (a profile's ``tp_efficiency``); None: the roofline's.
    tp_efficiency: dict[str, float] | None = None

    def __init__(self, model: ModelConfig, cluster: Cluster, block_size: int) -> None:
        if block_size < 1:
            raise ConfigError(f"cost.block_size={block_size} must be a positive integer")
        self.model = model
        self.cluster = cluster
        self.block_size = block_size
        # Peers the model prices, dense and sparse: name -> term -> feature -> ms per unit (a profile's
        # ``backends``, sim.backends).
        self.dense_terms: dict[str, dict[str, dict[str, float]]] = {}
        self.sparse_terms: dict[str, dict[str, dict[str, float]]] = {}

    # --- coverage model
    def kept_fraction(self, seq: Sequence, p: float) -> float:
        return float(self.kept_fractions(np.array([seq.length]), np.array([seq.sensitivity]), np.array([p]))[0])

    def coverage(self, seq: Sequence, kept_fraction: float) -> float:
        return float(self.coverages(np.array([seq.sensitivity]), np.array([kept_fraction]))[0])

    def block_counts(self, lengths) -> np.ndarray:
        """Each length's blocks: all that ``kept_fractions`` sees of a length (callers price each count once)."""
        return -(-np.asarray(lengths, dtype=np.int64) // self.block_size)

    def kept_fractions(self, lengths, sensitivities, p, fixed=None, top_k=None, p_floor=None) -> np.ndarray:
        """Vectorised kept_fraction; where ``fixed`` (a kept fraction) is not NaN it replaces p, and where
        ``top_k`` (blocks per query block) is not NaN the top-k rows replace it, raised to ``p_floor``'s
        top-p rows where that is not NaN (the row keeps the larger of the two sets)."""
        s = np.asarray(sensitivities, dtype=np.float64)
        top_k = None if top_k is None else np.asarray(top_k, dtype=np.float64)
        floor = None if p_floor is None else np.asarray(p_floor, dtype=np.float64)
        unset = None if top_k is None else np.isnan(top_k)
        p = np.asarray(p, dtype=np.float64)
        # where every row is a top-k one p decides nothing, and its power (the costliest step) is left out; a
        # product of the same operands lays the result out in memory as the power would (a later mean over
        # samples adds in that order)
        kf = np.power(p, 1.0 / s) if unset is None or unset.any() else np.multiply(p, s)
        if fixed is not None:
            fixed = np.asarray(fixed, dtype=np.float64)
            kf = np.where(np.isnan(fixed), kf, fixed)
        if unset is not None and not unset.all():
            rows = topk_kept_fraction(lengths, np.where(unset, 1.0, top_k), self.block_size)
            if floor is not None and not np.isnan(floor).all():
                with np.errstate(invalid="ignore"):
                    raised = np.power(floor, 1.0 / s)
                rows = np.where(np.isnan(floor), rows, np.maximum(rows, raised))
            kf = np.where(unset, kf, rows)
        return np.maximum(kf, diag_fraction(lengths, self.block_size))

    @staticmethod
    def coverages(sensitivities, kept_fractions) -> np.ndarray:
        return np.minimum(1.0, np.power(np.asarray(kept_fractions, dtype=np.float64), sensitivities))

    # --- time
    @abstractmethod
    def term_ms(self, term: str, feats: dict[str, np.ndarray]) -> np.ndarray:
        """Per-layer time of one term for feature arrays (one entry per micro-batch)."""

    @abstractmethod
    def launch_ms(self, term: str, const: np.ndarray) -> np.ndarray:
        """The part of ``term_ms`` that is the calls' launches (``const``: calls per micro-batch), which each TP
        rank pays whole."""

    def micro_batch_cost(self, lengths, kept_fractions, layout: Layout) -> MicroBatchCost:
        lengths = np.asarray(lengths, dtype=np.int64)
        return self.micro_batch_costs(lengths, kept_fractions, np.zeros(lengths.size, dtype=np.int64), 1, layout)[0]

    def sequence_costs(self, lengths, kept_fractions, layout: Layout) -> np.ndarray:
        """Busy time (fwd + bwd, ms) of each sequence as if alone in a micro-batch: the policies' workload cost."""
        lengths = np.asarray(lengths, dtype=np.int64)
        costs = self.micro_batch_costs(lengths, kept_fractions, np.arange(lengths.size), lengths.size, layout)
        return costs.fwd_ms + costs.bwd_ms

    def micro_batch_costs(self, lengths, kept_fractions, group, n_groups: int, layout: Layout,
                          ran=None) -> MicroBatchCosts:
        """Costs of ``n_groups`` micro-batches; ``group[i]`` is the micro-batch of sequence i. ``ran``: the backend
        each micro-batch's attention ran on (a run's record, replayed) in place of the mode's choice.

        ``kept_fractions`` of shape ``[R, n]`` prices R replicas of the batch at once (the same lengths and
        micro-batches, other kept fractions): micro-batch ``r * n_groups + g`` is micro-batch g of replica r,
        the same figures as the replicas laid end to end (sim.groups)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        kept = np.asarray(kept_fractions, dtype=np.float64)
        groups = Groups(group, n_groups, kept.shape[0] if kept.ndim == 2 else 1)
        if ran is not None and groups.replicas > 1:
            raise ValueError("a run's backends (ran) price one batch, not replicas of it")
        mode = self.attention_backend
        # the options: every peer (hybrid, or a replay of what ran), ours and the dense peers (dense_best), or ours
        if mode == "hybrid" or ran is not None:
            sparse_peers = self.sparse_backends()
        elif mode == "dense_best":
            sparse_peers = ()
        else:
            sparse_peers = None
        options, tokens = self._options(lengths, kept, groups, layout, sparse_peers)
        layer = {k: v / layout.cp if k != "const" else v for k, v in self._layer(tokens).items()}
        comm_f, comm_b = self._cp_comm(tokens, layout)
        tp_f, tp_b = tp_split.comm_ms(tokens, self.model, layout, self.cluster)
        a_f, a_b, sel = options[OURS]
        if ran is not None:
            backend = self._priced(ran, options)
        elif mode == OURS:
            backend = np.full(groups.size, OURS)
        else:
            backend = choose(mode, {name: self._attention_ms(o, comm_f, comm_b) for name, o in options.items()},
                             self.dense_backends(), self.hybrid_margin)
        if (backend != OURS).any():
            runs = [backend == name for name in options]
            a_f, a_b, sel = (np.select(runs, [o[i] for o in options.values()]) for i in range(3))
        o_f, o_b = self._layer_ms(layer, layout)
        n_layers = self.model.layers / layout.pp
        recomputed = np.maximum(a_f, comm_f) + o_f + tp_f if self.recompute else 0.0
        return MicroBatchCosts(
            fwd_ms=n_layers * (np.maximum(a_f, comm_f) + sel + o_f + tp_f),
            bwd_ms=n_layers * (np.maximum(a_b, comm_b) + o_b + recomputed + tp_b),
            attn_fwd_ms=n_layers * a_f,
            attn_bwd_ms=n_layers * a_b,
            select_ms=n_layers * sel,
            other_fwd_ms=n_layers * o_f,
            other_bwd_ms=n_layers * o_b,
            cp_comm_ms=n_layers * (comm_f + comm_b),
            tokens=tokens.astype(np.int64),
            dense=np.isin(backend, self.dense_backends()),
            backend=backend,
            tp_comm_ms=n_layers * (tp_f + tp_b + (tp_f if self.recompute else 0.0)),
        )

    def _layer_ms(self, layer: dict[str, np.ndarray], layout: Layout) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) per layer of the non-attention work on one rank: split over the TP ranks at the
        GEMMs' efficiency (sim.tensor_parallel), the launches paid by every rank."""
        times = self._term("layer_fwd", layer), self._term("layer_bwd", layer)
        if layout.tp == 1:
            return times
        eff = tp_split.gemm_efficiency(layer["tokens"], self.model, layout, self.cluster, self.tp_efficiency)
        return tuple(tp_split.split_ms(t, self.launch_ms(term, layer["const"]), layout.tp, eff)
                     for t, term in zip(times, ("layer_fwd", "layer_bwd"), strict=True))

    @staticmethod
    def _priced(ran, options: dict) -> np.ndarray:
        """``ran`` (names) as an array, each a backend among ``options`` (a ConfigError names the first that is not)."""
        ran = np.asarray(ran, dtype=str)
        unpriced = sorted(set(ran.tolist()) - options.keys())
        if unpriced:
            raise ConfigError(f"a micro-batch ran its attention on {unpriced[0]}, which the cost profile does not "
                              f"price; allowed: {', '.join(options)} (a profile that prices every backend the run "
                              "used)")
        return ran

    def dense_backends(self) -> tuple[str, ...]:
        """The dense peers this model prices (a profile's ``backends`` without ``sparse``), by name."""
        return tuple(sorted(self.dense_terms))

    def sparse_backends(self) -> tuple[str, ...]:
        """The sparse peers this model prices (a profile's ``backends`` with ``"sparse": true``), by name."""
        return tuple(sorted(self.sparse_terms))

    def _options(self, lengths, kept, groups: Groups, layout: Layout,
                 sparse_peers: tuple[str, ...] | None) -> tuple[dict[str, tuple], np.ndarray]:
        """(attn_fwd, attn_bwd, select) per layer of each micro-batch on ours, then (``sparse_peers`` not None)
        on every dense peer and each of ``sparse_peers`` (sim.backends.peer_options); and its tokens."""
        model = tp_split.rank_model(self.model, layout.tp)  # a TP rank runs its share of the heads
        per_seq = _sequence_attention(lengths, kept, model, self.block_size)
        summed = summed_features(per_seq, groups, layout.cp)
        attn = self._attention(per_seq, summed, groups, layout.cp, lengths, kept)
        select = select_features(per_seq, summed, kept, groups, layout.cp)
        options = {OURS: (self._term("attn_fwd", attn), self._term("attn_bwd", attn), self._term("select", select))}
        if sparse_peers is not None:
            shape = (_head_pair_flops(model, self.block_size), self.block_size, model.heads, model.kv_heads, layout.cp)
            options |= peer_options(self.dense_terms, {n: self.sparse_terms[n] for n in sparse_peers}, per_seq,
                                    groups, attn["flops"], options[OURS][2], *shape)
        return options, attn["tokens"] * layout.cp  # back to the micro-batch's tokens (features are per CP rank)

    def _attention_ms(self, option: tuple, comm_f: np.ndarray, comm_b: np.ndarray) -> np.ndarray:
        """What an option's attention adds to a micro-batch per layer: its forward behind the CP ring (again
        in the backward under activation checkpointing), its selection and its backward behind the ring."""
        a_f, a_b, sel = option
        return np.maximum(a_f, comm_f) * (1.0 + self.recompute) + sel + np.maximum(a_b, comm_b)

    def attention_options(self, lengths, kept_fractions, layout: Layout) -> dict[str, np.ndarray]:
        """Attention per layer (forward, backward and selection, behind the CP ring) of each sequence alone in a
        micro-batch: ``ours`` and each sparse peer at its kept fraction, each dense peer at kept 1 (the
        break-even table)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        options, tokens = self._options(lengths, np.asarray(kept_fractions, dtype=np.float64),
                                        Groups(np.arange(lengths.size), lengths.size), layout, self.sparse_backends())
        comm_f, comm_b = self._cp_comm(tokens, layout)
        return {name: self._attention_ms(o, comm_f, comm_b) for name, o in options.items()}

    def _term(self, term: str, feats: dict[str, np.ndarray]) -> np.ndarray:
        """``term_ms`` on the features that term is priced on (PROFILE_FEATURES)."""
        return self.term_ms(term, {f: feats[f] for f in PROFILE_FEATURES[term]})

    def _attention(self, per_seq: dict, summed: dict, groups: Groups, cp: int, lengths,
                   kept) -> dict[str, np.ndarray]:
        """The attention features of each micro-batch (:func:`grouped_attention`).

        Under CP the kept blocks fall on the ranks as the sparse selection puts them (``sim.cp_shards``), and
        the features are those of the micro-batch's slowest rank, since the ring synchronises the ranks every
        layer. That is the rank with the most kept FLOPs: the other features (tokens, causal blocks,
        programs, the longest programs) stay 1/cp, as the selection does not change which tokens and blocks a
        rank holds, and every attention term's time grows with ``flops`` (and with ``dkdv_path``, the larger
        of the longest dK/dV program and the kept work over DKDV_SLOTS), its coefficients being >= 0.
        """
        extra = (slowest_rank_extra(groups.spread(per_seq["flops"]), np.tile(lengths, groups.replicas),
                                    groups.spread(kept), groups.flat, groups.size, cp, self.block_size)
                 if cp > 1 else 0.0)
        # the launch features read the GQA group and head_dim, which a TP rank's share of the heads keeps
        return grouped_attention(per_seq, groups, self.model, self.block_size, cp, extra, summed)

    def _layer(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        per_token = layer_features(1.0, self.model)["flops"]
        return {"const": (tokens > 0).astype(np.float64), "tokens": tokens, "flops": per_token * tokens}

    def hand_off_ms(self, tokens: np.ndarray, layout: Layout) -> np.ndarray:
        """Stage-to-stage transfer per micro-batch of ``tokens``: a stage hands on its CP shard of the
        activations (forward) or their gradients (backward), each TP rank its sequence-parallel part of it;
        nothing without pipeline stages."""
        if layout.pp == 1:
            return np.zeros(np.shape(tokens))
        nbytes = tokens * (self.model.hidden * BF16 / (layout.cp * layout.tp))
        return np.where(tokens > 0, self.cluster.p2p_ms(nbytes, layout), 0.0)

    def _cp_comm(self, tokens: np.ndarray, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer ring exchange: forward passes K and V shards, backward K, V plus their gradients; a TP rank
        exchanges its KV heads with the ranks of the same TP index, tp apart."""
        if layout.cp == 1:
            zero = np.zeros_like(tokens)
            return zero, zero
        tier = self.cluster.tier(layout.cp * layout.tp)
        kv_heads = tp_split.rank_model(self.model, layout.tp).kv_heads
        shard = tokens / layout.cp * kv_heads * self.model.head_dim * 2 * BF16
        hops = layout.cp - 1
        busy = (tokens > 0) * tier.latency_us * 1e-3
        fwd = hops * (busy + shard / (tier.bandwidth_gbps * 1e6))
        bwd = hops * (busy + 2 * shard / (tier.bandwidth_gbps * 1e6))
        return fwd, bwd


# The keys only the roofline model reads, beside the block size.
ROOFLINE_KEYS = ("attn_efficiency", "matmul_efficiency", "attn_bwd_ratio", "launch_ms")


class RooflineCost(CostModel):
    """FLOPs over peak x efficiency; dense layers also bounded below by streaming their weights."""

    def __init__(self, model: ModelConfig, cluster: Cluster, cfg: CostConfig) -> None:
        if cfg.block_size is None:
            raise ConfigError("cost.block_size is not set; cost=roofline needs a block size (allowed: 16 to 1024, "
                              "conf/cost/roofline.yaml sets 128)")
        super().__init__(model, cluster, cfg.block_size)
        for name in ("attn_efficiency", "matmul_efficiency"):
            if not 0 < getattr(cfg, name) <= 1:
                raise ConfigError(f"cost.{name}={getattr(cfg, name)} must be in (0, 1]")
        self.cfg = cfg
        self.attn_flops_per_ms = cluster.peak_tflops * 1e9 * cfg.attn_efficiency
        self.mm_flops_per_ms = cluster.peak_tflops * 1e9 * cfg.matmul_efficiency
        self.hbm_bytes_per_ms = cluster.hbm_tbps * 1e9

    def term_ms(self, term: str, feats: dict[str, np.ndarray]) -> np.ndarray:
        launch = self.cfg.launch_ms * feats["const"]
        if term == "attn_fwd":
            return launch + feats["flops"] / self.attn_flops_per_ms
        if term == "attn_bwd":
            return launch + self.cfg.attn_bwd_ratio * feats["flops"] / self.attn_flops_per_ms
        if term == "select":
            # Scores of pooled query/key blocks (one dot product per block pair and head), and reading
            # Q and K once to pool them.
            scores = 2.0 * self.model.head_dim * feats["blocks"] / self.attn_flops_per_ms
            pooled = feats["tokens"] * (self.model.heads + self.model.kv_heads) * self.model.head_dim * BF16
            return launch + scores + pooled / self.hbm_bytes_per_ms
        weights = feats["const"] * ModelShape.from_config(self.model).params_per_layer * BF16 / self.hbm_bytes_per_ms
        passes = 1.0 if term == "layer_fwd" else 2.0  # backward: activation and weight gradients
        return launch + passes * np.maximum(feats["flops"] / self.mm_flops_per_ms, weights)

    def launch_ms(self, term: str, const: np.ndarray) -> np.ndarray:
        return self.cfg.launch_ms * const


class CalibratedCost(CostModel):
    """Linear model over the features, coefficients (ms per feature unit) from a profile file."""

    def __init__(self, model: ModelConfig, cluster: Cluster, cfg: CostConfig) -> None:
        self.profile = load_profile(cfg.profile)
        check_calibrated_keys(cfg, self.profile)
        super().__init__(model, cluster, self.profile["block_size"])
        peers = self.profile.get("backends", {})
        self.dense_terms = {name: entry["terms"] for name, entry in peers.items() if not is_sparse(entry)}
        self.sparse_terms = {name: entry["terms"] for name, entry in peers.items() if is_sparse(entry)}
        self.tp_efficiency = self.profile.get("tp_efficiency")

    def term_ms(self, term: str, feats: dict[str, np.ndarray]) -> np.ndarray:
        coefs = self.profile["terms"][term]
        return sum((c * feats[f] for f, c in coefs.items()), np.zeros_like(feats["const"]))

    def launch_ms(self, term: str, const: np.ndarray) -> np.ndarray:
        return self.profile["terms"][term]["const"] * const


def check_calibrated_keys(cfg: CostConfig, profile: dict) -> None:
    """Under a profile, the roofline's keys are not read: one ConfigError line for any set to other than its
    default, and for a block size other than the profile's (the block its kernel times were measured at, which
    the simulator and the runner's kernel then use)."""
    block = profile["block_size"]
    if cfg.block_size is not None and cfg.block_size != block:
        raise ConfigError(f"cost.block_size={cfg.block_size}: the profile {cfg.profile} was measured at block size "
                          f"{block}, which cost=calibrated runs at; allowed: cost.block_size={block} (or unset), "
                          f"cost=roofline cost.block_size={cfg.block_size}, or a profile calibrated at that block "
                          f"(python -m calibrate.run --block-size on a GPU)")
    given = [key for key in ROOFLINE_KEYS if getattr(cfg, key) != getattr(CostConfig, key)]
    if given:
        raise ConfigError(f"cost.{given[0]}={getattr(cfg, given[0])} is read by cost=roofline only; under "
                          f"cost=calibrated the profile's fitted coefficients price the kernels: drop it, or use "
                          f"cost=roofline cost.{given[0]}={getattr(cfg, given[0])}")


COST_MODELS: dict[str, type[CostModel]] = {"roofline": RooflineCost, "calibrated": CalibratedCost}


def make_cost(cfg: CostConfig, model: ModelConfig, cluster: Cluster, *, recompute: bool) -> CostModel:
    """The cost model a config names. ``recompute``: activation checkpointing is on (``memory.
    activation_checkpointing``), so every backward also runs its layers' forward again."""
    if cfg.name not in COST_MODELS:
        raise ConfigError(f"cost.name={cfg.name!r} is unknown; allowed: {', '.join(sorted(COST_MODELS))}")
    cost = COST_MODELS[cfg.name](model, cluster, cfg)
    cost.recompute = recompute
    cost.attention_backend = mode = str(getattr(cfg.attention_backend, "value", cfg.attention_backend))
    cost.hybrid_margin = cfg.hybrid_margin
    missing = missing_peers(mode, cost.dense_terms, cost.sparse_terms)
    if missing:
        where = f"profile {cfg.profile}" if cfg.name == "calibrated" else f"cost.name={cfg.name}"
        raise ConfigError(f"cost.attention_backend={mode}: the {where} prices no {missing}; "
                          f"allowed: {OURS}, or a profile with a 'backends' section (python -m calibrate.run on a "
                          "GPU with the peers installed, then calibrate.fit)")
    return cost
