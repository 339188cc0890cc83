"""Scratch lab (not for landing): the backward as one launch (dK/dV and dQ programs in one grid, delta from a\nsmall pre-pass) against the package's two launches (dQ, which writes delta, then dK/dV)."""
import itertools, math, os, sys
import torch, triton, triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.sparse_attention import select_blocks
from kernels.sparse_attention import triton_kernels as tk
from kernels.sparse_attention.triton_kernels import _dkdv_tile, _dq_step


@triton.jit
def _delta_kernel(O, DO, DELTA, T, sot, soh, sdot, sdoh, BM: tl.constexpr, D: tl.constexpr):
    m0 = tl.program_id(0) * BM
    h = tl.program_id(1)
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    mask = offs_m < T
    o = tl.load(O + h * soh + offs_m.to(tl.int64)[:, None] * sot + offs_d[None, :], mask=mask[:, None], other=0.0)
    do = tl.load(DO + h * sdoh + offs_m.to(tl.int64)[:, None] * sdot + offs_d[None, :], mask=mask[:, None],
                 other=0.0)
    tl.store(DELTA + h.to(tl.int64) * T + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=mask)


@triton.jit
def _fused_bwd_kernel(Q, K, V, DO, DQ, DK, DV, LSE, DELTA, blk_start, blk_end, q2k_start, q2k_cnt, q_order,
                      k2q_ptr, k2q_start, k2q_end, k_order, qk_scale, sm_scale, T, NB, WK, RKV, RQ, NKV_PROGS,
                      sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sdqt, sdqh, sdkt, sdkh, sdvt, sdvh,
                      G: tl.constexpr, BLOCK: tl.constexpr, QBM: tl.constexpr, QBN: tl.constexpr,
                      KBN: tl.constexpr, KBM: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr,
                      KV_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    NQ_PROGS = tl.num_programs(0) - NKV_PROGS
    if KV_FIRST:
        is_kv = pid < NKV_PROGS
        pkv = pid
        pq = pid - NKV_PROGS
    else:
        is_kv = pid >= NQ_PROGS
        pkv = pid - NQ_PROGS
        pq = pid
    offs_d = tl.arange(0, D)
    if is_kv:
        hk = pkv // RKV
        rr = pkv % RKV
        NSUB: tl.constexpr = BLOCK // KBN
        c = tl.load(k_order + rr // NSUB)
        ks = tl.load(blk_start + c)
        ke = tl.load(blk_end + c)
        n0 = ks + (rr % NSUB) * KBN
        NSM: tl.constexpr = BLOCK // KBM
        if n0 < ke:
            offs_n = tl.arange(0, KBN)
            offs_m = tl.arange(0, KBM)
            nmask = offs_n < ke - n0
            nb = n0.to(tl.int64)
            kk = tl.load(K + nb * skt + hk * skh + offs_n[:, None] * skt + offs_d[None, :], mask=nmask[:, None],
                         other=0.0)
            vv = tl.load(V + nb * svt + hk * svh + offs_n[:, None] * svt + offs_d[None, :], mask=nmask[:, None],
                         other=0.0)
            dk = tl.zeros([KBN, D], tl.float32)
            dv = tl.zeros([KBN, D], tl.float32)
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
                    mq = ks + j * KBM
                    if (mq + KBM > n0) & (mq < ke):
                        dk, dv = _dkdv_tile(kk, vv, dk, dv, Qh, DOh, LSEh, DELh, mq, ke - mq, n0, offs_n, offs_m,
                                            offs_d, sqt, sdot, qk_scale, MASK_DIAG=True, PREC=PREC)
                q0 = tl.load(k2q_start + e0, mask=e0 < e_end, other=0)
                qe = tl.load(k2q_end + e0, mask=e0 < e_end, other=0)
                for it in tl.range(0, n_it, num_stages=1):
                    nxt = it + 1
                    e = e0 + nxt // NSM
                    q0_next = tl.load(k2q_start + e, mask=nxt < n_it, other=0) + (nxt % NSM) * KBM
                    qe_next = tl.load(k2q_end + e, mask=nxt < n_it, other=0)
                    dk, dv = _dkdv_tile(kk, vv, dk, dv, Qh, DOh, LSEh, DELh, q0, qe - q0, n0, offs_n, offs_m,
                                        offs_d, sqt, sdot, qk_scale, MASK_DIAG=False, PREC=PREC)
                    q0 = q0_next
                    qe = qe_next
            dk = dk * sm_scale
            tl.store(DK + nb * sdkt + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
                     dk.to(DK.dtype.element_ty), mask=nmask[:, None])
            tl.store(DV + nb * sdvt + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
                     dv.to(DV.dtype.element_ty), mask=nmask[:, None])
    else:
        hq = pq // RQ
        rr = pq % RQ
        NSUBQ: tl.constexpr = BLOCK // QBM
        r = tl.load(q_order + rr // NSUBQ)
        qs = tl.load(blk_start + r)
        qe = tl.load(blk_end + r)
        m0 = qs + (rr % NSUBQ) * QBM
        hk = hq // G
        NSN: tl.constexpr = BLOCK // QBN
        if m0 < qe:
            offs_m = tl.arange(0, QBM)
            offs_n = tl.arange(0, QBN)
            mmask = offs_m < qe - m0
            mb = m0.to(tl.int64)
            q = tl.load(Q + mb * sqt + hq * sqh + offs_m[:, None] * sqt + offs_d[None, :], mask=mmask[:, None],
                        other=0.0)
            do = tl.load(DO + mb * sdot + hq * sdoh + offs_m[:, None] * sdot + offs_d[None, :],
                         mask=mmask[:, None], other=0.0)
            lse = tl.load(LSE + hq.to(tl.int64) * T + m0 + offs_m, mask=mmask, other=0.0)
            delta = tl.load(DELTA + hq.to(tl.int64) * T + m0 + offs_m, mask=mmask, other=0.0)
            dq = tl.zeros([QBM, D], tl.float32)
            row = hk * NB + r
            lst = q2k_start + row.to(tl.int64) * WK
            Kh = K + hk * skh
            Vh = V + hk * svh
            k_off = offs_n[:, None] * skt + offs_d[None, :]
            v_off = offs_n[None, :] * svt + offs_d[:, None]
            for it in range(0, (tl.load(q2k_cnt + row) - 1) * NSN):
                kb = (tl.load(lst + it // NSN) + (it % NSN) * QBN).to(tl.int64)
                kk = tl.load(Kh + kb * skt + k_off)
                vT = tl.load(Vh + kb * svt + v_off)
                dq = _dq_step(q, do, kk, vT, lse, delta, dq, qk_scale, 0, 0, offs_n, offs_m, None, MASK=False,
                              PREC=PREC)
            hi = tl.minimum(m0 + QBM, qe)
            for j in tl.static_range(NSN):
                n0 = qs + j * QBN
                if n0 < hi:
                    kmask = offs_n < qe - n0
                    kb = n0.to(tl.int64)
                    kk = tl.load(Kh + kb * skt + k_off, mask=kmask[:, None], other=0.0)
                    vT = tl.load(Vh + kb * svt + v_off, mask=kmask[None, :], other=0.0)
                    dq = _dq_step(q, do, kk, vT, lse, delta, dq, qk_scale, n0, m0, offs_n, offs_m, kmask,
                                  MASK=True, PREC=PREC)
            dq = dq * sm_scale
            tl.store(DQ + mb * sdqt + hq * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
                     dq.to(DQ.dtype.element_ty), mask=mmask[:, None])


def fused_bwd(do, q, k, v, o, lse, sel, sm_scale, w=8, s=3, kv_first=True, QBM=128, QBN=128, KBN=128, KBM=64):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    QBM, QBN, KBN, KBM = (min(x, B) for x in (QBM, QBN, KBN, KBM))
    delta = torch.empty((Hq, T), device=q.device, dtype=torch.float32)
    _delta_kernel[(triton.cdiv(T, 128), Hq)](o, do, delta, T, o.stride(0), o.stride(1), do.stride(0),
                                              do.stride(1), BM=128, D=D)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    RKV = NB * (B // KBN)
    RQ = NB * (B // QBM)
    ck = _fused_bwd_kernel[(Hkv * RKV + Hq * RQ,)](
        q, k, v, do, dq, dk, dv, lse, delta, lay.block_start, lay.block_end, sel.q2k_start, sel.q2k_cnt,
        sel.q_order, sel.k2q_ptr, sel.k2q_start, sel.k2q_end, sel.k_order, sm_scale * tk.LOG2E, sm_scale, T, NB,
        sel.q2k_idx.shape[-1], RKV, RQ, Hkv * RKV,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        G=Hq // Hkv, BLOCK=B, QBM=QBM, QBN=QBN, KBN=KBN, KBM=KBM, D=D, PREC=tk._prec(q.dtype), KV_FIRST=kv_first,
        num_warps=w, num_stages=s)
    return dq, dk, dv, ck


VARIANTS = {
    "fused_kvfirst": lambda *a: fused_bwd(*a, kv_first=True),
    "fused_qfirst": lambda *a: fused_bwd(*a, kv_first=False),
}


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


def run(shapes, dev, bench):
    rows = []
    for name, lens, Hq, Hkv, kf in shapes:
        T, D, B = sum(lens), (128 if dev == "cuda" else 64), (128 if dev == "cuda" else 64)
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
        args = (do, q, k, v, o, lse, sel, sc)
        ref = tk.sparse_attn_bwd(*args)
        ref_ms = bench(lambda: tk.sparse_attn_bwd(*args)) if bench else float("nan")
        print(f"{name} package bwd {ref_ms:.3f} ms", flush=True)
        for vn, fn in VARIANTS.items():
            try:
                out = fn(*args)
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out[:3], ref))
                ms = bench(lambda: fn(*args)) if bench else float("nan")
                info = f"regs={getattr(out[3], 'n_regs', '?')} spills={getattr(out[3], 'n_spills', '?')}"
            except Exception as ex:  # noqa: BLE001
                err, ms, info = float("nan"), float("nan"), repr(ex)[:300]
            rows.append(dict(shape=name, variant=vn, ms=ms, ref_ms=ref_ms, ratio=ref_ms / ms, err=err))
            print(f"{name} {vn} {ms:.3f} ms ratio {ref_ms / ms:.3f} err {err:.2e} {info}", flush=True)
        del q, k, v, o, lse, do, sel, args, ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "cpu":
        run([("docs", [70, 1, 130, 64, 200], 4, 2, 0.5), ("single", [320], 2, 2, 1.0)], "cpu", None)
    else:
        import pandas as pd
        from triton.testing import do_bench
        shapes = [("8k_dense", [8192], 16, 16, 1.0), ("8k_kf0.5", [8192], 16, 16, 0.5),
                  ("32k_kf0.1", [32768], 16, 16, 0.1), ("32k_dense", [32768], 16, 16, 1.0),
                  ("128k_kf0.25", [131072], 16, 16, 0.25), ("gqa4_32k_kf0.25", [32768], 16, 4, 0.25)]
        rows = run(shapes, "cuda", lambda f: do_bench(f, warmup=25, rep=150))
        df = pd.DataFrame(rows)
        df.to_csv(os.path.join(sys.argv[2], "lab4.csv"), index=False)
        print(df.pivot(index="variant", columns="shape", values="ratio").round(3).to_string())
