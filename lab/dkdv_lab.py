"""Scratch lab (not for landing): dK/dV kernel variants timed alone against the package kernel."""
import itertools, json, math, sys, os
import torch, triton, triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.sparse_attention import select_blocks
from kernels.sparse_attention import triton_kernels as tk
from kernels.sparse_attention.triton_kernels import _program_tile, _dkdv_tile


@triton.jit
def _tile_loads(Qh, DOh, LSEh, DELh, q0, qlen, offs_m, offs_d, sqt, sdot, T, NOMASK: tl.constexpr):
    qmask = offs_m < qlen
    if NOMASK:
        # rows past the bound read real (clamped) rows; lse=+inf zeroes their probabilities
        rows = tl.minimum(q0 + offs_m, T - 1).to(tl.int64)
        qT = tl.load(Qh + rows[None, :] * sqt + offs_d[:, None])
        do = tl.load(DOh + rows[:, None] * sdot + offs_d[None, :])
    else:
        qb = q0.to(tl.int64)
        qT = tl.load(Qh + qb * sqt + offs_m[None, :] * sqt + offs_d[:, None], mask=qmask[None, :], other=0.0)
        do = tl.load(DOh + qb * sdot + offs_m[:, None] * sdot + offs_d[None, :], mask=qmask[:, None], other=0.0)
    lse = tl.load(LSEh + q0 + offs_m, mask=qmask, other=float("inf"))
    delta = tl.load(DELh + q0 + offs_m, mask=qmask, other=0.0)
    return qT, do, lse, delta


@triton.jit
def _tile_math(kk, vv, dk, dv, qT, do, lse, delta, qk_scale, PREC: tl.constexpr):
    sT = tl.dot(kk, qT, input_precision=PREC) * qk_scale
    pT = tl.math.exp2(sT - lse[None, :])
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
    dpT = tl.dot(vv, tl.trans(do), input_precision=PREC)
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _lab_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, blk_start, blk_end, k2q_ptr, k2q_start, k2q_end, k_order,
                     qk_scale, sm_scale, T, NB,
                     sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sdkt, sdkh, sdvt, sdvh,
                     G: tl.constexpr, BLOCK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                     D: tl.constexpr, PREC: tl.constexpr, HEAD_OUTER: tl.constexpr,
                     PF_IDX: tl.constexpr, PF_TILE: tl.constexpr, NOMASK: tl.constexpr):
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
        n_it = (e_end - e0) * NSM
        for g in range(0, G):
            hq = hk * G + g
            Qh = Q + hq * sqh
            DOh = DO + hq * sdoh
            LSEh = LSE + hq.to(tl.int64) * T
            DELh = DELTA + hq.to(tl.int64) * T
            for j in tl.static_range(NSM):
                mq = ks + j * BM
                if (mq + BM > n0) & (mq < ke):
                    dk, dv = _dkdv_tile(kk, vv, dk, dv, Qh, DOh, LSEh, DELh, mq, ke - mq, n0, offs_n, offs_m,
                                        offs_d, sqt, sdot, qk_scale, MASK_DIAG=True, PREC=PREC)
            if PF_IDX:
                v0 = e0 < e_end
                q0c = tl.load(k2q_start + e0, mask=v0, other=0)
                qec = tl.load(k2q_end + e0, mask=v0, other=0)
                if PF_TILE:
                    qT, do, lse, delta = _tile_loads(Qh, DOh, LSEh, DELh, q0c, qec - q0c, offs_m, offs_d, sqt,
                                                     sdot, T, NOMASK)
                for it in range(0, n_it):
                    itn = it + 1
                    en = e0 + itn // NSM
                    vn = itn < n_it
                    q0n = tl.load(k2q_start + en, mask=vn, other=0) + (itn % NSM) * BM
                    qen = tl.load(k2q_end + en, mask=vn, other=0)
                    if PF_TILE:
                        qTn, don, lsen, deltan = _tile_loads(Qh, DOh, LSEh, DELh, q0n, qen - q0n, offs_m, offs_d,
                                                             sqt, sdot, T, NOMASK)
                        dk, dv = _tile_math(kk, vv, dk, dv, qT, do, lse, delta, qk_scale, PREC)
                        qT, do, lse, delta = qTn, don, lsen, deltan
                    else:
                        qT, do, lse, delta = _tile_loads(Qh, DOh, LSEh, DELh, q0c, qec - q0c, offs_m, offs_d,
                                                         sqt, sdot, T, NOMASK)
                        dk, dv = _tile_math(kk, vv, dk, dv, qT, do, lse, delta, qk_scale, PREC)
                    q0c = q0n
                    qec = qen
            else:
                for it in range(0, n_it):
                    e = e0 + it // NSM
                    q0 = tl.load(k2q_start + e) + (it % NSM) * BM
                    qT, do, lse, delta = _tile_loads(Qh, DOh, LSEh, DELh, q0, tl.load(k2q_end + e) - q0, offs_m,
                                                     offs_d, sqt, sdot, T, NOMASK)
                    dk, dv = _tile_math(kk, vv, dk, dv, qT, do, lse, delta, qk_scale, PREC)
        dk = dk * sm_scale
        tl.store(DK + nb * sdkt + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=nmask[:, None])
        tl.store(DV + nb * sdvt + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=nmask[:, None])


def lab_dkdv(do, q, k, v, lse, delta, sel, sm_scale, BN, BM, w, s, PF_IDX, PF_TILE, NOMASK):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    ck = _lab_dkdv_kernel[(NB * (B // BN), Hkv)](
        q, k, v, do, dk, dv, lse, delta, lay.block_start, lay.block_end, sel.k2q_ptr, sel.k2q_start, sel.k2q_end,
        sel.k_order, sm_scale * tk.LOG2E, sm_scale, T, NB,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        G=Hq // Hkv, BLOCK=B, BN=BN, BM=BM, D=D, PREC=tk._prec(q.dtype),
        HEAD_OUTER=True, PF_IDX=PF_IDX, PF_TILE=PF_TILE, NOMASK=NOMASK, num_warps=w, num_stages=s)
    return dk, dv, ck


# (name, BN, BM, warps, stages, PF_IDX, PF_TILE, NOMASK)
VARIANTS = [
    ("base_s1", 128, 64, 8, 1, 0, 0, 0),
    ("nomask_s1", 128, 64, 8, 1, 0, 0, 1),
    ("pfidx_s1", 128, 64, 8, 1, 1, 0, 0),
    ("pfidx_nomask_s1", 128, 64, 8, 1, 1, 0, 1),
    ("pftile_s1", 128, 64, 8, 1, 1, 1, 0),
    ("pftile_nomask_s1", 128, 64, 8, 1, 1, 1, 1),
    ("pfidx_s2", 128, 64, 8, 2, 1, 0, 0),
    ("pfidx_nomask_s3", 128, 64, 8, 3, 1, 0, 1),
    ("nomask_s3", 128, 64, 8, 3, 0, 0, 1),
    ("pftile_bm32_s1", 128, 32, 8, 1, 1, 1, 1),
    ("pftile_bn64w4_s1", 64, 64, 4, 1, 1, 1, 1),
    ("pfidx_bn64w4_s3", 64, 64, 4, 3, 1, 0, 1),
    ("pftile_bn64bm32w4_s1", 64, 32, 4, 1, 1, 1, 1),
]


def long_tail(total, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        x = int(math.exp(6.5 + 1.6 * torch.randn(1, generator=g).item()))
        lens.append(max(16, min(32768, x)))
    lens[-1] -= sum(lens) - total
    if lens[-1] <= 0:
        lens.pop()
        lens[-1] += total - sum(lens)
    return lens


def run(shapes, dev, bench, variants):
    rows = []
    for name, lens, Hq, Hkv, kf in shapes:
        T, D, B = sum(lens), 128 if dev == "cuda" else 64, 128 if dev == "cuda" else 64
        g = torch.Generator(device=dev).manual_seed(0)
        dt = torch.bfloat16 if dev == "cuda" else torch.float32
        q = torch.randn(T, Hq, D, device=dev, dtype=dt, generator=g)
        k = torch.randn(T, Hkv, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(T, Hkv, D, device=dev, dtype=dt, generator=g)
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=dev)
        sel = select_blocks(q, k, cu, kept_fraction=kf, block_size=B)
        sc = D ** -0.5
        o, lse = tk.sparse_attn_fwd(q, k, v, sel, sc)
        do = torch.randn_like(o)
        _, delta = tk.sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, sc)
        rk, rv = tk.sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, sc)
        nnz = int(sel.q2k_cnt.sum()) * Hq // Hkv
        flops = 4 * 2 * nnz * B * B * D
        ref_ms = bench(lambda: tk.sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, sc)) if bench else float("nan")
        print(f"{name} package {ref_ms:.3f} ms {flops / ref_ms / 1e9:.0f} TFLOP/s", flush=True)
        for vn, BN, BM, w, s, a, b, c in variants:
            try:
                dk, dv, ck = lab_dkdv(do, q, k, v, lse, delta, sel, sc, min(BN, B), min(BM, B), w, s, a, b, c)
                err = max((dk.float() - rk.float()).abs().max().item(), (dv.float() - rv.float()).abs().max().item())
                ms = bench(lambda: lab_dkdv(do, q, k, v, lse, delta, sel, sc, min(BN, B), min(BM, B), w, s, a, b, c)) if bench else float("nan")
                info = f"regs={getattr(ck, 'n_regs', '?')} spills={getattr(ck, 'n_spills', '?')}"
            except Exception as e:
                err, ms, info = float("nan"), float("nan"), repr(e)[:300]
            rows.append(dict(shape=name, variant=vn, ms=ms, ref_ms=ref_ms, ratio=ref_ms / ms, err=err))
            print(f"{name} {vn} {ms:.3f} ms ratio {ref_ms / ms:.3f} err {err:.2e} {info}", flush=True)
        del q, k, v, o, lse, do, delta, sel
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "cpu":
        shapes = [("docs", [70, 1, 130, 64, 200], 4, 2, 0.5), ("single", [320], 2, 2, 1.0)]
        run(shapes, "cpu", None, VARIANTS)
    else:
        import pandas as pd
        from triton.testing import do_bench
        shapes = [("128k_kf0.25", [131072], 16, 16, 0.25), ("32k_dense", [32768], 16, 16, 1.0),
                  ("32k_kf0.1", [32768], 16, 16, 0.1), ("gqa4_128k_kf0.25", [131072], 16, 4, 0.25),
                  ("packed64k_kf0.1", long_tail(65536), 16, 16, 0.1), ("packed64k_dense", long_tail(65536), 16, 16, 1.0)]
        rows = run(shapes, "cuda", lambda f: do_bench(f, warmup=25, rep=150), VARIANTS)
        df = pd.DataFrame(rows)
        df.to_csv(os.path.join(sys.argv[2], "lab.csv"), index=False)
        print(df.pivot(index="variant", columns="shape", values="ratio").round(3).to_string())
