"""Triton kernels of the fused block selection (see :mod:`.selection`) and their launchers: block pooling,
per-row selection, per-document stats, reverse lists."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch


# data-dependent integers (block and list counts) are never specialised (on a value of 1 or divisibility by
# 16), so that a new batch never compiles a new variant
@triton.jit(do_not_specialize=["NB"])
def _pool_kernel(Q, K, OUT, blk_start, blk_end, sqt, sqh, skt, skh, NB, G: tl.constexpr, BLOCK: tl.constexpr,
                 D: tl.constexpr):
    """Program (b, h, z): mean of block b over the tokens and the G query heads of KV group h (z = 0, into
    OUT[0]) or over the tokens of KV head h (z = 1, into OUT[1]); one launch pools both."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    z = tl.program_id(2)
    s = tl.load(blk_start + b)
    e = tl.load(blk_end + b)
    offs = (s + tl.arange(0, BLOCK)).to(tl.int64)
    offs_d = tl.arange(0, D)
    heads = tl.where(z == 0, G, 1)
    X = tl.where(z == 0, Q + hk * G * sqh, K + hk * skh)
    st = tl.where(z == 0, sqt, skt)
    sh = tl.where(z == 0, sqh, skh)
    acc = tl.zeros([D], tl.float32)
    for g in range(heads):
        x = tl.load(X + g * sh + offs[:, None] * st + offs_d[None, :], mask=(offs < e)[:, None], other=0.0)
        acc += tl.sum(x.to(tl.float32), 0)
    acc = acc / ((e - s) * heads).to(tl.float32)
    tl.store(OUT + ((z * NB + b) * tl.num_programs(1) + hk) * D + offs_d, acc)


def pool_blocks_triton(x, lay, num_kv_heads, k=None):
    """Block means ``[NB, Hkv, D]`` float32 of ``x`` (over its tokens and the query heads of each KV group);
    given ``k`` ``[T, Hkv, D]`` too, returns ``(xbar, kbar)`` from the same launch."""
    T, H, D = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    planes = 1 if k is None else 2
    k = x if k is None else (k if k.stride(-1) == 1 else k.contiguous())
    out = torch.empty(planes, lay.num_blocks, num_kv_heads, D, dtype=torch.float32, device=x.device)
    launch(_pool_kernel, (lay.num_blocks, num_kv_heads, planes),
           (x, k, out, lay.block_start, lay.block_end, x.stride(0), x.stride(1), k.stride(0), k.stride(1),
            lay.num_blocks), dict(G=H // num_kv_heads, BLOCK=lay.block_size, D=D, num_warps=4))
    return out[0] if planes == 1 else (out[0], out[1])


@triton.jit(do_not_specialize=["NB", "WOUT", "TOTC"])
def _select_kernel(QB, KB, block_doc, doc_first, blk_start, row_offset, budget, SCR,
                   OUT_IDX, OUT_START, OUT_CNT, OUT_COV, KCNT,
                   scale, NB, WOUT, TOTC,
                   HKV: tl.constexpr, TOPP: tl.constexpr, D: tl.constexpr, CH: tl.constexpr, WP2: tl.constexpr):
    """One program per (query block g, KV head h): routing scores over the causal blocks of g's document,
    softmax, then the kept set by an exact binary search over the float bit patterns (top-k: the k-th
    largest key, k = round(budget * n) for a kept fraction and min(-budget, n) for a negative budget, a
    top-k count; top-p: the smallest prefix of the descending order reaching mass p), diagonal forced. A
    top-k count with a top-p floor is not selected here: selection.py runs the torch selection for it.
    Also counts, per (h, KV block), the rows that keep it, and the widest row (integer atomics: order-free,
    deterministic)."""
    g = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.load(block_doc + g)
    f = tl.load(doc_first + d).to(tl.int32)
    n = g - f + 1
    offs_d = tl.arange(0, D)
    qv = tl.load(QB + (g * HKV + h) * D + offs_d)
    scr = SCR + h.to(tl.int64) * TOTC + tl.load(row_offset + g)
    for c0 in range(0, n, CH):
        cols = c0 + tl.arange(0, CH)
        cm = cols < n
        kt = tl.load(KB + ((f + cols)[:, None] * HKV + h) * D + offs_d[None, :], mask=cm[:, None], other=0.0)
        tl.store(scr + cols, tl.sum(kt * qv[None, :], 1) * scale, mask=cm)
    tl.debug_barrier()
    cols = tl.arange(0, WP2)
    valid = cols < n
    s = tl.load(scr + cols, mask=valid, other=float("-inf"))
    m = tl.max(s, 0)
    e = tl.exp(s - m)
    prob = e / tl.sum(e, 0)
    bud = tl.load(budget + d)
    isdiag = cols == (n - 1)
    if TOPP:
        key = prob
    else:
        key = tl.where(isdiag, 2.0, prob)
    bits = tl.where(valid, key.to(tl.int32, bitcast=True), -1)
    # a negative budget is a top-k count (selection.py negates it): min(k, n) blocks; else a kept fraction
    kk = tl.where(bud < 0.0, tl.minimum(-bud, n.to(tl.float32)),
                  tl.minimum(tl.maximum(tl.floor(bud * n.to(tl.float32) + 0.5), 1.0), n.to(tl.float32)))
    lo = tl.zeros([], tl.int32)
    hi = tl.full([], 0x7F800000, tl.int32)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        sel = bits >= mid
        if TOPP:
            ok = tl.sum(tl.where(sel, prob, 0.0), 0) >= bud
        else:
            ok = tl.sum(sel.to(tl.float32), 0) >= kk
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    keep = bits >= lo
    if TOPP:
        keep = tl.where(bud >= 1.0, valid, keep)
    keep = (keep | isdiag) & valid
    ki = keep.to(tl.int32)
    pos = tl.cumsum(ki, 0) - 1
    cnt = tl.sum(ki, 0)
    base = (h * NB + g).to(tl.int64) * WOUT
    om = keep & (pos < WOUT)
    tl.store(OUT_IDX + base + pos, f + cols, mask=om)
    tl.store(OUT_START + base + pos, tl.load(blk_start + f + cols, mask=om, other=0), mask=om)
    # exact ties at the threshold could overflow the slots (never seen): keep the diagonal last anyway
    over = cnt > WOUT
    tl.store(OUT_IDX + base + WOUT - 1, g, mask=over)
    tl.store(OUT_START + base + WOUT - 1, tl.load(blk_start + g), mask=over)
    # counted as stored: when the slots overflow, the last one holds the diagonal instead
    tl.atomic_add(KCNT + h * NB + f + cols, ki, mask=om & (pos < WOUT - over.to(tl.int32)))
    tl.atomic_add(KCNT + h * NB + g, 1, mask=over)
    # slot Hkv*NB: the widest row (the list width the host needs)
    tl.atomic_max(KCNT + HKV * NB, tl.minimum(cnt, WOUT))
    tl.store(OUT_CNT + h * NB + g, tl.minimum(cnt, WOUT))
    tl.store(OUT_COV + h * NB + g, tl.sum(tl.where(keep, prob, 0.0), 0))


ROW_TILES = (256, 1024)  # the select kernel's row widths (WP2): a few, so that a new batch rarely needs another


def row_tile(blocks: int) -> int:
    """The select kernel's row width for rows of up to ``blocks`` causal blocks: the first of ROW_TILES that
    holds them, past those the next power of two (documents of more than 1024 blocks)."""
    return next((w for w in ROW_TILES if blocks <= w), triton.next_power_of_2(blocks))


def select_rows_triton(qbar, kbar, lay, budget, topp: bool, scale: float, wout: int, precompile: bool = True):
    """Launch _select_kernel; returns (q2k_idx, q2k_start [Hkv, NB, wout], cnt [Hkv, NB], cov [Hkv, NB],
    kcnt [1 + Hkv * NB + 2]: a zero, the rows keeping each KV block, then the widest row, then a slot for the
    nonzero count that doc_stats_triton fills; its cumsum over the first 1 + Hkv * NB is the CSR pointer).
    With ``precompile``, its first compile also compiles the other mode's and ROW_TILES' variants
    (:func:`launch.launch`)."""
    NB, Hkv, D = qbar.shape
    dev = qbar.device
    scr = torch.empty(Hkv * lay.total_causal, dtype=torch.float32, device=dev)
    # slots past a row's count are never read (every consumer masks by q2k_cnt): no fill needed
    idx = torch.empty(Hkv, NB, wout, dtype=torch.int32, device=dev)
    start = torch.empty(Hkv, NB, wout, dtype=torch.int32, device=dev)
    cnt = torch.empty(Hkv, NB, dtype=torch.int32, device=dev)
    cov = torch.empty(Hkv, NB, dtype=torch.float32, device=dev)
    kcnt = torch.zeros(1 + Hkv * NB + 2, dtype=torch.int32, device=dev)
    args = (qbar, kbar, lay.block_doc, lay.doc_first_block_t, lay.block_start, lay.row_offset, budget, scr, idx,
            start, cnt, cov, kcnt[1:], scale, NB, wout, lay.total_causal)

    def constants(topp, wp2):
        return dict(HKV=Hkv, TOPP=topp, D=D, CH=64, WP2=wp2, num_warps=4 if wp2 <= 512 else 8)

    wp2 = row_tile(lay.max_doc_blocks)
    siblings = lambda: ((_select_kernel, args, constants(m, w)) for m in (False, True) for w in ROW_TILES  # noqa: E731
                        if (m, w) != (topp, wp2))
    launch(_select_kernel, (NB, Hkv), args, constants(topp, wp2), siblings if precompile else tuple)
    return idx, start, cnt, cov, kcnt


@triton.jit(do_not_specialize=["NB", "W", "NSTEP"])
def _reverse_kernel(Q2K_IDX, Q2K_CNT, block_doc, doc_first, blk_start, blk_end, K2Q_PTR,
                    OUT_IDX, OUT_START, OUT_END, NB, W, NSTEP, CH: tl.constexpr):
    """One program per (KV block c, KV head h): the query blocks whose (ascending) forward list holds c,
    found by a lower-bound binary search per row, written ascending from K2Q_PTR[h, c] (the diagonal first)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    last = tl.load(doc_first + tl.load(block_doc + c) + 1).to(tl.int32)
    out = tl.load(K2Q_PTR + h * NB + c)
    for g0 in range(c, last, CH):
        g = g0 + tl.arange(0, CH)
        gm = g < last
        n = tl.load(Q2K_CNT + h * NB + g, mask=gm, other=0)
        base = Q2K_IDX + (h * NB + g).to(tl.int64) * W
        lo = tl.zeros([CH], tl.int32)
        hi = n
        for _ in range(NSTEP):
            live = lo < hi
            mid = (lo + hi) // 2
            right = tl.load(base + mid, mask=live, other=0) < c
            lo = tl.where(live & right, mid + 1, lo)
            hi = tl.where(live & ~right, mid, hi)
        found = (lo < n) & (tl.load(base + lo, mask=gm & (lo < n), other=-1) == c)
        fi = found.to(tl.int32)
        pos = out + tl.cumsum(fi, 0) - 1
        tl.store(OUT_IDX + pos, g, mask=found)
        tl.store(OUT_START + pos, tl.load(blk_start + g, mask=found, other=0), mask=found)
        tl.store(OUT_END + pos, tl.load(blk_end + g, mask=found, other=0), mask=found)
        out += tl.sum(fi, 0)


def reverse_lists_triton(q2k_idx, q2k_cnt, k2q_ptr, nnz: int, lay):
    """(k2q_idx, k2q_start, k2q_end) [nnz] int32 from the forward lists and the CSR row pointers."""
    Hkv, NB, W = q2k_idx.shape
    dev = q2k_idx.device
    out = [torch.empty(max(nnz, 1), dtype=torch.int32, device=dev) for _ in range(3)]
    launch(_reverse_kernel, (NB, Hkv), (q2k_idx, q2k_cnt, lay.block_doc, lay.doc_first_block_t, lay.block_start,
                                        lay.block_end, k2q_ptr, *out, NB, W, max(1, W.bit_length())),
           dict(CH=64, num_warps=2))
    return out


# NNZ sits past the per-row counts in one buffer, so its alignment changes with NB
@triton.jit(do_not_specialize=["NB"], do_not_specialize_on_alignment=["NNZ"])
def _doc_stats_kernel(CNT, COV, doc_first, doc_causal, OUT_KEPT, OUT_COV, NNZ, KCNT, PTR, NB, HKV,
                      CH: tl.constexpr, SCH: tl.constexpr):
    """One program per document: kept blocks / causal blocks and mean coverage over its (KV head, query
    block) rows, summed in a fixed order (deterministic, unlike float atomics); adds its kept blocks to NNZ.
    Program 0 also writes PTR, the inclusive prefix sum of KCNT[0 : HKV*NB + 1] (the reverse lists' CSR
    pointer: KCNT starts with a zero), which saves a separate scan launch."""
    d = tl.program_id(0)
    f = tl.load(doc_first + d).to(tl.int32)
    e = tl.load(doc_first + d + 1).to(tl.int32)
    kept = tl.zeros([CH], tl.float32)
    cov = tl.zeros([CH], tl.float32)
    for h in range(0, HKV):
        for g0 in range(f, e, CH):
            g = g0 + tl.arange(0, CH)
            gm = g < e
            kept += tl.load(CNT + h * NB + g, mask=gm, other=0).to(tl.float32)
            cov += tl.load(COV + h * NB + g, mask=gm, other=0.0)
    total = tl.sum(kept, 0)
    tl.atomic_add(NNZ, total.to(tl.int32))
    tl.store(OUT_KEPT + d, total / (tl.load(doc_causal + d) * HKV))
    tl.store(OUT_COV + d, tl.sum(cov, 0) / ((e - f) * HKV).to(tl.float32))
    if d == 0:
        carry = tl.zeros([], tl.int32)
        for s0 in range(0, HKV * NB + 1, SCH):
            o = s0 + tl.arange(0, SCH)
            m = o <= HKV * NB
            x = tl.load(KCNT + o, mask=m, other=0)
            tl.store(PTR + o, tl.cumsum(x, 0) + carry, mask=m)
            carry += tl.sum(x, 0)


def doc_stats_triton(cnt, cov, lay, kcnt):
    """Per-document (kept_fraction, coverage) float32 [n] from per-row counts and coverages [Hkv, NB], and
    the reverse lists' CSR pointer int32 [Hkv*NB + 1] from ``kcnt`` (see :func:`select_rows_triton`); adds the
    total kept count to kcnt's (zeroed) last slot."""
    Hkv, NB = cnt.shape
    kept = torch.empty(lay.num_docs, dtype=torch.float32, device=cnt.device)
    cv = torch.empty_like(kept)
    ptr = torch.empty(Hkv * NB + 1, dtype=torch.int32, device=cnt.device)
    launch(_doc_stats_kernel, (lay.num_docs,), (cnt, cov, lay.doc_first_block_t, lay.doc_causal_t, kept, cv,
                                                 kcnt[Hkv * NB + 2:], kcnt, ptr, NB, Hkv),
           dict(CH=64, SCH=1024, num_warps=4))
    return kept, cv, ptr

