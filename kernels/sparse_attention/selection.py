"""Block selection: which key/value blocks each query block attends to.

Routing scores are MoBA/NSA-style: queries and keys are mean-pooled per block (queries also over the query
heads of a KV group, so a GQA group shares one selection), ``score[g, c] = qbar_g . kbar_c / sqrt(D)`` over
the causal blocks ``c <= g`` of the same document, softmax-normalised per query block.

* ``p`` mode (top-p): per (KV head, query block) keep the fewest blocks, in descending score order, whose
  probability mass reaches ``p``; ``p = 1`` keeps every causal block (dense).
* ``kept_fraction`` mode: per (KV head, query block) keep the ``round(kf * n_causal)`` highest-scoring blocks
  (at least one).
* ``top_k`` mode: per (KV head, query block) keep ``min(k, n_causal)`` blocks, the diagonal and the
  highest-scoring others; ``p`` beside it is a coverage floor: the row also keeps its top-p blocks (the union).
  The fused Triton selection has no floor: a floor runs the torch selection (on every device).

In every mode the diagonal block is always kept. Budgets are per document (float / int or ``[n]`` tensor); the
rows' rules are :mod:`.rules`.

Storage (all plain tensors, never O(T^2)):
  ``q2k_idx [Hkv, NB, W]`` int32 selected KV blocks of each query block, ascending (the diagonal is last;
  W >= ``row_blocks``, the most any row keeps; a fused top-p selection, which never waits for the GPU to
  learn its widest row, takes W = the longest document's blocks),
  ``q2k_cnt [Hkv, NB]`` int32 how many of the W slots are used,
  ``k2q_ptr [Hkv*NB+1]`` / ``k2q_idx`` int32: reverse lists (CSR, ascending; the diagonal is first), used by
  the dK/dV backward; built by one sort (torch path) or by a Triton binary-search kernel (fused path; sized
  for the kept entries' host bound: top-k from the budgets, top-p every causal block),
  ``q_order`` / ``k_order`` int32: longest rows first (scheduling; from the layout).
The score matrix is built per bucket of similar-length documents and in row chunks of at most
``_CHUNK_ELEMS`` entries, so a 128K-token document costs a few MB at a time.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from .batch import VarlenBatch
from .layout import BlockLayout, block_layout
from .options import DEFAULT_OPTIONS, KernelOptions
from .rules import RowRule, keeps_every_block, row_rule

__all__ = ["BlockSelection", "SelectionFallbackWarning", "select_blocks", "selection_from_mask", "pool_blocks"]

_CHUNK_ELEMS = 1 << 23


class SelectionFallbackWarning(UserWarning):
    """The fused Triton selection cannot be built for this GPU; this call used the torch selection."""


@dataclass
class BlockSelection:
    layout: BlockLayout
    num_kv_heads: int
    q2k_idx: torch.Tensor  # int32 [Hkv, NB, W]
    q2k_cnt: torch.Tensor  # int32 [Hkv, NB]
    k2q_ptr: torch.Tensor  # int32 [Hkv*NB + 1]
    k2q_idx: torch.Tensor  # int32 [>= nnz]
    q_order: torch.Tensor  # int32 [NB]
    k_order: torch.Tensor  # int32 [NB]
    kept_fraction: torch.Tensor  # float32 [n] kept blocks / causal blocks (over KV heads)
    coverage: torch.Tensor  # float32 [n] mean routing-score mass kept per (KV head, query block)
    # first token of each listed block (saves the kernels one dependent load per iteration)
    q2k_start: torch.Tensor = None  # int32 [Hkv, NB, W]
    k2q_start: torch.Tensor = None  # int32 like k2q_idx
    k2q_end: torch.Tensor = None  # int32 like k2q_idx (query blocks may be partial)
    # host: the most blocks any row keeps (<= W; picks the kernels' tile configs); for a top-k selection
    # with host budgets, the budget's count (rows keep more only on exact score ties); None where only the
    # device knows it (the fused top-p selection), which then gives ``row_class_end``
    row_blocks: int = None
    # host: kept (KV head, query block, KV block) entries, exact or (host-sized top-k) estimated from the
    # budgets; None where only the device knows it. Sizes the backward's work (the overlap rule)
    kept_entries: int = None
    # device, where the host does not know ``row_blocks``: the block ends int32 [NB] for the short-row and
    # for the long-row launches, each the layout's ends where the widest row is of that class and zeros
    # (every program of that launch has nothing to do) where it is not (launch.row_class_launches)
    row_class_end: tuple = None

    def __post_init__(self):
        lay = self.layout
        if self.row_blocks is None and self.row_class_end is None:
            self.row_blocks = self.q2k_idx.shape[-1]
        if self.q2k_start is None:
            self.q2k_start = lay.block_start[self.q2k_idx.long()].contiguous()
        if self.k2q_start is None:
            self.k2q_start = lay.block_start[self.k2q_idx.long()].contiguous()
            self.k2q_end = lay.block_end[self.k2q_idx.long()].contiguous()

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def to_dense_mask(self) -> torch.Tensor:
        """``[Hkv, NB, NB]`` bool block mask (tests, FlexAttention; O(NB^2), small inputs only)."""
        H, NB, W = self.q2k_idx.shape
        mask = torch.zeros(H, NB, NB + 1, dtype=torch.bool, device=self.q2k_idx.device)
        slot = torch.arange(W, device=self.q2k_idx.device)
        valid = slot[None, None, :] < self.q2k_cnt[:, :, None]
        idx = torch.where(valid, self.q2k_idx.long(), NB)
        mask.scatter_(2, idx, True)
        return mask[:, :, :NB]

    def kept_block_pairs_tokens(self) -> int:
        """Number of (query token, key token) pairs attended, summed over KV heads (for FLOP counts)."""
        lay = self.layout
        H, NB, W = self.q2k_idx.shape
        qlen = (lay.block_end - lay.block_start).long()
        slot = torch.arange(W, device=self.q2k_idx.device)
        valid = slot[None, None, :] < self.q2k_cnt[:, :, None]
        klen = qlen[self.q2k_idx.long().clamp(0, NB - 1)]
        g = torch.arange(NB, device=qlen.device)
        diag = self.q2k_idx.long() == g[None, :, None]
        pairs = torch.where(diag, qlen[None, :, None] * (qlen[None, :, None] + 1) // 2, qlen[None, :, None] * klen)
        return int(torch.where(valid, pairs, 0).sum())


def layout_of(cu_seqlens, block_size: int, device) -> BlockLayout:
    """The block layout of a :class:`VarlenBatch` (kept by it) or of a ``cu_seqlens`` tensor (cached)."""
    if isinstance(cu_seqlens, VarlenBatch):
        return cu_seqlens.layout(block_size, device)
    return block_layout(cu_seqlens, block_size, device)


def pool_blocks(x: torch.Tensor, lay: BlockLayout, num_kv_heads: int, fused: bool | None = None) -> torch.Tensor:
    """Mean over the tokens of each block and over the heads of each KV group: ``[NB, Hkv, D]`` float32.

    ``fused`` (default: on CUDA): one Triton launch; otherwise a torch ``index_add_``."""
    T, H, D = x.shape
    G = H // num_kv_heads
    if x.is_cuda if fused is None else fused:
        from .select_kernels import pool_blocks_triton

        return pool_blocks_triton(x, lay, num_kv_heads)
    xs = x.view(T, num_kv_heads, G, D).float().sum(2)
    out = torch.zeros(lay.num_blocks, num_kv_heads, D, dtype=torch.float32, device=x.device)
    out.index_add_(0, lay.token_block, xs)
    cnt = (lay.block_end - lay.block_start).to(torch.float32) * G
    return out / cnt[:, None, None]


def _finalize(lay: BlockLayout, Hkv: int, q2k_idx, q2k_cnt, kept_fraction, coverage,
              q2k_start=None) -> BlockSelection:
    """Build the reverse (KV block -> query blocks) CSR lists with one sort; no host sync."""
    dev = q2k_idx.device
    NB = lay.num_blocks
    H, _, W = q2k_idx.shape
    slot = torch.arange(W, device=dev)
    valid = slot[None, None, :] < q2k_cnt[:, :, None]
    h = torch.arange(H, device=dev)[:, None, None]
    g = torch.arange(NB, device=dev)[None, :, None]
    c = q2k_idx.long()
    row = h * NB + c  # reverse row = (kv head, kv block)
    big = H * NB * NB
    key = torch.where(valid, row * NB + g, big).reshape(-1)
    skey = torch.sort(key).values
    k2q_idx = (skey % NB).to(torch.int32)
    k2q_cnt = torch.zeros(H * NB + 1, dtype=torch.int64, device=dev)
    k2q_cnt.scatter_add_(0, torch.where(valid, row, H * NB).reshape(-1), torch.ones_like(key))
    k2q_ptr = torch.zeros(H * NB + 1, dtype=torch.int32, device=dev)
    k2q_ptr[1:] = torch.cumsum(k2q_cnt[: H * NB], 0).to(torch.int32)
    return BlockSelection(lay, Hkv, q2k_idx.to(torch.int32).contiguous(), q2k_cnt.to(torch.int32).contiguous(),
                          k2q_ptr, k2q_idx, lay.q_order, lay.k_order, kept_fraction, coverage, q2k_start=q2k_start)


def _doc_buckets(lay: BlockLayout):
    """Group documents by power-of-two block count (padding waste <= 2x per side)."""
    buckets: dict[int, list[int]] = {}
    for d, nb in enumerate(lay.doc_nblocks):
        w = 1 << max(0, (nb - 1).bit_length())
        buckets.setdefault(w, []).append(d)
    return sorted(buckets.items(), reverse=True)


def _row_keeps(kf: float, nb: int) -> int:
    """Blocks the last row of an ``nb``-block document keeps under a host budget: a kept fraction, or a
    top-k count negated."""
    return min(nb, int(-kf)) if kf < 0 else min(nb, max(1, math.floor(kf * nb + 0.5)))


def _topk_kept(kf: float, nb: int) -> int:
    """Kept (query block, KV block) pairs of an ``nb``-block document: a top-k count (negated) keeps
    min(k, r + 1) in row r, exactly; a kept fraction about round(kf * causal blocks), one per row at least."""
    if kf < 0:
        k = min(nb, int(-kf))
        return k * (k + 1) // 2 + (nb - k) * k
    return max(nb, round(kf * nb * (nb + 1) / 2))


def _topk_host_bounds(lay: BlockLayout, kfs: list[float]) -> tuple[int, int, int, int]:
    """From host budgets alone (kept fractions, or top-k counts negated): (most blocks a top-k row keeps,
    list width, kept-entry bound per KV head, kept entries per KV head, exact for counts and estimated for
    kept fractions). A row of n causal blocks keeps round(kf * n) or min(k, n) of them, more only on exact
    score ties, and the kernel never stores more than the width; the bound sums min(n, width) over every row."""
    kmax = max(_row_keeps(kf, nb) for kf, nb in zip(kfs, lay.doc_nblocks, strict=True))
    # 16 slots of slack for ties (the kernel keeps the diagonal last if a row overflows anyway)
    wout = min(lay.max_doc_blocks, kmax + 16)
    bound = est = 0
    for kf, nb in zip(kfs, lay.doc_nblocks, strict=True):
        m = min(nb, wout)
        bound += m * (m + 1) // 2 + (nb - m) * wout
        est += _topk_kept(kf, nb)
    return kmax, wout, bound, est


def _select_triton(lay: BlockLayout, Hkv: int, qbar, kbar, budget, topp: bool, scale: float, kf_host,
                   options: KernelOptions):
    """Fused selection: four Triton launches, never waiting for the GPU. Top-k with host budgets
    (``kf_host``: one float per document, a kept fraction or a count negated) sizes its lists from those;
    top-p (and top-k with budgets only on the device) sizes them for the longest document's rows and every
    causal block, the host's bounds, and leaves the widest row on the device (``row_class_end``)."""
    from .select_kernels import doc_stats_triton, reverse_lists_triton, select_rows_triton

    if kf_host is None:
        wout, nnz = lay.max_doc_blocks, Hkv * lay.total_causal
    else:
        kmax, wout, bound, est = _topk_host_bounds(lay, kf_host)
        nnz = Hkv * bound
    idx, start, cnt, cov, kcnt = select_rows_triton(qbar, kbar, lay, budget, topp, scale, wout, options.precompile)
    kept_fraction, coverage, k2q_ptr = doc_stats_triton(cnt, cov, lay, kcnt)
    k2q_idx, k2q_start, k2q_end = reverse_lists_triton(idx, cnt, k2q_ptr, nnz, lay)
    sizes = (dict(row_class_end=_row_class_end(lay, kcnt[Hkv * lay.num_blocks + 1])) if kf_host is None
             else dict(row_blocks=kmax, kept_entries=Hkv * est))
    return BlockSelection(lay, Hkv, idx, cnt, k2q_ptr, k2q_idx, lay.q_order, lay.k_order, kept_fraction,
                          coverage, q2k_start=start, k2q_start=k2q_start, k2q_end=k2q_end, **sizes)


def _row_class_end(lay: BlockLayout, widest: torch.Tensor) -> tuple:
    """(short-row launches' block ends, long-row launches') from the widest row on the device (no sync)."""
    from .launch import SHORT_ROW_TOKENS

    short = widest * lay.block_size < SHORT_ROW_TOKENS
    zero = torch.zeros((), dtype=lay.block_end.dtype, device=lay.block_end.device)
    return torch.where(short, lay.block_end, zero), torch.where(short, zero, lay.block_end)


def _host_budgets(value, n: int) -> list[float] | None:
    """One float per document when the budget is on the host (a float or a CPU tensor), else None."""
    if not isinstance(value, torch.Tensor):
        return [float(value)] * n
    if value.device.type != "cpu":
        return None
    vals = value.reshape(-1).tolist()
    return vals * n if len(vals) == 1 else vals


_LAST_DENSE: list = []  # [(layout, Hkv, selection)]: the last dense selection built


def _dense_selection(lay: BlockLayout, Hkv: int) -> BlockSelection:
    """Every causal block of the same document: what ``p = 1`` keeps, built without routing scores, so
    that a dense micro-batch pays no selection (the simulator's cost model prices it at zero). It depends
    on the layout alone: the last one is kept for the next call (the other layers of a micro-batch), and
    only that one, since at 128K tokens a dense selection takes hundreds of MB."""
    if _LAST_DENSE and _LAST_DENSE[0][0] is lay and _LAST_DENSE[0][1] == Hkv:
        return _LAST_DENSE[0][2]
    dev = lay.block_start.device
    first = lay.doc_first_block_t[lay.block_doc]  # [NB] first block of each block's document
    cnt = lay.block_local + 1  # [NB] causal blocks of each query block
    j = torch.arange(lay.max_doc_blocks, device=dev)
    idx = torch.where(j[None, :] < cnt[:, None], first[:, None] + j[None, :], 0)  # ascending, diagonal last
    ones = torch.ones(lay.num_docs, dtype=torch.float32, device=dev)
    sel = _finalize(lay, Hkv, idx.to(torch.int32).expand(Hkv, -1, -1).contiguous(),
                    cnt.to(torch.int32).expand(Hkv, -1).contiguous(), ones, ones)
    sel.kept_entries = Hkv * lay.total_causal
    _LAST_DENSE[:] = [(lay, Hkv, sel)]
    return sel


@torch.no_grad()
def select_blocks(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, p=None, kept_fraction=None,
                  top_k=None, block_size: int = 64, softmax_scale: float | None = None,
                  options: KernelOptions = DEFAULT_OPTIONS) -> BlockSelection:
    """Select KV blocks per (KV head, query block). See the module docstring.

    q ``[T, Hq, D]``, k ``[T, Hkv, D]``, cu_seqlens int32 ``[n+1]`` (on any device: only its values are
    used, through the cached block layout; a host tensor saves a device->host copy) or a
    :class:`VarlenBatch`. At most one of ``p`` (top-p coverage target) and ``kept_fraction`` may be given
    (float or ``[n]`` tensor, in (0, 1]), or ``top_k`` (int or ``[n]`` integer tensor, >= 1) with ``p`` as
    its optional coverage floor; none means dense. ``options.selection`` picks the fused Triton or the torch
    path (see :class:`KernelOptions`); a top-k floor always takes the torch path.
    """
    if p is not None and kept_fraction is not None:
        raise ValueError("give p or kept_fraction, not both")
    if top_k is not None and kept_fraction is not None:
        raise ValueError("give top_k or kept_fraction, not both")
    Hkv = k.shape[1]
    lay = layout_of(cu_seqlens, block_size, q.device)
    rule = row_rule(lay.num_docs, q.device, p, kept_fraction, top_k)
    if keeps_every_block(lay.doc_nblocks, p, kept_fraction, top_k):
        return _dense_selection(lay, Hkv)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if rule.floor is not None and options.selection == "triton":
        raise ValueError("options.selection='triton' cannot select top_k with a floor p (the fused selection has "
                         "no floor); allowed: selection 'auto' or 'torch', or top_k without p")
    if options.selection == "torch" or (options.selection == "auto" and not q.is_cuda) or rule.floor is not None:
        return _select_torch(q, k, lay, rule, scale)
    topp = rule.mode == "p"
    kf_host = None if topp else _host_budgets(kept_fraction if top_k is None else top_k, lay.num_docs)
    if kf_host is not None and top_k is not None:
        kf_host = [-float(x) for x in kf_host]  # counts negated, as the kernel reads them
    if options.selection == "triton":
        return _select_fused(q, k, lay, rule.budget, topp, scale, kf_host, options)
    sel = _select_fused_where_it_builds(q, k, lay, rule.budget, topp, scale, kf_host, options)
    return sel if sel is not None else _select_torch(q, k, lay, rule, scale, fused_pool=False)


def _select_fused(q, k, lay: BlockLayout, budget, topp: bool, scale: float, kf_host,
                  options: KernelOptions = DEFAULT_OPTIONS) -> BlockSelection:
    from .select_kernels import pool_blocks_triton

    Hkv = k.shape[1]
    qbar, kbar = pool_blocks_triton(q, lay, Hkv, k=k)  # [NB, Hkv, D] each
    return _select_triton(lay, Hkv, qbar, kbar, budget, topp, scale, kf_host, options)


def _select_fused_where_it_builds(q, k, lay: BlockLayout, budget, topp: bool, scale: float, kf_host,
                                  options: KernelOptions = DEFAULT_OPTIONS) -> BlockSelection | None:
    """The fused selection, or None (with a :class:`SelectionFallbackWarning` naming the reason) where Triton
    cannot build its kernels for this GPU: their row tiles need more shared memory or registers than it has
    (``OutOfResources``: the widest row grows with the longest document), or ptxas rejects the code for its
    architecture (``PTXASError``). Every other exception is a bug and propagates."""
    from triton.runtime.errors import OutOfResources, PTXASError

    try:
        return _select_fused(q, k, lay, budget, topp, scale, kf_host, options)
    except (OutOfResources, PTXASError) as e:
        reason = (str(e).splitlines() or [""])[0][:200]
        warnings.warn(f"the fused Triton selection cannot run on this GPU ({type(e).__name__}: {reason}); this "
                      "call uses the torch selection", SelectionFallbackWarning, stacklevel=1)
        return None


def _select_torch(q, k, lay: BlockLayout, rule: RowRule, scale: float, fused_pool: bool | None = None):
    """The vectorised torch selection: per bucket of similar-length documents, in row chunks of at most
    ``_CHUNK_ELEMS`` scores; then the forward lists and (one sort) the reverse lists. ``fused_pool``: see
    :func:`pool_blocks`."""
    Hkv = k.shape[1]
    qbar = pool_blocks(q, lay, Hkv, fused_pool)  # [NB, Hkv, D]
    kbar = pool_blocks(k, lay, Hkv, fused_pool)
    kept_sum = torch.zeros(lay.num_docs, dtype=torch.float32, device=q.device)
    cov_sum = torch.zeros(lay.num_docs, dtype=torch.float32, device=q.device)
    pieces = []  # (global rows [nd, R], idx [nd, Hkv, R, w], cnt [nd, Hkv, R], rowvalid [nd, R])
    for W, docs in _doc_buckets(lay):
        pieces += _select_bucket(qbar, kbar, lay, docs, W, rule, scale, kept_sum, cov_sum)
    q2k_idx, q2k_cnt = _forward_lists(pieces, Hkv, lay.num_blocks, q.device)
    return _finalize(lay, Hkv, q2k_idx, q2k_cnt, kept_sum / (lay.doc_causal_t * Hkv),
                     cov_sum / (lay.doc_nblocks_t * Hkv))


def _select_bucket(qbar, kbar, lay: BlockLayout, docs: list[int], W: int, rule: RowRule, scale: float,
                   kept_sum, cov_sum) -> list:
    """The kept lists of the documents ``docs`` (at most ``W`` blocks each, padded to ``W``), one piece per
    row chunk (see :func:`_select_torch`); adds their kept counts and coverages to ``kept_sum`` / ``cov_sum``."""
    dev = qbar.device
    Hkv = qbar.shape[1]
    nd = len(docs)
    docs_t = torch.tensor(docs, device=dev)
    first = lay.doc_first_block_t[docs_t]  # [nd]
    nbs = lay.doc_first_block_t[docs_t + 1] - first
    j = torch.arange(W, device=dev)
    gidx = first[:, None] + j[None, :]  # [nd, W]
    colvalid = j[None, :] < nbs[:, None]
    gidx_c = torch.where(colvalid, gidx, 0)
    Qp = qbar[gidx_c].permute(0, 2, 1, 3)  # [nd, Hkv, W, D]
    Kp = kbar[gidx_c].permute(0, 2, 1, 3)
    rule = rule.at(docs_t)
    pieces = []
    rows_per_chunk = max(1, _CHUNK_ELEMS // max(1, nd * Hkv * W))
    for r0 in range(0, W, rows_per_chunk):
        r1 = min(W, r0 + rows_per_chunk)
        r = torch.arange(r0, r1, device=dev)
        rowvalid = r[None, :] < nbs[:, None]  # [nd, R]
        valid = (j[None, None, :] <= r[None, :, None]) & rowvalid[:, :, None]  # [nd, R, W]
        valid = valid | ((j == 0)[None, None, :] & ~rowvalid[:, :, None])  # keep softmax finite
        s = torch.matmul(Qp[:, :, r0:r1], Kp.transpose(-1, -2)) * scale  # [nd, Hkv, R, W]
        s = s.masked_fill(~valid[:, None], float("-inf"))
        prob = torch.softmax(s, dim=-1)
        isdiag = (j[None, :] == r[:, None])[None, None]  # [1, 1, R, W]
        validh = valid[:, None].expand_as(prob)
        keep = rule.keep(prob, r, j, isdiag, validh)
        keep = (keep | isdiag) & validh & rowvalid[:, None, :, None]
        cnt = keep.sum(-1)  # [nd, Hkv, R]
        cov = (prob * keep).sum(-1)
        kept_sum.index_add_(0, docs_t, cnt.sum((1, 2)).to(torch.float32))
        cov_sum.index_add_(0, docs_t, torch.where(rowvalid[:, None], cov, 0).sum((1, 2)))
        pieces.append((first[:, None] + r[None, :], _compact(keep, gidx, cnt), cnt, rowvalid))
    return pieces


def _compact(keep, gidx, cnt):
    """``[nd, Hkv, R, w]`` int32: each row's kept global blocks, ascending, in its first ``cnt`` slots (w: the
    chunk's widest row; one host sync)."""
    nd, Hkv, R, W = keep.shape
    w = max(int(cnt.max()) if cnt.numel() else 1, 1)
    pos = torch.cumsum(keep, -1) - 1
    slot = torch.where(keep, pos, w)
    out = torch.zeros(nd, Hkv, R, w + 1, dtype=torch.int32, device=keep.device)
    out.scatter_(-1, slot, gidx.to(torch.int32)[:, None, None, :].expand(nd, Hkv, R, W))
    return out[..., :w]


def _forward_lists(pieces: list, Hkv: int, NB: int, dev):
    """``(q2k_idx [Hkv, NB, W], q2k_cnt [Hkv, NB])`` int32 from the row-chunk pieces of every bucket."""
    Wmax = max(pc[1].shape[-1] for pc in pieces)
    q2k_idx = torch.zeros(Hkv, NB + 1, Wmax, dtype=torch.int32, device=dev)
    q2k_cnt = torch.zeros(Hkv, NB + 1, dtype=torch.int32, device=dev)
    for grow, idx, cnt, rowvalid in pieces:
        w = idx.shape[-1]
        g = torch.where(rowvalid, grow, NB).reshape(-1)  # invalid rows go to a dummy row
        q2k_idx[:, g, :w] = idx.permute(1, 0, 2, 3).reshape(Hkv, -1, w)
        q2k_cnt[:, g] = cnt.permute(1, 0, 2).reshape(Hkv, -1).to(torch.int32)
    return q2k_idx[:, :NB].contiguous(), q2k_cnt[:, :NB].contiguous()


def selection_from_mask(block_mask: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int = 64,
                        coverage: torch.Tensor | None = None) -> BlockSelection:
    """An explicit selection from a ``[Hkv, NB, NB]`` bool mask over the layout's global blocks.

    Entries outside the causal same-document pattern are dropped; the diagonal is added. ``coverage`` is
    reported as NaN unless given (no routing scores are computed).
    """
    if block_mask.dim() != 3 or block_mask.dtype != torch.bool:
        raise ValueError(f"block_mask must be a [Hkv, NB, NB] bool tensor, got {tuple(block_mask.shape)} "
                         f"{block_mask.dtype}")
    dev = block_mask.device
    lay = layout_of(cu_seqlens, block_size, dev)
    NB = lay.num_blocks
    if block_mask.shape[1:] != (NB, NB):
        raise ValueError(f"block_mask is {tuple(block_mask.shape)}, the layout has {NB} blocks")
    Hkv = block_mask.shape[0]
    g = torch.arange(NB, device=dev)
    allowed = (lay.block_doc[:, None] == lay.block_doc[None, :]) & (g[None, :] <= g[:, None])
    keep = (block_mask & allowed[None]) | torch.eye(NB, dtype=torch.bool, device=dev)[None]
    cnt = keep.sum(-1)
    w = max(1, int(cnt.max()))
    pos = torch.cumsum(keep, -1) - 1
    out = torch.zeros(Hkv, NB, NB + 1, dtype=torch.int32, device=dev)
    out.scatter_(-1, torch.where(keep, pos, NB), g.to(torch.int32).expand(Hkv, NB, NB).contiguous())
    n = lay.num_docs
    kept = torch.zeros(n, dtype=torch.float32, device=dev).index_add_(0, lay.block_doc, cnt.sum(0).float())
    causal = torch.tensor(lay.causal_blocks_per_doc(), dtype=torch.float32, device=dev) * Hkv
    cov = coverage if coverage is not None else torch.full((n,), float("nan"), device=dev)
    return _finalize(lay, Hkv, out[:, :, :w].contiguous(), cnt.to(torch.int32), kept / causal, cov)


def restrict_rows(sel: BlockSelection, rows: torch.Tensor) -> BlockSelection:
    """``sel`` with every query block outside ``rows`` (bool ``[NB]``) cut to its diagonal block.

    A context-parallel rank that attends the whole micro-batch's keys computes only the rows it holds
    tokens of; the other rows' outputs are dropped, and the diagonal is the least the kernel's layout lets a
    row keep. The kept fraction and coverage stay the whole selection's.
    """
    keep = rows.to(device=sel.q2k_cnt.device, dtype=torch.bool)[None, :]
    diag = sel.q2k_idx.gather(2, (sel.q2k_cnt.long() - 1).clamp_min(0)[..., None])  # lists end at the diagonal
    idx = sel.q2k_idx.clone()
    idx[..., :1] = torch.where(keep[..., None], idx[..., :1], diag)
    cnt = torch.where(keep, sel.q2k_cnt, torch.ones_like(sel.q2k_cnt))
    # slots past a row's count are unwritten in the fused selection; the block lookups read every slot
    slot = torch.arange(idx.shape[-1], device=idx.device)
    idx = torch.where(slot[None, None, :] < cnt[..., None], idx, 0)
    return _finalize(sel.layout, sel.num_kv_heads, idx, cnt, sel.kept_fraction, sel.coverage)
