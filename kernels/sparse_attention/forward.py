"""Forward kernel of block-sparse varlen attention over a BlockSelection, and its launcher.

Grid (see :func:`launch.grid`): one program per (query head, query tile), rows in ``q_order`` (longest rows
first, so that all heads of the longest rows start first). Only the diagonal block needs a mask (causal, and
the document end): every other selected block is a full block strictly in the past of the same document, and
the diagonal is the last entry of a forward list. LSE is stored in the log2 domain (``m + log2(l)`` of
``qk * scale * log2(e)``). With ``TMA`` the main loop loads its K/V tiles through host-built tensor
descriptors over the ``[T, H*D]`` views (:func:`launch.descriptors`), and with ``WS`` it is warp-specialised
(a producer warp issues the tile loads).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (LOG2E, compile_options, empty, grid, kept_pairs, launch, precision, record, row_class_launches,
                     tensor_descriptors, tile_variants, use_tma)
from .options import DEFAULT_OPTIONS, KernelOptions
from .tiles import program_tile


@triton.jit
def _fwd_step(q, kT, Vh, VD, kb, vcol, svt, v_off, m_i, l_i, acc, qk_scale, n0, m0, offs_n, offs_m, kmask,
              MASK: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step of the query rows m0 + offs_m over the key tile kT (rows kb + offs_n, V read
    from ``Vh + kb * svt + v_off``, or with TMA from the descriptor VD at [kb, vcol]). MASK: the diagonal
    tile, keys causal and before the document end (kmask) only; other tiles are full."""
    s = tl.dot(q, kT, input_precision=PREC) * qk_scale
    if MASK:
        s = tl.where((n0 + offs_n[None, :] <= m0 + offs_m[:, None]) & kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    pr = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(pr, 1)
    acc = acc * alpha[:, None]
    if TMA:
        vv = VD.load([kb, vcol])
    elif MASK:
        vv = tl.load(Vh + kb.to(tl.int64) * svt + v_off, mask=kmask[:, None], other=0.0)
    else:
        vv = tl.load(Vh + kb.to(tl.int64) * svt + v_off)
    acc = tl.dot(pr.to(vv.dtype), vv, acc, input_precision=PREC)
    return m_new, l_i, acc


# data-dependent integers: never specialised (on a value of 1 or divisibility by 16), so that a new batch
# never compiles a new variant
@triton.jit(do_not_specialize=["T", "NB", "WK"])
def _fwd_kernel(Q, K, V, O, LSE, KD, VD, blk_start, blk_end, q2k_start, q2k_cnt, q_order,
                qk_scale, T, NB, WK,
                sqt, sqh, skt, skh, svt, svh, sot, soh,
                G: tl.constexpr, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                D: tl.constexpr, PREC: tl.constexpr, HEAD_OUTER: tl.constexpr, TMA: tl.constexpr,
                WS: tl.constexpr):
    hq, r, qs, qe, m0 = program_tile(q_order, blk_start, blk_end, BLOCK, BM, HEAD_OUTER)
    hk = hq // G
    NSN: tl.constexpr = BLOCK // BN
    if m0 < qe:
        # 64-bit scalar bases, 32-bit tile offsets (fewer registers than 64-bit offset tiles)
        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        mmask = offs_m < qe - m0
        q = tl.load(Q + m0.to(tl.int64) * sqt + hq * sqh + offs_m[:, None] * sqt + offs_d[None, :],
                    mask=mmask[:, None], other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        row = hk * NB + r
        lst = q2k_start + row.to(tl.int64) * WK
        Kh = K + hk * skh
        Vh = V + hk * svh
        k_off = offs_n[None, :] * skt + offs_d[:, None]
        v_off = offs_n[:, None] * svt + offs_d[None, :]
        # one flat loop over the BN-wide sub-tiles of the unmasked blocks: a pipeline stage holds one K and
        # one V tile whatever the selection block size is
        for it in tl.range(0, (tl.load(q2k_cnt + row) - 1) * NSN, warp_specialize=WS):
            kb = tl.load(lst + it // NSN) + (it % NSN) * BN
            if TMA:
                kT = tl.trans(KD.load([kb, hk * D]))
            else:
                kT = tl.load(Kh + kb.to(tl.int64) * skt + k_off)
            m_i, l_i, acc = _fwd_step(q, kT, Vh, VD, kb, hk * D, svt, v_off, m_i, l_i, acc, qk_scale, 0, 0, offs_n,
                                      offs_m, None, MASK=False, TMA=TMA, PREC=PREC)
        # diagonal block, masked (causal + document end): a loop over the sub-tiles that reach these rows,
        # without branches, so that it pipelines (6-16% faster on packed batches on an H100 than one branch
        # per unrolled sub-tile)
        for j in range(0, tl.cdiv(tl.minimum(m0 + BM, qe) - qs, BN)):
            n0 = qs + j * BN
            kmask = offs_n < qe - n0
            kT = tl.load(Kh + n0.to(tl.int64) * skt + k_off, mask=kmask[None, :], other=0.0)
            m_i, l_i, acc = _fwd_step(q, kT, Vh, VD, n0, hk * D, svt, v_off, m_i, l_i, acc, qk_scale, n0, m0,
                                      offs_n, offs_m, kmask, MASK=True, TMA=False, PREC=PREC)
        acc = acc / l_i[:, None]
        tl.store(O + m0.to(tl.int64) * sot + hq * soh + offs_m[:, None] * sot + offs_d[None, :],
                 acc.to(O.dtype.element_ty), mask=mmask[:, None])
        tl.store(LSE + hq.to(tl.int64) * T + m0 + offs_m, m_i + tl.math.log2(l_i), mask=mmask)



def sparse_attn_fwd(q, k, v, sel, sm_scale, options: KernelOptions = DEFAULT_OPTIONS):
    """O ``[T, Hq, D]`` and LSE ``[Hq, T]`` float32 (log2 domain) of q, k, v over the selection."""
    T, Hq, D = q.shape
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    o = empty((T, Hq, D), q, options)
    lse = empty((Hq, T), q, options, torch.float32)
    pairs = kept_pairs(q, k, sel)
    G = Hq // k.shape[1]

    def arguments(cfg, ends, tma) -> tuple[tuple, dict]:
        kd, vd = tensor_descriptors(cfg["BN"], k, v) if tma else (None, None)
        args = (q, k, v, o, lse, kd, vd, lay.block_start, ends, sel.q2k_start, sel.q2k_cnt, sel.q_order,
                sm_scale * LOG2E, T, NB, sel.q2k_idx.shape[-1],
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
                o.stride(1))
        return args, dict(G=G, BLOCK=B, BM=cfg["BM"], BN=cfg["BN"], D=D, PREC=precision(q.dtype),
                          HEAD_OUTER=cfg["HEAD_OUTER"], TMA=tma, WS=tma and cfg.get("WS", False),
                          **compile_options(cfg, tma))

    for name, cfg, ends in row_class_launches("fwd", sel, D, options, G):
        tma = use_tma(cfg, pairs, k, v)
        siblings = lambda ends=ends, cfg=cfg, tma=tma: (  # noqa: E731
            (_fwd_kernel, *arguments(c, ends, t)) for c, t in tile_variants("fwd", B, D, options, k, v, group=G)
            if (c, t) != (cfg, tma))
        compiled = launch(_fwd_kernel, grid(cfg, Hq, NB * (B // cfg["BM"])), *arguments(cfg, ends, tma),
                          siblings if options.precompile else tuple)
        record(options, name, compiled)
    return o, lse
