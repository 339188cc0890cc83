"""The calibration grid: which batches are timed, which are held out of the fit, and what each should cost.

A point is one packed varlen batch (sequence lengths + a kept fraction per sequence) on one model. Its
``kind`` says what is timed: ``attn`` (selection, attention forward and backward), ``layer`` (the
non-attention work of one transformer layer) or ``layer_full`` (a whole layer, forward and backward, with
the real kernel: never fitted, used to check that the fitted terms add up to a layer). A point of a peer
attention backend (``backend``, a name of ``kernels.backends`` other than ``ours``) times that backend's forward
and backward: a dense peer's on all the causal blocks of its documents (:func:`dense_points`), a sparse peer's on
the blocks our selection keeps at our attention points' kept fractions (:func:`sparse_points`).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

from sparsebalance.sim.backends import DENSE_TERMS, OURS
from sparsebalance.sim.gpu_kinds import default_kind
from sparsebalance.sim.shapes import ModelShape

K = 1024
SINGLE_LENGTHS = (1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K)
KEPT_FRACTIONS = (1.0, 0.5, 0.25, 0.1, 0.05, 0.02)
# Packed micro-batches as a length-sorted dataloader would build them (one long sequence plus a tail).
PACKS = (
    (4 * K,) * 4,
    (2 * K,) * 16,
    (16 * K, 8 * K, 4 * K, 2 * K, 1 * K, 1 * K),
    (32 * K, 16 * K, 8 * K, 4 * K, 2 * K, 1 * K, 1 * K),
    (64 * K, 32 * K, 16 * K, 8 * K, 4 * K, 4 * K),
)
# Per-sequence budgets cycled over a pack: the mixed-budget batches a sparsity policy produces.
MIXED_BUDGETS = (0.25, 1.0, 0.05, 0.5, 0.1, 0.02)
# Whole layers timed to check the sum of the fitted terms (all held out).
LAYER_FULL = (
    ((4 * K,), (1.0,)),
    ((16 * K,), (0.25,)),
    ((64 * K,), (0.1,)),
    (PACKS[2], None),  # None: MIXED_BUDGETS cycled
    (PACKS[3], None),
)
# Validation micro-batches: packed, mixed budgets, lengths and budgets that appear nowhere in the grid
# (including lengths that are not block multiples); all within the shortest model context (32K).
VALIDATION = (
    ((24 * K, 6 * K, 1536, 512), (0.15, 0.6, 1.0, 1.0)),
    ((30000, 20 * K, 10 * K, 3000), (0.04, 0.3, 0.8, 0.08)),
    ((12 * K, 12 * K, 5 * K, 2560, 777), (0.5, 0.03, 0.2, 1.0, 0.07)),
)
# The kernel's cost grows with kept causal work ~ kf * T^2; beyond dense 64K a point costs seconds per
# timing while adding no new range to a fit that is linear in that work, so such points are left out.
MAX_KEPT_WORK = (64 * K) ** 2
TERMS = {
    "attn": ("select", "attn_fwd", "attn_bwd"),
    # layer_step: forward and backward in one call, as a whole layer runs them (the layer_full points' gap)
    "layer": ("layer_fwd", "layer_bwd", "layer_step"),
    "layer_full": ("layer_full",),
}


@dataclass(frozen=True)
class GridPoint:
    kind: str
    model: str
    lengths: tuple[int, ...]
    kept_fractions: tuple[float, ...]
    split: str = "fit"
    backend: str = OURS  # a peer's points are keyed <kind>@<backend>

    @property
    def key(self) -> str:
        lengths = "+".join(map(str, self.lengths))
        kept = "+".join(f"{f:g}" for f in self.kept_fractions)
        kind = self.kind if self.backend == OURS else f"{self.kind}@{self.backend}"
        return f"{kind}|{self.model}|{lengths}|{kept}"

    @staticmethod
    def budgets_of(key: str) -> tuple[float, ...]:
        """The budgets a point's ``key`` asked for (its last field; the kept fractions realised may differ)."""
        return tuple(float(f) for f in key.rsplit("|", 1)[1].split("+"))

    @property
    def terms(self) -> tuple[str, ...]:
        return TERMS[self.kind] if self.backend == OURS else DENSE_TERMS

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def kept_work(lengths: tuple[int, ...], kept_fractions: tuple[float, ...]) -> float:
    """Kept causal query-key pairs / 0.5 (so dense T tokens gives T^2): the grid's size measure."""
    return sum(f * n * n for n, f in zip(lengths, kept_fractions, strict=True))


def _heldout(key: str, edge: bool) -> bool:
    """A stable third of the interior points; edges stay in the fit so held-out points interpolate."""
    return not edge and zlib.crc32(key.encode()) % 3 == 0


def _with_split(point: GridPoint, edge: bool) -> GridPoint:
    split = "heldout" if _heldout(point.key, edge) else "fit"
    return GridPoint(point.kind, point.model, point.lengths, point.kept_fractions, split)


def _cycle(values: tuple[float, ...], n: int) -> tuple[float, ...]:
    return tuple(values[i % len(values)] for i in range(n))


def _singles(shape: ModelShape) -> list[tuple[int, ...]]:
    return [(n,) for n in SINGLE_LENGTHS if n <= shape.max_context]


def _packs(shape: ModelShape) -> list[tuple[int, ...]]:
    return [p for p in PACKS if max(p) <= shape.max_context]


def attention_points(shape: ModelShape) -> list[GridPoint]:
    singles = _singles(shape)
    edges = (singles[0], singles[-1])
    points = []
    batches = [(n, (f,)) for n in singles for f in KEPT_FRACTIONS]
    batches += [(pack, (f,) * len(pack)) for pack in _packs(shape) for f in KEPT_FRACTIONS[::2]]
    batches += [(pack, _cycle(MIXED_BUDGETS, len(pack))) for pack in _packs(shape)]
    for lengths, kept in batches:
        if kept_work(lengths, kept) > MAX_KEPT_WORK:
            continue
        uniform = len(set(kept)) == 1
        edge = lengths in edges or (uniform and kept[0] in (1.0, KEPT_FRACTIONS[-1]))
        points.append(_with_split(GridPoint("attn", shape.name, lengths, kept), edge))
    return points


def layer_points(shape: ModelShape) -> list[GridPoint]:
    singles = _singles(shape)
    return [
        _with_split(GridPoint("layer", shape.name, b, (1.0,) * len(b)), edge=b in (singles[0], singles[-1]))
        for b in singles + _packs(shape)
    ]


def layer_full_points(shape: ModelShape) -> list[GridPoint]:
    return [
        GridPoint("layer_full", shape.name, lengths, kept or _cycle(MIXED_BUDGETS, len(lengths)), "heldout")
        for lengths, kept in LAYER_FULL
        if max(lengths) <= shape.max_context
    ]


def validation_points(shape: ModelShape) -> list[GridPoint]:
    return [
        GridPoint("layer_full", shape.name, lengths, kept, "validate")
        for lengths, kept in VALIDATION
        if max(lengths) <= shape.max_context
    ]


def dense_points(shape: ModelShape, backend: str) -> list[GridPoint]:
    """A dense backend's points: the documents of the attention grid, all kept (a dense call has no kept
    fraction), within MAX_KEPT_WORK; and the validation micro-batches' documents, held out. The same documents
    are held out as for our kernel's dense points, the shortest and longest single documents never."""
    singles = [n for n in _singles(shape) if kept_work(n, (1.0,)) <= MAX_KEPT_WORK]
    batches = dict.fromkeys(p.lengths for p in attention_points(shape)
                            if kept_work(p.lengths, (1.0,) * len(p.lengths)) <= MAX_KEPT_WORK)
    points = []
    for lengths in batches:
        ours = GridPoint("attn", shape.name, lengths, (1.0,) * len(lengths))
        split = "heldout" if _heldout(ours.key, lengths in (singles[0], singles[-1])) else "fit"
        points.append(GridPoint("attn", shape.name, lengths, ours.kept_fractions, split, backend))
    points += [GridPoint("attn", shape.name, lengths, (1.0,) * len(lengths), "heldout", backend)
               for lengths, _ in VALIDATION if max(lengths) <= shape.max_context]
    return points


def sparse_points(shape: ModelShape, backend: str) -> list[GridPoint]:
    """A sparse peer's points: our attention points (the same documents, kept fractions and splits), and the
    validation micro-batches' documents and kept fractions, held out (their lengths are no block multiples, so
    the padding shows there)."""
    points = [replace(p, backend=backend) for p in attention_points(shape)]
    return points + [GridPoint("attn", shape.name, lengths, kept, "heldout", backend)
                     for lengths, kept in VALIDATION if max(lengths) <= shape.max_context]


def build_grid(models: list[ModelShape], backends: tuple[str, ...] = (),
               sparse: tuple[str, ...] = ()) -> list[GridPoint]:
    """Every point for these models, every dense point of the dense peers ``backends`` and every point of the
    sparse peers ``sparse`` (names of kernels.backends besides ours); validation first so a cut-short run still
    has it, then cheap to dear.

    Sequences never exceed a model's context (``max_context``).
    """
    points: list[GridPoint] = []
    for m in models:
        points += attention_points(m) + layer_points(m) + layer_full_points(m)
        points += [p for backend in backends for p in dense_points(m, backend)]
        points += [p for backend in sparse for p in sparse_points(m, backend)]
    by_name = {m.name: m for m in models}
    points.sort(key=lambda p: estimate_point_ms(p, by_name[p.model]))
    return [v for m in models for v in validation_points(m)] + points


# Rough rates for sizing the run (repetitions, ordering, the dry-run estimate), not for the fit: shares of the
# default GPU kind's dense peak, as an H200 reached about 250 and 600 of its 989 TFLOP/s in attention and GEMMs.
ATTN_PEAK_SHARE = 250 / 989
GEMM_PEAK_SHARE = 600 / 989
_LAUNCH_MS = 0.05


def estimate_term_ms(term: str, point: GridPoint, shape: ModelShape) -> float:
    """Roofline guess of one call's time in ms."""
    attn_fwd = 2.0 * kept_work(point.lengths, point.kept_fractions) * shape.heads * shape.head_dim
    peak = default_kind().peak_tflops
    attn_tflops, gemm_tflops = peak * ATTN_PEAK_SHARE, peak * GEMM_PEAK_SHARE
    attn_ms = attn_fwd / (attn_tflops * 1e9)
    gemm_ms = 2.0 * point.tokens * shape.params_per_layer / (gemm_tflops * 1e9)
    select_ms = 4.0 * point.tokens * shape.heads * shape.head_dim / (attn_tflops * 1e9)
    by_term = {
        "select": select_ms,
        "attn_fwd": attn_ms,
        "attn_bwd": 2.5 * attn_ms,
        "layer_fwd": gemm_ms,
        "layer_bwd": 2.0 * gemm_ms,
        "layer_step": 3.0 * gemm_ms,
        "layer_full": select_ms + 3.5 * attn_ms + 3.0 * gemm_ms,
    }
    return _LAUNCH_MS + by_term[term]


def estimate_point_ms(point: GridPoint, shape: ModelShape) -> float:
    return sum(estimate_term_ms(t, point, shape) for t in point.terms)
