"""How a sparse selection's kept blocks fall on the CP ranks of zigzag-sharded sequences.

Sharding follows the runner (``runner.cp.Shards``): a sequence of ``L`` tokens is cut into ``2 cp`` chunks,
chunk ``j`` being its tokens ``[floor(j L / 2cp), floor((j + 1) L / 2cp))``, and CP rank ``i`` holds chunks
``i`` and ``2cp - 1 - i``. Chunks are not block-aligned, so the work is counted per query token: a token of
row ``r`` attends the row's kept key blocks, and a block whose tokens two ranks hold is split between them by
its tokens (the last, partial block weighs only the tokens it has).

Kept rows: query block row ``r`` has ``r + 1`` causal key blocks; the selection always keeps the diagonal and
about a fixed fraction of the row otherwise, so the model keeps ``kept_r = max(1, c (r + 1))`` blocks (at most
``r + 1``), with ``c`` solved per sequence so that the rows sum to its kept fraction of its causal blocks. The
early rows are floored at one block, so at high sparsity the kept work leans towards the start of the
sequence compared with the dense triangle, and the rank holding the first chunk does more than 1/cp of it.

The cost model prices dense work as balanced over the ranks (1/cp each). What the selection changes is
``kept_share_shift``: each rank's share of the kept work minus its share of the dense work under the same
shards, exactly zero for a dense sequence, so the dense price (and the chunks' token rounding it leaves out)
stays as it is. ``slowest_rank_extra`` turns the shifts into the kept work of each micro-batch's most loaded
rank, which is what ``sim.cost`` prices. Everything is closed form per sequence (a prefix sum of the kept rows
at the ``2 cp + 1`` chunk bounds), vectorised over sequences, because the cost model runs for every candidate
micro-batch of every step.
"""
from __future__ import annotations

import numpy as np

GAP_SLICE = 2048  # sequences per pass of distinct_gaps


def zigzag_bounds(lengths, cp: int) -> np.ndarray:
    """``[2cp + 1, n]`` token offsets of each sequence's chunks (column ``s``: the runner's ``shard_bounds``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return (np.arange(2 * cp + 1, dtype=np.int64)[:, None] * lengths[None, :]) // (2 * cp)


def kept_rows(n_blocks, kept) -> tuple[np.ndarray, np.ndarray]:
    """``(floored, slope)`` per sequence: its first ``floored`` rows keep one block, row ``r >= floored`` keeps
    ``slope * (r + 1)``, and the rows sum to ``kept * nb (nb + 1) / 2`` (clipped to one block per row at least
    and the causal blocks at most).

    The sum at ``slope = 1 / x`` is ``g(x) = x / 2 - 1 / 2 + S / x`` (``S`` the causal blocks), decreasing on
    ``[1, nb]``; the floored count is the integer part of the root of ``g(x) = T``, and the slope then
    follows exactly from the rows' sum.
    """
    nb = np.asarray(n_blocks, dtype=np.float64)
    causal = nb * (nb + 1.0) / 2.0
    target = np.clip(np.asarray(kept, dtype=np.float64) * causal, nb, causal)
    b = 2.0 * target + 1.0
    # The smaller root of x^2 - b x + 2S = 0, written as 2S over the larger one (no cancellation near dense).
    root = 4.0 * causal / np.maximum(b + np.sqrt(np.maximum(b * b - 8.0 * causal, 0.0)), 1.0)
    floored = np.clip(np.floor(root), 1.0, np.maximum(nb, 1.0))
    rest = causal - floored * (floored + 1.0) / 2.0  # causal blocks of the rows above the floor
    slope = np.where(rest > 0, (target - floored) / np.where(rest > 0, rest, 1.0), 0.0)
    return floored, slope


def kept_before(rows, floored, slope) -> np.ndarray:
    """Kept blocks of the rows ``[0, rows)`` (broadcasting ``floored``/``slope`` of ``kept_rows``)."""
    above = slope * (rows * (rows + 1.0) / 2.0 - floored * (floored + 1.0) / 2.0)
    return np.where(rows <= floored, rows, floored + above)


def kept_in_row(row, floored, slope) -> np.ndarray:
    """Kept blocks of row ``row``: the step of ``kept_before`` from ``row`` to ``row + 1``."""
    return np.where(row < floored, 1.0, slope * (row + 1.0))


def share_gap(lengths, kept, cp: int, block_size: int) -> np.ndarray:
    """``[2cp + 1, n]``: the share of each sequence's kept work that lies before each chunk bound, minus the
    same share of its dense work.

    Work is key blocks x query tokens: the whole rows before a bound's row (every one full: only a
    sequence's last row is partial) plus the bound's row's tokens before it, each doing that row's blocks.
    """
    bounds = zigzag_bounds(lengths, cp)
    row = bounds // block_size
    inside = (bounds - row * block_size).astype(np.float64)
    row = row.astype(np.float64)
    floored, slope = kept_rows(-(-np.asarray(lengths, dtype=np.int64) // block_size), kept)
    sparse = block_size * kept_before(row, floored, slope) + inside * kept_in_row(row, floored, slope)
    dense = block_size * row * (row + 1.0) / 2.0 + inside * (row + 1.0)
    return sparse / np.maximum(sparse[-1], 1e-300) - dense / np.maximum(dense[-1], 1e-300)


def rank_work(at_bounds: np.ndarray, cp: int) -> np.ndarray:
    """``[cp, n]``: each rank's work, its chunks ``i`` and ``2cp - 1 - i``, from the work before every bound
    (``[2cp + 1, n]``)."""
    chunks = np.diff(at_bounds, axis=0)
    return chunks[:cp] + chunks[::-1][:cp]


def distinct_gaps(lengths, kept, cp: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(gaps, inverse)``: ``gaps[:, inverse]`` is ``[cp, n]``, each CP rank's share of each sequence's kept
    work minus its share of the dense work (``rank_work`` of ``share_gap``).

    Callers price many candidate micro-batches of the same few sequences, so each distinct (length, kept)
    pair is worked out once. The key ``length + kept`` tells pairs apart unless two kept fractions differ by
    less than a rounding step of the sum, which the check below catches: then every sequence is worked out
    on its own.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    kept = np.asarray(kept, dtype=np.float64)
    keys, inverse = np.unique(lengths + kept, return_inverse=True)
    inverse = inverse.ravel()
    some = np.empty(keys.size, dtype=np.int64)
    some[inverse] = np.arange(lengths.size)  # one sequence of each key, whichever: all of them are alike
    if not (np.array_equal(lengths[some][inverse], lengths) and np.array_equal(kept[some][inverse], kept)):
        some, inverse = np.arange(lengths.size), np.arange(lengths.size)
    lengths, kept = lengths[some], kept[some]
    gaps = np.empty((cp, lengths.size))
    # In slices of sequences whose temporaries ([2cp + 1, slice]) stay in the CPU's cache: each sequence's
    # figures are its own, so the slices give the same bits as one pass.
    for start in range(0, lengths.size, GAP_SLICE):
        part = slice(start, start + GAP_SLICE)
        gaps[:, part] = rank_work(share_gap(lengths[part], kept[part], cp, block_size), cp)
    return gaps, inverse


def kept_share_shift(lengths, kept, cp: int, block_size: int) -> np.ndarray:
    """``[cp, n]``: how much of each sequence's kept work each CP rank holds beyond its dense share.

    Rank ``i`` of sequence ``s`` does ``1/cp + shift[i, s]`` of the sequence's kept blocks; the shifts of a
    sequence sum to zero, and they are exactly zero where the sequence is dense (``kept >= 1``) or ``cp == 1``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    kept = np.asarray(kept, dtype=np.float64)
    shift = np.zeros((cp, lengths.size))
    sparse = np.flatnonzero(kept < 1.0)
    if cp > 1 and sparse.size:
        gaps, inverse = distinct_gaps(lengths[sparse], kept[sparse], cp, block_size)
        shift[:, sparse] = gaps[:, inverse]
    return shift


def slowest_rank_extra(values, lengths, kept, group, n_groups: int, cp: int, block_size: int) -> np.ndarray:
    """``[n_groups]``: how much more than 1/cp of its micro-batch's summed ``values`` (per sequence: its kept
    work, e.g. FLOPs) the most loaded CP rank holds; 0 where every sequence is dense or ``cp == 1``.

    One rank at a time, so that the temporaries stay the size of the sequences, not cp times it.
    """
    kept = np.asarray(kept, dtype=np.float64)
    sparse = np.flatnonzero(kept < 1.0)
    worst = np.zeros(n_groups)
    if cp == 1 or not sparse.size:
        return worst
    gaps, inverse = distinct_gaps(np.asarray(lengths)[sparse], kept[sparse], cp, block_size)
    weights = np.asarray(values, dtype=np.float64)[sparse]
    where = np.asarray(group, dtype=np.int64)[sparse]
    # Starting from 0 loses nothing: a micro-batch's extras over its ranks sum to zero, so their largest is >= 0.
    for gap in gaps:
        np.maximum(worst, np.bincount(where, weights=weights * gap[inverse], minlength=n_groups), out=worst)
    return worst
