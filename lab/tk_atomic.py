"""Lab 20 (scratch, generated from the package's dK/dV kernel at 03ea8b5): dK/dV that also accumulates dQ
with fp32 atomics (as FlashAttention-2 and cuDNN do), so the backward runs 5 matmuls instead of 7: what the
issue's no-atomics (deterministic) rule costs. Not deterministic; never landed."""
import triton
import triton.language as tl

from kernels.sparse_attention.triton_kernels import _program_tile


@triton.jit
def _dkdv_tile(kk, vv, dk, dv, Qh, DOh, QD, DOD, col, LSEh, DELh, DQh, DQD, sdqt, sm_scale, q0, qlen, kv0, offs_n, offs_m, offs_d, sqt, sdot,
               qk_scale, MASK_DIAG: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr, DQTMA: tl.constexpr):
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
    # lab 20: dQ of these query rows from this key tile, added atomically (order not fixed: not deterministic)
    dq = tl.dot(ds.to(kk.dtype), kk, input_precision=PREC) * sm_scale
    if DQTMA:
        # one bulk TMA reduction per tile (rows past the document's end add zeros: their ds is 0)
        DQD.atomic_add([q0, col], dq)
    else:
        tl.atomic_add(DQh + (q0 + offs_m).to(tl.int64)[:, None] * sdqt + offs_d[None, :], dq, mask=qmask[:, None],
                      sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, DQA, LSE, DELTA, QD, DOD, DQD, blk_start, blk_end, k2q_ptr, k2q_start, k2q_end,
                     k_order, qk_scale, sm_scale, T, NB,
                     sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sdkt, sdkh, sdvt, sdvh, sdqt, sdqh,
                     G: tl.constexpr, BLOCK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                     D: tl.constexpr, PREC: tl.constexpr, HEAD_OUTER: tl.constexpr, TMA: tl.constexpr,
                     DQTMA: tl.constexpr):
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
            DQh = DQA + hq * sdqh
            # diagonal block (first entry of the reverse list), masked
            for j in tl.static_range(NSM):
                mq = ks + j * BM
                if (mq + BM > n0) & (mq < ke):
                    dk, dv = _dkdv_tile(kk, vv, dk, dv, Qh, DOh, QD, DOD, hq * D, LSEh, DELh, DQh, DQD, sdqt, sm_scale, mq, ke - mq, n0,
                                        offs_n, offs_m, offs_d, sqt, sdot, qk_scale, MASK_DIAG=True, TMA=False,
                                        PREC=PREC, DQTMA=DQTMA)
            # one flat loop over the BM-row sub-tiles of the later query blocks, software-pipelined by
            # num_stages; only a document's last block can be partial, hence the row bound
            for it in range(0, n_it):
                e = e0 + it // NSM
                q0 = tl.load(k2q_start + e) + (it % NSM) * BM
                dk, dv = _dkdv_tile(kk, vv, dk, dv, Qh, DOh, QD, DOD, hq * D, LSEh, DELh, DQh, DQD, sdqt, sm_scale, q0,
                                    tl.load(k2q_end + e) - q0, n0, offs_n, offs_m, offs_d, sqt, sdot, qk_scale,
                                    MASK_DIAG=False, TMA=TMA, PREC=PREC, DQTMA=DQTMA)
            if LAST_APART:
                if e_end > e0:
                    for j in tl.static_range(NSM):
                        q0 = tl.load(k2q_start + e_end - 1) + j * BM
                        qlen = tl.load(k2q_end + e_end - 1) - q0
                        if qlen > 0:
                            dk, dv = _dkdv_tile(kk, vv, dk, dv, Qh, DOh, QD, DOD, hq * D, LSEh, DELh, DQh, DQD, sdqt, sm_scale, q0, qlen,
                                                n0, offs_n, offs_m, offs_d, sqt, sdot, qk_scale, MASK_DIAG=False,
                                                TMA=False, PREC=PREC, DQTMA=DQTMA)
        dk = dk * sm_scale
        tl.store(DK + nb * sdkt + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=nmask[:, None])
        tl.store(DV + nb * sdvt + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=nmask[:, None])
