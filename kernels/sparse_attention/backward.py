"""Backward kernels of block-sparse varlen attention (dQ, dK/dV, the delta pre-pass) and their launchers.

Grids (see :func:`launch.grid`):
  dQ    : (Hq,  NB * BLOCK/BM)  one program per (query head, query tile), rows in ``q_order``;
  dK/dV : (Hkv, NB * BLOCK/BN)  one program per (KV head, KV tile), rows in ``k_order``; loops over the G query
          heads of the group and the reverse list of query blocks: no atomics, deterministic.
The diagonal block, the only one that needs a mask, is the last entry of a forward list and the first of a
reverse list. With ``TMA`` the dQ main loop loads its K/V tiles, and the dK/dV main loop its Q/dO tiles,
through host-built tensor descriptors (:func:`launch.descriptors`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (LOG2E, compile_options, dkdv_programs, empty, grid, kept_pairs, launch, overlap_pays,
                     precision, record, row_class_launches, tensor_descriptors, tile_variants, use_tma)
from .options import DEFAULT_OPTIONS, KernelOptions
from .tiles import program_tile


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


# data-dependent integers are never specialised (see forward._fwd_kernel)
@triton.jit(do_not_specialize=["T", "NB", "WK"])
def _bwd_dq_kernel(Q, K, V, O, DO, DQ, LSE, DELTA, KD, VD, blk_start, blk_end, q2k_start, q2k_cnt, q_order,
                   qk_scale, sm_scale, T, NB, WK,
                   sqt, sqh, skt, skh, svt, svh, sot, soh, sdot, sdoh, sdqt, sdqh,
                   G: tl.constexpr, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   D: tl.constexpr, PREC: tl.constexpr, HEAD_OUTER: tl.constexpr, STORE_DELTA: tl.constexpr,
                   TMA: tl.constexpr):
    hq, r, qs, qe, m0 = program_tile(q_order, blk_start, blk_end, BLOCK, BM, HEAD_OUTER)
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
        # diagonal block, masked, unrolled with a branch per sub-tile: the branch-free loop that speeds up the
        # forward and dK/dV makes this kernel take 3-18% longer on an H100
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


@triton.jit(do_not_specialize=["T"])
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
    shared memory. Key-major (K Q^T, V dO^T) at the same 64 x 64 tiles spills 30 registers on the H200
    (Triton 3.6) and slows down when pipelined; query-major compiles without spills and gains from 2 stages."""
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


@triton.jit(do_not_specialize=["T", "NB"])
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, QD, DOD, blk_start, blk_end, k2q_ptr, k2q_start, k2q_end,
                     k_order, qk_scale, sm_scale, T, NB,
                     sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sdkt, sdkh, sdvt, sdvh,
                     G: tl.constexpr, BLOCK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                     D: tl.constexpr, PREC: tl.constexpr, HEAD_OUTER: tl.constexpr, TMA: tl.constexpr):
    hk, c, ks, ke, n0 = program_tile(k_order, blk_start, blk_end, BLOCK, BN, HEAD_OUTER)
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
        # diagonal block (first entry of the reverse list), masked: one flat loop over (query head, BM-row
        # sub-tile that reaches these keys), without branches, so that it pipelines like the main loop (nested
        # per-head loops with a branch per sub-tile take 1.22-1.24x the time on a packed GQA 32:4 batch on an
        # H100, and spill 58 registers where this spills 12)
        j0 = (n0 - ks) // BM
        nd = tl.maximum(tl.minimum(NSM, (ke - ks + BM - 1) // BM) - j0, 1)
        for it in range(0, G * nd):
            hq = hk * G + it // nd
            mq = ks + (j0 + it % nd) * BM
            dk, dv = _dkdv_tile(kk, vv, dk, dv, Q + hq * sqh, DO + hq * sdoh, QD, DOD, hq * D,
                                LSE + hq.to(tl.int64) * T, DELTA + hq.to(tl.int64) * T, mq, ke - mq, n0,
                                offs_n, offs_m, offs_d, sqt, sdot, qk_scale, MASK_DIAG=True, TMA=False,
                                PREC=PREC)
        # one flat loop over (query head, BM-row sub-tile of the later query blocks), software-pipelined by
        # num_stages across heads too; only a document's last block can be partial, hence the row bound
        n_it = (e_end - e0 - LAST_APART) * NSM
        for it in range(0, G * n_it):
            # n_it is positive wherever the loop runs; the bound keeps a pipelined prologue off a zero divisor
            hq = hk * G + it // tl.maximum(n_it, 1)
            r = it % tl.maximum(n_it, 1)
            e = e0 + r // NSM
            q0 = tl.load(k2q_start + e) + (r % NSM) * BM
            dk, dv = _dkdv_tile(kk, vv, dk, dv, Q + hq * sqh, DO + hq * sdoh, QD, DOD, hq * D,
                                LSE + hq.to(tl.int64) * T, DELTA + hq.to(tl.int64) * T, q0,
                                tl.load(k2q_end + e) - q0, n0, offs_n, offs_m, offs_d, sqt, sdot, qk_scale,
                                MASK_DIAG=False, TMA=TMA, PREC=PREC)
        if LAST_APART:
            # the last entry by pointers, one flat loop over (query head, sub-tile) as above; without a last
            # entry, el is the diagonal's (a valid index) and the loop is empty
            el = e_end - 1
            ql = tl.load(k2q_start + el)
            nl = tl.where(e_end > e0, (tl.load(k2q_end + el) - ql + BM - 1) // BM, 0)
            for it in range(0, G * nl):
                hq = hk * G + it // tl.maximum(nl, 1)
                q0 = ql + (it % tl.maximum(nl, 1)) * BM
                dk, dv = _dkdv_tile(kk, vv, dk, dv, Q + hq * sqh, DO + hq * sdoh, QD, DOD, hq * D,
                                    LSE + hq.to(tl.int64) * T, DELTA + hq.to(tl.int64) * T, q0,
                                    tl.load(k2q_end + el) - q0, n0, offs_n, offs_m, offs_d, sqt, sdot, qk_scale,
                                    MASK_DIAG=False, TMA=False, PREC=PREC)
        dk = dk * sm_scale
        tl.store(DK + nb * sdkt + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=nmask[:, None])
        tl.store(DV + nb * sdvt + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=nmask[:, None])


DELTA_TOKENS = 64  # tokens per program of the delta pre-pass


def sparse_attn_bwd_delta(o, do, options: KernelOptions = DEFAULT_OPTIONS):
    """delta = rowsum(dO * O) ``[Hq, T]`` float32 (one pass over O and dO, before both backward kernels)."""
    T, Hq, _ = o.shape
    delta = empty((Hq, T), o, options, torch.float32)
    kernel, args, kwargs = delta_arguments(o, do, delta)
    kernel[(triton.cdiv(T, DELTA_TOKENS), Hq)](*args, **kwargs)
    return delta


def delta_arguments(o, do, delta):
    """(kernel, args, kwargs) of the delta pre-pass into ``delta``."""
    return _delta_kernel, (o, do, delta, o.shape[0], o.stride(0), o.stride(1), do.stride(0), do.stride(1)), dict(
        BT=DELTA_TOKENS, D=o.shape[2])


def sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, sm_scale, delta=None, dq=None,
                       options: KernelOptions = DEFAULT_OPTIONS):
    """dQ ``[T, Hq, D]`` (into ``dq`` when given) and delta ``[Hq, T]``: the given one (from
    :func:`sparse_attn_bwd_delta`), or computed by this kernel from ``o`` and stored for the dK/dV kernel.
    ``do`` with a unit stride along D."""
    T, Hq, D = q.shape
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    store = delta is None
    delta = empty((Hq, T), q, options, torch.float32) if store else delta
    dq = empty(q.shape, q, options) if dq is None else dq
    pairs = kept_pairs(q, k, sel)
    G = Hq // k.shape[1]

    def arguments(cfg, ends, tma, store) -> tuple[tuple, dict]:
        kd, vd = tensor_descriptors(cfg["BN"], k, v) if tma else (None, None)
        args = (q, k, v, o, do, dq, lse, delta, kd, vd, lay.block_start, ends, sel.q2k_start, sel.q2k_cnt,
                sel.q_order, sm_scale * LOG2E, sm_scale, T, NB, sel.q2k_idx.shape[-1],
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
                o.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1))
        return args, dict(G=G, BLOCK=B, BM=cfg["BM"], BN=cfg["BN"], D=D, PREC=precision(q.dtype),
                          HEAD_OUTER=cfg["HEAD_OUTER"], STORE_DELTA=store, TMA=tma, **compile_options(cfg, tma))

    def variants():
        # either tile path, with the delta stored here (sequential) or read from the pre-pass (overlapped)
        return [(c, t, st) for c, t in tile_variants("dq", B, D, options, k, v, group=G) for st in (True, False)]

    for name, cfg, ends in row_class_launches("dq", sel, D, options, G):
        tma = use_tma(cfg, pairs, k, v)
        siblings = lambda ends=ends, cfg=cfg, tma=tma: [  # noqa: E731
            (_bwd_dq_kernel, *arguments(c, ends, t, st)) for c, t, st in variants() if (c, t, st) != (cfg, tma, store)
        ] + [delta_arguments(o, do, delta)]  # the overlapped backward's pre-pass, which some batch may take
        compiled = launch(_bwd_dq_kernel, grid(cfg, Hq, NB * (B // cfg["BM"])), *arguments(cfg, ends, tma, store),
                          siblings if options.precompile else tuple)
        record(options, name, compiled)
    return dq, delta


def sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, sm_scale, options: KernelOptions = DEFAULT_OPTIONS):
    """dK, dV ``[T, Hkv, D]`` from delta of :func:`sparse_attn_bwd_dq` or :func:`sparse_attn_bwd_delta`."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    dk = empty(k.shape, k, options)
    dv = empty(v.shape, v, options)
    pairs = kept_pairs(q, k, sel)
    G = Hq // Hkv

    def arguments(cfg, ends, tma) -> tuple[tuple, dict]:
        qd, dod = tensor_descriptors(cfg["BM"], q, do) if tma else (None, None)
        args = (q, k, v, do, dk, dv, lse, delta, qd, dod, lay.block_start, ends, sel.k2q_ptr, sel.k2q_start,
                sel.k2q_end, sel.k_order, sm_scale * LOG2E, sm_scale, T, NB,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1))
        return args, dict(G=G, BLOCK=B, BN=cfg["BN"], BM=cfg["BM"], D=D, PREC=precision(q.dtype),
                          HEAD_OUTER=cfg["HEAD_OUTER"], TMA=tma, **compile_options(cfg, tma))

    # the reverse lists are as long as the forward ones, give or take the causal shape: one row-length key
    for name, cfg, ends in row_class_launches("dkdv", sel, D, options, G):
        tma = use_tma(cfg, pairs, q, do)
        siblings = lambda ends=ends, cfg=cfg, tma=tma: (  # noqa: E731
            (_bwd_dkdv_kernel, *arguments(c, ends, t)) for c, t in tile_variants("dkdv", B, D, options, q, do, group=G)
            if (c, t) != (cfg, tma))
        compiled = launch(_bwd_dkdv_kernel, grid(cfg, Hkv, NB * (B // cfg["BN"])), *arguments(cfg, ends, tma),
                          siblings if options.precompile else tuple)
        record(options, name, compiled)
    return dk, dv


_SIDE: dict = {}  # per device: (side stream, fork event, join event, SM count), made once (host time)


def _side(device):
    hit = _SIDE.get(device)
    if hit is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        hit = _SIDE[device] = (torch.cuda.Stream(device), torch.cuda.Event(), torch.cuda.Event(), sms)
    return hit


def overlap_backward(q, k, sel, options: KernelOptions = DEFAULT_OPTIONS) -> bool:
    """Whether this backward runs dQ on a side stream (:func:`launch.overlap_pays`; CUDA only)."""
    if not q.is_cuda:
        return False
    return overlap_pays(dkdv_programs(q, k, sel, options), _side(q.device)[3])


def sparse_attn_bwd(do, q, k, v, o, lse, sel, sm_scale, options: KernelOptions = DEFAULT_OPTIONS):
    """dQ, dK, dV. Where it pays (:func:`overlap_backward`) dQ runs on a side stream alongside dK/dV
    (launched first: its programs are the longer ones), so that each kernel's last wave overlaps the other's
    instead of idling SMs; unlike one fused grid, each keeps its own tiles and warps."""
    do = do.contiguous() if do.stride(-1) != 1 else do
    if not overlap_backward(q, k, sel, options):
        dq, delta = sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, sm_scale, options=options)
        return (dq, *sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, sm_scale, options))
    side, fork, join, _ = _side(q.device)
    main = torch.cuda.current_stream(q.device)
    delta = sparse_attn_bwd_delta(o, do, options)
    # allocated on the main stream, where it is consumed and freed; the side stream writes it before the
    # main stream waits for it
    dq = empty(q.shape, q, options)
    fork.record(main)
    side.wait_event(fork)
    dk, dv = sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, sm_scale, options)
    torch.cuda.set_stream(side)
    try:
        sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, sm_scale, delta=delta, dq=dq, options=options)
    finally:
        torch.cuda.set_stream(main)
    join.record(side)
    main.wait_event(join)
    return dq, dk, dv
