"""Triton forward and backward of block-sparse varlen attention over a BlockSelection.

Grids (axis 0 = head so that all heads of the longest rows start first):
  forward / dQ : (Hq,  NB * BLOCK/BM)  one program per (query head, query tile), rows in ``q_order``;
  dK/dV        : (Hkv, NB * BLOCK/BN)  one program per (KV head, KV tile), rows in ``k_order``; loops over the
                 G query heads of the group and the reverse list of query blocks: no atomics, deterministic.
Only the diagonal block needs a mask (causal, and the document end): every other selected block is a full
block strictly in the past of the same document. The diagonal is the last entry of a forward list and the
first of a reverse list. LSE is stored in the log2 domain (``m + log2(l)`` of ``qk * scale * log2(e)``).
With ``TMA`` the forward and dQ main loops load their K/V tiles, and the dK/dV main loop its Q/dO tiles, through
host-built tensor descriptors over the ``[T, H*D]`` views instead of pointer tiles (Hopper and later with 16-bit
inputs and D 64 / 128, or the interpreter; :func:`_descriptors`), and with ``WS`` the forward's main loop is
warp-specialised (a producer warp issues the tile loads).
"""
from __future__ import annotations

import functools
import os
import threading

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634

# Tunables per (block_size, head_dim): tiles, warps, stages and grid order, from ``benchmarks/attention.py
# --tune`` on an H200 (benchmarks/results/attention_h200_tune.log). Each kernel has a long-row and a
# short-row config: large tiles amortise their setup and halve K/V re-reads on long rows (which matters
# once K/V outgrow L2, e.g. 128K tokens), small 4-warp tiles (twice the programs, more per SM) win when
# every row is short, as in packed batches of short documents or at high sparsity on 8K tokens.
# HEAD_OUTER puts the head on grid axis 1, so the programs running together share one head's K/V (axis 0 =
# head otherwise). dK/dV takes 64-key tiles with 4 warps and 2 stages for long rows as well: computed
# query-major (see _dkdv_tile) they compile without spills and pipeline, which beat 128-key tiles with 8
# warps (key-major, unpipelined, 12 spills) by 4-13% alone (benchmarks/results/trials/README.md).
# TMA K/V loads (lab 12, each kernel alone against the pointer-tile kernels in the same run): the long-row
# forward warp-specialised with 2 stages 1.01-1.07x on single sequences, dQ with 2 stages 1.02-1.06x; the
# short-row forward 1.02x and dQ 1.05x on short rows. TMA without warp specialisation left the long-row
# forward unchanged (0.98-1.02x); warp specialisation gave dQ nothing. TMA Q/dO tiles in the query-major
# dK/dV, 2 stages (lab 13): 1.08-1.16x (3 stages or warp specialisation less; TMA had lost in the key-major
# kernel of lab 5).
# FALLBACK_STAGES: the stages where TMA is asked for but cannot run (pointer tiles): those tuned for pointer
# tiles before TMA (2-stage pointer-tile dQ spills).
DEFAULT_CONFIG = {
    "fwd": dict(BM=128, BN=128, num_warps=8, num_stages=2, HEAD_OUTER=True, TMA=True, WS=True, FALLBACK_STAGES=3),
    "fwd_short": dict(BM=64, BN=64, num_warps=4, num_stages=3, HEAD_OUTER=True, TMA=True, WS=False,
                      FALLBACK_STAGES=3),
    "dq": dict(BM=128, BN=128, num_warps=8, num_stages=2, HEAD_OUTER=True, TMA=True, FALLBACK_STAGES=3),
    "dq_short": dict(BM=64, BN=64, num_warps=4, num_stages=2, HEAD_OUTER=True, TMA=True, FALLBACK_STAGES=3),
    "dkdv": dict(BN=64, BM=64, num_warps=4, num_stages=2, HEAD_OUTER=True, TMA=True),
    "dkdv_short": dict(BN=64, BM=64, num_warps=4, num_stages=2, HEAD_OUTER=True, TMA=True),
}
SHORT_ROW_TOKENS = 2048  # a selection whose longest row keeps fewer key tokens than this is "short"
CONFIG_OVERRIDES: dict = {}  # {(block_size, head_dim): {"fwd": {...}, "dq_short": {...}, ...}} (tuning, tests)


def get_config(kind: str, block: int, D: int, row_blocks: int | None = None) -> dict:
    """Launch config of one kernel kind ("fwd", "dq", "dkdv"); ``row_blocks`` (the most KV blocks any query
    row keeps) picks the short-row config. An override of ``kind`` applies to both of its configs, one of
    ``kind + "_short"`` to the short-row one only."""
    short = row_blocks is not None and row_blocks * block < SHORT_ROW_TOKENS
    cfg = dict(DEFAULT_CONFIG[kind + "_short" if short else kind])
    over = CONFIG_OVERRIDES.get((block, D), {})
    cfg.update(over.get(kind, {}))
    if short:
        cfg.update(over.get(kind + "_short", {}))
    for key in ("BM", "BN"):
        cfg[key] = min(cfg[key], block)
    return cfg


def _grid(cfg: dict, heads: int, rows: int):
    return (rows, heads) if cfg["HEAD_OUTER"] else (heads, rows)


@triton.jit
def _program_tile(order, blk_start, blk_end, BLOCK: tl.constexpr, TILE: tl.constexpr, HEAD_OUTER: tl.constexpr):
    """This program's (head, block, block start, block end, tile start): the grid is (heads, rows) or, with
    HEAD_OUTER, (rows, heads); row i is tile i % (BLOCK // TILE) of block order[i // (BLOCK // TILE)]."""
    if HEAD_OUTER:
        h = tl.program_id(1)
        pid = tl.program_id(0)
    else:
        h = tl.program_id(0)
        pid = tl.program_id(1)
    NSUB: tl.constexpr = BLOCK // TILE
    b = tl.load(order + pid // NSUB)
    start = tl.load(blk_start + b)
    return h, b, start, tl.load(blk_end + b), start + (pid % NSUB) * TILE


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


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, KD, VD, blk_start, blk_end, q2k_start, q2k_cnt, q_order,
                qk_scale, T, NB, WK,
                sqt, sqh, skt, skh, svt, svh, sot, soh,
                G: tl.constexpr, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                D: tl.constexpr, PREC: tl.constexpr, HEAD_OUTER: tl.constexpr, TMA: tl.constexpr,
                WS: tl.constexpr):
    hq, r, qs, qe, m0 = _program_tile(q_order, blk_start, blk_end, BLOCK, BM, HEAD_OUTER)
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
        # diagonal block, masked (causal + document end)
        hi = tl.minimum(m0 + BM, qe)
        for j in tl.static_range(NSN):
            n0 = qs + j * BN
            if n0 < hi:
                kmask = offs_n < qe - n0
                kT = tl.load(Kh + n0.to(tl.int64) * skt + k_off, mask=kmask[None, :], other=0.0)
                m_i, l_i, acc = _fwd_step(q, kT, Vh, VD, n0, hk * D, svt, v_off, m_i, l_i, acc, qk_scale, n0, m0,
                                          offs_n, offs_m, kmask, MASK=True, TMA=False, PREC=PREC)
        acc = acc / l_i[:, None]
        tl.store(O + m0.to(tl.int64) * sot + hq * soh + offs_m[:, None] * sot + offs_d[None, :],
                 acc.to(O.dtype.element_ty), mask=mmask[:, None])
        tl.store(LSE + hq.to(tl.int64) * T + m0 + offs_m, m_i + tl.math.log2(l_i), mask=mmask)


@triton.jit
def _dq_step(q, do, kk, vT, lse, delta, dq, qk_scale, n0, m0, offs_n, offs_m, kmask,
             MASK: tl.constexpr, PREC: tl.constexpr):
    """dQ contribution of the key tile kk / vT (rows n0 + offs_n) to the query rows m0 + offs_m. MASK: the
    diagonal tile, keys causal and before the document end (kmask) only; other tiles are full."""
    s = tl.dot(q, tl.trans(kk), input_precision=PREC) * qk_scale
    pr = tl.math.exp2(s - lse[:, None])
    if MASK:
        pr = tl.where((n0 + offs_n[None, :] <= m0 + offs_m[:, None]) & kmask[None, :], pr, 0.0)
    dp = tl.dot(do, vT, input_precision=PREC)
    ds = pr * (dp - delta[:, None])
    return tl.dot(ds.to(kk.dtype), kk, dq, input_precision=PREC)


@triton.jit
def _bwd_dq_kernel(Q, K, V, O, DO, DQ, LSE, DELTA, KD, VD, blk_start, blk_end, q2k_start, q2k_cnt, q_order,
                   qk_scale, sm_scale, T, NB, WK,
                   sqt, sqh, skt, skh, svt, svh, sot, soh, sdot, sdoh, sdqt, sdqh,
                   G: tl.constexpr, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   D: tl.constexpr, PREC: tl.constexpr, HEAD_OUTER: tl.constexpr, STORE_DELTA: tl.constexpr,
                   TMA: tl.constexpr):
    hq, r, qs, qe, m0 = _program_tile(q_order, blk_start, blk_end, BLOCK, BM, HEAD_OUTER)
    hk = hq // G
    NSN: tl.constexpr = BLOCK // BN
    if m0 < qe:
        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        mmask = offs_m < qe - m0
        mb = m0.to(tl.int64)
        q = tl.load(Q + mb * sqt + hq * sqh + offs_m[:, None] * sqt + offs_d[None, :], mask=mmask[:, None],
                    other=0.0)
        do = tl.load(DO + mb * sdot + hq * sdoh + offs_m[:, None] * sdot + offs_d[None, :], mask=mmask[:, None],
                     other=0.0)
        lse = tl.load(LSE + hq.to(tl.int64) * T + m0 + offs_m, mask=mmask, other=0.0)
        if STORE_DELTA:
            # delta = rowsum(dO * O), computed here and stored for the dK/dV kernel (which runs after this one)
            o = tl.load(O + mb * sot + hq * soh + offs_m[:, None] * sot + offs_d[None, :], mask=mmask[:, None],
                        other=0.0)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
            tl.store(DELTA + hq.to(tl.int64) * T + m0 + offs_m, delta, mask=mmask)
        else:
            delta = tl.load(DELTA + hq.to(tl.int64) * T + m0 + offs_m, mask=mmask, other=0.0)
        dq = tl.zeros([BM, D], tl.float32)
        row = hk * NB + r
        lst = q2k_start + row.to(tl.int64) * WK
        Kh = K + hk * skh
        Vh = V + hk * svh
        k_off = offs_n[:, None] * skt + offs_d[None, :]
        v_off = offs_n[None, :] * svt + offs_d[:, None]
        for it in range(0, (tl.load(q2k_cnt + row) - 1) * NSN):
            kb = tl.load(lst + it // NSN) + (it % NSN) * BN
            if TMA:
                kk = KD.load([kb, hk * D])
                vT = tl.trans(VD.load([kb, hk * D]))
            else:
                kk = tl.load(Kh + kb.to(tl.int64) * skt + k_off)
                vT = tl.load(Vh + kb.to(tl.int64) * svt + v_off)
            dq = _dq_step(q, do, kk, vT, lse, delta, dq, qk_scale, 0, 0, offs_n, offs_m, None, MASK=False,
                          PREC=PREC)
        hi = tl.minimum(m0 + BM, qe)
        for j in tl.static_range(NSN):
            n0 = qs + j * BN
            if n0 < hi:
                kmask = offs_n < qe - n0
                kb = n0.to(tl.int64)
                kk = tl.load(Kh + kb * skt + k_off, mask=kmask[:, None], other=0.0)
                vT = tl.load(Vh + kb * svt + v_off, mask=kmask[None, :], other=0.0)
                dq = _dq_step(q, do, kk, vT, lse, delta, dq, qk_scale, n0, m0, offs_n, offs_m, kmask, MASK=True,
                              PREC=PREC)
        dq = dq * sm_scale
        tl.store(DQ + mb * sdqt + hq * sdqh + offs_m[:, None] * sdqt + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=mmask[:, None])


@triton.jit
def _delta_kernel(O, DO, DELTA, T, sot, soh, sdot, sdoh, BT: tl.constexpr, D: tl.constexpr):
    """delta = rowsum(dO * O) ``[Hq, T]`` float32, for the dQ and dK/dV kernels."""
    t0 = tl.program_id(0) * BT
    h = tl.program_id(1)
    offs_t = t0 + tl.arange(0, BT)
    offs_d = tl.arange(0, D)
    tmask = offs_t < T
    rows = offs_t.to(tl.int64)[:, None]
    o = tl.load(O + rows * sot + h * soh + offs_d[None, :], mask=tmask[:, None], other=0.0)
    do = tl.load(DO + rows * sdot + h * sdoh + offs_d[None, :], mask=tmask[:, None], other=0.0)
    tl.store(DELTA + h.to(tl.int64) * T + offs_t, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=tmask)


@triton.jit
def _dkdv_tile(kk, vv, dk, dv, Qh, DOh, QD, DOD, col, LSEh, DELh, q0, qlen, kv0, offs_n, offs_m, offs_d, sqt, sdot,
               qk_scale, MASK_DIAG: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr):
    """dK/dV contribution of the query rows [q0, q0 + BM) (valid below ``qlen`` of them) to KV rows kv0 + offs_n;
    with TMA, Q and dO come from the descriptors QD / DOD at [q0, col] (full tiles only: a box cannot stop at
    a document's end). S and dP are computed query-major (Q K^T, dO V^T), as FlashAttention-3's backward does:
    K and V are the shared-memory operand of both matmuls, and P^T, dS^T reach the dV, dK matmuls through
    shared memory. Key-major (K Q^T, V dO^T) at the same 64 x 64 tiles spilled 30 registers on the H200
    (Triton 3.6) and slowed down when pipelined; query-major compiles without spills and gains from 2 stages."""
    qmask = offs_m < qlen
    if TMA:
        q = QD.load([q0, col])
        do = DOD.load([q0, col])
    else:
        # rows past the bound re-read the last valid row rather than load under a mask (faster, and never
        # another document's data); their lse of +inf zeroes their probabilities, hence their contributions
        rows = tl.minimum(q0 + offs_m, q0 + qlen - 1).to(tl.int64)
        q = tl.load(Qh + rows[:, None] * sqt + offs_d[None, :])
        do = tl.load(DOh + rows[:, None] * sdot + offs_d[None, :])
    lse = tl.load(LSEh + q0 + offs_m, mask=qmask, other=float("inf"))
    delta = tl.load(DELh + q0 + offs_m, mask=qmask, other=0.0)
    s = tl.dot(q, tl.trans(kk), input_precision=PREC) * qk_scale
    p = tl.math.exp2(s - lse[:, None])
    if MASK_DIAG:
        p = tl.where((kv0 + offs_n[None, :] <= q0 + offs_m[:, None]) & qmask[:, None], p, 0.0)
    dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PREC)
    dp = tl.dot(do, tl.trans(vv), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, QD, DOD, blk_start, blk_end, k2q_ptr, k2q_start, k2q_end,
                     k_order, qk_scale, sm_scale, T, NB,
                     sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sdkt, sdkh, sdvt, sdvh,
                     G: tl.constexpr, BLOCK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                     D: tl.constexpr, PREC: tl.constexpr, HEAD_OUTER: tl.constexpr, TMA: tl.constexpr):
    hk, c, ks, ke, n0 = _program_tile(k_order, blk_start, blk_end, BLOCK, BN, HEAD_OUTER)
    NSM: tl.constexpr = BLOCK // BM
    if n0 < ke:
        offs_n = tl.arange(0, BN)
        offs_m = tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        nmask = offs_n < ke - n0
        nb = n0.to(tl.int64)
        kk = tl.load(K + nb * skt + hk * skh + offs_n[:, None] * skt + offs_d[None, :], mask=nmask[:, None],
                     other=0.0)
        vv = tl.load(V + nb * svt + hk * svh + offs_n[:, None] * svt + offs_d[None, :], mask=nmask[:, None],
                     other=0.0)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        row = hk * NB + c
        e0 = tl.load(k2q_ptr + row) + 1
        e_end = tl.load(k2q_ptr + row + 1)
        # TMA tiles cannot stop at a document's end, so with TMA the last entry (the only one that can be a
        # document's partial last block: the list ascends within one document) runs after the loop, by pointers
        LAST_APART: tl.constexpr = TMA
        n_it = (e_end - e0 - LAST_APART) * NSM
        for g in range(0, G):
            hq = hk * G + g
            Qh = Q + hq * sqh
            DOh = DO + hq * sdoh
            LSEh = LSE + hq.to(tl.int64) * T
            DELh = DELTA + hq.to(tl.int64) * T
            # diagonal block (first entry of the reverse list), masked
            for j in tl.static_range(NSM):
                mq = ks + j * BM
                if (mq + BM > n0) & (mq < ke):
                    dk, dv = _dkdv_tile(kk, vv, dk, dv, Qh, DOh, QD, DOD, hq * D, LSEh, DELh, mq, ke - mq, n0,
                                        offs_n, offs_m, offs_d, sqt, sdot, qk_scale, MASK_DIAG=True, TMA=False,
                                        PREC=PREC)
            # one flat loop over the BM-row sub-tiles of the later query blocks, software-pipelined by
            # num_stages; only a document's last block can be partial, hence the row bound
            for it in range(0, n_it):
                e = e0 + it // NSM
                q0 = tl.load(k2q_start + e) + (it % NSM) * BM
                dk, dv = _dkdv_tile(kk, vv, dk, dv, Qh, DOh, QD, DOD, hq * D, LSEh, DELh, q0,
                                    tl.load(k2q_end + e) - q0, n0, offs_n, offs_m, offs_d, sqt, sdot, qk_scale,
                                    MASK_DIAG=False, TMA=TMA, PREC=PREC)
            if LAST_APART:
                if e_end > e0:
                    for j in tl.static_range(NSM):
                        q0 = tl.load(k2q_start + e_end - 1) + j * BM
                        qlen = tl.load(k2q_end + e_end - 1) - q0
                        if qlen > 0:
                            dk, dv = _dkdv_tile(kk, vv, dk, dv, Qh, DOh, QD, DOD, hq * D, LSEh, DELh, q0, qlen,
                                                n0, offs_n, offs_m, offs_d, sqt, sdot, qk_scale, MASK_DIAG=False,
                                                TMA=False, PREC=PREC)
        dk = dk * sm_scale
        tl.store(DK + nb * sdkt + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=nmask[:, None])
        tl.store(DV + nb * sdvt + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=nmask[:, None])


@triton.jit
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
    _pool_kernel[(lay.num_blocks, num_kv_heads, planes)](x, k, out, lay.block_start, lay.block_end, x.stride(0),
                                                         x.stride(1), k.stride(0), k.stride(1), lay.num_blocks,
                                                         G=H // num_kv_heads, BLOCK=lay.block_size, D=D,
                                                         num_warps=4)
    return out[0] if planes == 1 else (out[0], out[1])


@triton.jit
def _select_kernel(QB, KB, block_doc, doc_first, blk_start, row_offset, budget, SCR,
                   OUT_IDX, OUT_START, OUT_CNT, OUT_COV, KCNT,
                   scale, NB, WOUT, TOTC,
                   HKV: tl.constexpr, TOPP: tl.constexpr, D: tl.constexpr, CH: tl.constexpr, WP2: tl.constexpr):
    """One program per (query block g, KV head h): routing scores over the causal blocks of g's document,
    softmax, then the kept set by an exact binary search over the float bit patterns (top-k: the k-th
    largest key; top-p: the smallest prefix of the descending order reaching mass p), diagonal forced.
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
    kk = tl.minimum(tl.maximum(tl.floor(bud * n.to(tl.float32) + 0.5), 1.0), n.to(tl.float32))
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


def select_rows_triton(qbar, kbar, lay, budget, topp: bool, scale: float, wout: int):
    """Launch _select_kernel; returns (q2k_idx, q2k_start [Hkv, NB, wout], cnt [Hkv, NB], cov [Hkv, NB],
    kcnt [1 + Hkv * NB + 2]: a zero, the rows keeping each KV block, then the widest row, then a slot for the
    nonzero count that doc_stats_triton fills; its cumsum over the first 1 + Hkv * NB is the CSR pointer)."""
    NB, Hkv, D = qbar.shape
    dev = qbar.device
    wp2 = max(16, triton.next_power_of_2(lay.max_doc_blocks))
    scr = torch.empty(Hkv * lay.total_causal, dtype=torch.float32, device=dev)
    # slots past a row's count are never read (every consumer masks by q2k_cnt): no fill needed
    idx = torch.empty(Hkv, NB, wout, dtype=torch.int32, device=dev)
    start = torch.empty(Hkv, NB, wout, dtype=torch.int32, device=dev)
    cnt = torch.empty(Hkv, NB, dtype=torch.int32, device=dev)
    cov = torch.empty(Hkv, NB, dtype=torch.float32, device=dev)
    kcnt = torch.zeros(1 + Hkv * NB + 2, dtype=torch.int32, device=dev)
    _select_kernel[(NB, Hkv)](qbar, kbar, lay.block_doc, lay.doc_first_block_t, lay.block_start, lay.row_offset,
                              budget, scr, idx, start, cnt, cov, kcnt[1:], scale, NB, wout, lay.total_causal,
                              HKV=Hkv, TOPP=topp, D=D, CH=64, WP2=wp2, num_warps=4 if wp2 <= 512 else 8)
    return idx, start, cnt, cov, kcnt


@triton.jit
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
    _reverse_kernel[(NB, Hkv)](q2k_idx, q2k_cnt, lay.block_doc, lay.doc_first_block_t, lay.block_start,
                               lay.block_end, k2q_ptr, *out, NB, W, max(1, W.bit_length()), CH=64, num_warps=2)
    return out


@triton.jit
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
    _doc_stats_kernel[(lay.num_docs,)](cnt, cov, lay.doc_first_block_t, lay.doc_causal_t, kept, cv,
                                       kcnt[Hkv * NB + 2:], kcnt, ptr, NB, Hkv, CH=64, SCH=1024, num_warps=4)
    return kept, cv, ptr


LAST_COMPILED: dict = {}  # diagnostics: the last compiled kernel of each kind (registers, spills, PTX)
POISON_OUTPUTS = False  # tests set this: outputs start as NaN so a missed write fails


def _empty(shape, like: torch.Tensor, dtype=None):
    dtype = dtype or like.dtype
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


def _prec(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """Hopper or later (cached: the launchers ask on every call)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def _stages(cfg: dict, tma: bool) -> int:
    """Pipeline stages of a launch: the config's, or its FALLBACK_STAGES where it asks for TMA that cannot run."""
    return cfg["num_stages"] if tma or not cfg.get("TMA") else cfg.get("FALLBACK_STAGES", cfg["num_stages"])


# TMA costs host time on every launch: two TensorDescriptor objects here, and in Triton's launcher a CUtensorMap
# encoded per descriptor and the argument list re-packed in Python: a third of the host path at 8K / kept 0.05
# (lab 16). Lab 17 (8K, H=16, D=128, fwd+bwd): pointer tiles cut the host-bound do_bench time 0.90 -> 0.68 ms
# at 3.0e7 kept token pairs and 1.09 -> 0.85 ms at 5.6e7, for 1.0% and 3.5% more GPU time (3 and 14 us); at
# 1.4e8 and 2.8e8 they cost 6% and 8% of GPU time (45 and 100 us), which a GPU-bound training step would pay.
# So launches below this many kept (query, key) token pairs, where the GPU saving is a few microseconds, take
# pointer tiles.
TMA_MIN_PAIRS = 1 << 27


def kept_pairs(q, k, sel) -> int:
    """Kept (query, key) token pairs over all query heads, counted in whole blocks; where only the device
    knows the kept entries, k2q_idx's length bounds them (the sort-built lists are padded to the widest row)."""
    B = sel.layout.block_size
    kept = sel.kept_entries if sel.kept_entries is not None else sel.k2q_idx.numel()
    return kept * B * B * (q.shape[1] // k.shape[1])


def _descriptors(cfg: dict, rows: int, pairs: int, *xs):
    """Tensor descriptors of each ``[T, H, D]`` tensor's ``[T, H*D]`` view with ``[rows, D]`` boxes when the
    config asks for TMA, the launch keeps at least TMA_MIN_PAIRS token ``pairs``, and TMA can run: Hopper or
    later with 16-bit inputs and D 64 or 128 (the sizes ``benchmarks/attention.py --check`` validates on the
    GPU), or the interpreter; unit D stride, heads D apart, 16-byte aligned base and token stride. Otherwise
    Nones (pointer tiles)."""
    x0 = xs[0]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    able = cfg.get("TMA") and pairs >= TMA_MIN_PAIRS and (interpret or (
        x0.is_cuda and x0.element_size() == 2 and x0.shape[2] in (64, 128) and _has_tma(x0.device)))
    if not able or not all(x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.data_ptr() % 16 == 0
                           and x.stride(0) * x.element_size() % 16 == 0 for x in xs):
        return (None,) * len(xs)
    if not interpret:
        _bind_context(x0.device)
    return tuple(TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], [rows, x.shape[2]])
                 for x in xs)


_THREAD = threading.local()


def _bind_context(device: torch.device):
    """Make the device's primary CUDA context current on this thread. Triton encodes a launch's TMA
    descriptors before its launcher binds a context, which fails ("invalid device context") on a thread whose
    first CUDA work that launch is, e.g. autograd's device thread when this kernel's backward runs first in it
    (measured on the H200, Triton 3.6). Any CUDA runtime call binds it; a stream query is cheap and never
    waits."""
    if getattr(_THREAD, "bound", None) != device:
        torch.cuda.current_stream(device).query()
        _THREAD.bound = device


def sparse_attn_fwd(q, k, v, sel, sm_scale):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    cfg = get_config("fwd", B, D, row_blocks=sel.row_blocks)
    o = _empty((T, Hq, D), q)
    lse = _empty((Hq, T), q, torch.float32)
    kd, vd = _descriptors(cfg, cfg["BN"], kept_pairs(q, k, sel), k, v)
    grid = _grid(cfg, Hq, NB * (B // cfg["BM"]))
    LAST_COMPILED["fwd"] = _fwd_kernel[grid](
        q, k, v, o, lse, kd, vd, lay.block_start, lay.block_end, sel.q2k_start, sel.q2k_cnt, sel.q_order,
        sm_scale * LOG2E, T, NB, sel.q2k_idx.shape[-1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        G=Hq // Hkv, BLOCK=B, BM=cfg["BM"], BN=cfg["BN"], D=D, PREC=_prec(q.dtype), HEAD_OUTER=cfg["HEAD_OUTER"],
        TMA=kd is not None, WS=kd is not None and cfg.get("WS", False), num_warps=cfg["num_warps"],
        num_stages=_stages(cfg, kd is not None))
    return o, lse


DELTA_TOKENS = 64  # tokens per program of the delta pre-pass


def sparse_attn_bwd_delta(o, do):
    """delta = rowsum(dO * O) ``[Hq, T]`` float32 (one pass over O and dO, before both backward kernels)."""
    T, Hq, D = o.shape
    delta = _empty((Hq, T), o, torch.float32)
    _delta_kernel[(triton.cdiv(T, DELTA_TOKENS), Hq)](o, do, delta, T, o.stride(0), o.stride(1), do.stride(0),
                                                       do.stride(1), BT=DELTA_TOKENS, D=D)
    return delta


def sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, sm_scale, delta=None, dq=None):
    """dQ ``[T, Hq, D]`` (into ``dq`` when given) and delta ``[Hq, T]``: the given one (from
    :func:`sparse_attn_bwd_delta`), or computed by this kernel from ``o`` and stored for the dK/dV kernel.
    ``do`` with a unit stride along D."""
    T, Hq, D = q.shape
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    store = delta is None
    delta = _empty((Hq, T), q, torch.float32) if store else delta
    dq = _empty(q.shape, q) if dq is None else dq
    cfg = get_config("dq", B, D, row_blocks=sel.row_blocks)
    kd, vd = _descriptors(cfg, cfg["BN"], kept_pairs(q, k, sel), k, v)
    LAST_COMPILED["dq"] = _bwd_dq_kernel[_grid(cfg, Hq, NB * (B // cfg["BM"]))](
        q, k, v, o, do, dq, lse, delta, kd, vd, lay.block_start, lay.block_end, sel.q2k_start, sel.q2k_cnt,
        sel.q_order,
        sm_scale * LOG2E, sm_scale, T, NB, sel.q2k_idx.shape[-1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
        G=Hq // k.shape[1], BLOCK=B, BM=cfg["BM"], BN=cfg["BN"], D=D, PREC=_prec(q.dtype),
        HEAD_OUTER=cfg["HEAD_OUTER"], STORE_DELTA=store, TMA=kd is not None, num_warps=cfg["num_warps"],
        num_stages=_stages(cfg, kd is not None))
    return dq, delta


def sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, sm_scale):
    """dK, dV ``[T, Hkv, D]`` from delta of :func:`sparse_attn_bwd_dq` or :func:`sparse_attn_bwd_delta`."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    dk = _empty(k.shape, k)
    dv = _empty(v.shape, v)
    # the reverse lists are as long as the forward ones, give or take the causal shape: one row-length key
    cfg = get_config("dkdv", B, D, row_blocks=sel.row_blocks)
    qd, dod = _descriptors(cfg, cfg["BM"], kept_pairs(q, k, sel), q, do)
    LAST_COMPILED["dkdv"] = _bwd_dkdv_kernel[_grid(cfg, Hkv, NB * (B // cfg["BN"]))](
        q, k, v, do, dk, dv, lse, delta, qd, dod, lay.block_start, lay.block_end, sel.k2q_ptr, sel.k2q_start,
        sel.k2q_end, sel.k_order,
        sm_scale * LOG2E, sm_scale, T, NB,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        G=Hq // Hkv, BLOCK=B, BN=cfg["BN"], BM=cfg["BM"], D=D, PREC=_prec(q.dtype), HEAD_OUTER=cfg["HEAD_OUTER"],
        TMA=qd is not None, num_warps=cfg["num_warps"], num_stages=_stages(cfg, qd is not None))
    return dk, dv


# When dQ runs on a side stream alongside dK/dV (benchmarks/results/trials/README.md, lab 8 on the H200): the
# overlap gained 2-6% of the backward where dK/dV has at most ~16 programs per SM (8K tokens MHA, 32K with GQA
# 4:1 or 8:1), and up to 25% where dK/dV has fewer programs than the GPU has slots (Qwen2.5-3B's two KV heads
# at 8K: calibration re-run); but the delta pre-pass it needs (one more read of O and dO) cost up to 3% where
# there are many waves (packed 64K at kept 0.1: 136 programs per SM), and its extra launches (~0.1 ms on a
# slow host) showed where the backward is short. At 62 programs per SM (32K MHA) it gained -1.3..+0.8% (lab
# 10), noise. Hence: few programs per SM, and enough kept work.
OVERLAP_MAX_PROGRAMS_PER_SM = 32
OVERLAP_MIN_PAIRS = 1 << 27  # kept (query, key) token pairs over all query heads
_SIDE: dict = {}  # per device: (side stream, fork event, join event, SM count), made once (host time)


def overlap_pays(programs: int, sms: int, pairs: int) -> bool:
    """Whether the overlapped backward pays: ``programs`` dK/dV programs on ``sms`` SMs, ``pairs`` kept
    (query, key) token pairs over all query heads."""
    return programs <= OVERLAP_MAX_PROGRAMS_PER_SM * sms and pairs >= OVERLAP_MIN_PAIRS


def _overlap_backward(q, k, sel) -> bool:
    if not q.is_cuda:
        return False
    B = sel.layout.block_size
    programs = k.shape[1] * sel.layout.num_blocks * (B // get_config("dkdv", B, q.shape[-1], sel.row_blocks)["BN"])
    # kept_pairs' bound (where only the device knows the kept entries) errs towards the overlap
    return overlap_pays(programs, _side(q.device)[3], kept_pairs(q, k, sel))


def _side(device):
    hit = _SIDE.get(device)
    if hit is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        hit = _SIDE[device] = (torch.cuda.Stream(device), torch.cuda.Event(), torch.cuda.Event(), sms)
    return hit


def sparse_attn_bwd(do, q, k, v, o, lse, sel, sm_scale):
    """dQ, dK, dV. Where it pays (:func:`_overlap_backward`) dQ runs on a side stream alongside dK/dV
    (launched first: its programs are the longer ones), so that each kernel's last wave overlaps the other's
    instead of idling SMs; unlike one fused grid, each keeps its own tiles and warps."""
    do = do.contiguous() if do.stride(-1) != 1 else do
    if not _overlap_backward(q, k, sel):
        dq, delta = sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, sm_scale)
        return (dq, *sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, sm_scale))
    side, fork, join, _ = _side(q.device)
    main = torch.cuda.current_stream(q.device)
    delta = sparse_attn_bwd_delta(o, do)
    # allocated on the main stream, where it is consumed and freed; the side stream writes it before the
    # main stream waits for it
    dq = _empty(q.shape, q)
    fork.record(main)
    side.wait_event(fork)
    dk, dv = sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, sm_scale)
    torch.cuda.set_stream(side)
    try:
        sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, sm_scale, delta=delta, dq=dq)
    finally:
        torch.cuda.set_stream(main)
    join.record(side)
    main.wait_event(join)
    return dq, dk, dv


class SparseAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sel, sm_scale):
        # kernels take any token/head strides but need a unit stride along D
        q, k, v = [x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v)]
        o, lse = sparse_attn_fwd(q, k, v, sel, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.sel = sel
        ctx.sm_scale = sm_scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = sparse_attn_bwd(do, q, k, v, o, lse, ctx.sel, ctx.sm_scale)
        return dq, dk, dv, None, None
