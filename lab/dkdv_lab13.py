"""Lab 13 (scratch): dK/dV variants of the landed query-major kernel, each timed alone against the package
kernel in the same run (H=16, D=128, bf16, block 128, three interleaved rounds, median) and checked against it.

  TMA   Q and dO tiles of the main loop through host-built tensor descriptors over the [T, Hq*D] view (rows past
        a partial block read the next rows, or zeros past T; their lse of +inf zeroes them, as the clamp does).
  WS    tl.range(..., warp_specialize=True) on the main loop (with TMA).
  BM    query rows per step: 64 (landed) or 128 with 8 warps (two warpgroups, one per 64 query rows of S / dP;
        the dK / dV accumulators split over 256 threads).

Usage: PYTHONPATH=. python3 lab/dkdv_lab13.py OUT        (GPU)
       TRITON_INTERPRET=1 PYTHONPATH=. python3 lab/dkdv_lab13.py OUT --check-only   (CPU, small shapes)
"""
import csv
import json
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.sparse_attention import select_blocks
from kernels.sparse_attention import triton_kernels as tk


@triton.jit
def _tile(kk, vv, dk, dv, q, do, LSEh, DELh, q0, qlen, kv0, offs_n, offs_m, qk_scale,
          MASK_DIAG: tl.constexpr, PREC: tl.constexpr):
    qmask = offs_m < qlen
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
def _dkdv_var(Q, K, V, DO, DK, DV, LSE, DELTA, QD, DOD, blk_start, blk_end, k2q_ptr, k2q_start, k2q_end, k_order,
              qk_scale, sm_scale, T, NB,
              sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sdkt, sdkh, sdvt, sdvh,
              G: tl.constexpr, BLOCK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
              D: tl.constexpr, PREC: tl.constexpr, HEAD_OUTER: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    hk, c, ks, ke, n0 = tk._program_tile(k_order, blk_start, blk_end, BLOCK, BN, HEAD_OUTER)
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
                    rows = tl.minimum(mq + offs_m, ke - 1).to(tl.int64)
                    q = tl.load(Qh + rows[:, None] * sqt + offs_d[None, :])
                    do = tl.load(DOh + rows[:, None] * sdot + offs_d[None, :])
                    dk, dv = _tile(kk, vv, dk, dv, q, do, LSEh, DELh, mq, ke - mq, n0, offs_n, offs_m, qk_scale,
                                   MASK_DIAG=True, PREC=PREC)
            for it in tl.range(0, n_it, warp_specialize=WS):
                e = e0 + it // NSM
                q0 = tl.load(k2q_start + e) + (it % NSM) * BM
                qlen = tl.load(k2q_end + e) - q0
                if TMA:
                    q = QD.load([q0, hq * D])
                    do = DOD.load([q0, hq * D])
                else:
                    rows = tl.minimum(q0 + offs_m, q0 + qlen - 1).to(tl.int64)
                    q = tl.load(Qh + rows[:, None] * sqt + offs_d[None, :])
                    do = tl.load(DOh + rows[:, None] * sdot + offs_d[None, :])
                dk, dv = _tile(kk, vv, dk, dv, q, do, LSEh, DELh, q0, qlen, n0, offs_n, offs_m, qk_scale,
                               MASK_DIAG=False, PREC=PREC)
        dk = dk * sm_scale
        tl.store(DK + nb * sdkt + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=nmask[:, None])
        tl.store(DV + nb * sdvt + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=nmask[:, None])


def _desc(x, rows):
    return TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], [rows, x.shape[2]])


COMPILED = {}


def dkdv_var(name, do, q, k, v, lse, delta, sel, sm_scale, BN=64, BM=64, warps=4, stages=2, tma=False, ws=False):
    T, Hq, D = q.shape
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    qd, dod = (_desc(q, BM), _desc(do, BM)) if tma else (None, None)
    COMPILED[name] = _dkdv_var[(NB * (B // BN), k.shape[1])](
        q, k, v, do, dk, dv, lse, delta, qd, dod, lay.block_start, lay.block_end, sel.k2q_ptr, sel.k2q_start,
        sel.k2q_end, sel.k_order, sm_scale * tk.LOG2E, sm_scale, T, NB,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        G=Hq // k.shape[1], BLOCK=B, BN=BN, BM=BM, D=D, PREC=tk._prec(q.dtype), HEAD_OUTER=True, TMA=tma, WS=ws,
        num_warps=warps, num_stages=stages)
    return dk, dv


VARIANTS = {
    "ptr_s2": dict(),
    "tma_s2": dict(tma=True),
    "tma_s3": dict(tma=True, stages=3),
    "tma_ws_s2": dict(tma=True, ws=True),
    "tma_ws_s3": dict(tma=True, ws=True, stages=3),
    "bm128_w8_s2": dict(BM=128, warps=8),
    "bm128_w8_tma_s2": dict(BM=128, warps=8, tma=True),
    "bm128_w8_tma_s3": dict(BM=128, warps=8, tma=True, stages=3),
    "bm128_w8_tma_ws_s2": dict(BM=128, warps=8, tma=True, ws=True),
}


def cases(small):
    if small:
        yield "small_dense", [0, 300, 512], 4, 1.0, 2
        yield "small_k0.5", [0, 200, 700], 4, 0.5, 2
        return
    yield "8k_dense", [0, 8192], 16, 1.0, 1
    yield "32k_dense", [0, 32768], 16, 1.0, 1
    yield "32k_k0.5", [0, 32768], 16, 0.5, 1
    yield "32k_k0.1", [0, 32768], 16, 0.1, 1
    yield "32k_gqa4_dense", [0, 32768], 16, 1.0, 4
    yield "128k_k0.25", [0, 131072], 16, 0.25, 1
    g = torch.Generator().manual_seed(0)
    lens = (torch.distributions.Pareto(torch.tensor(512.0), torch.tensor(1.2)).sample((200,)).int() + 1)
    cu = [0]
    for n in lens.tolist():
        if cu[-1] + min(n, 32768) > 65536:
            break
        cu.append(cu[-1] + min(n, 32768))
    cu[-1] = 65536
    yield "packed64k_dense", cu, 16, 1.0, 1
    yield "packed64k_k0.1", cu, 16, 0.1, 1


def main():
    out = sys.argv[1]
    check_only = "--check-only" in sys.argv
    dev = "cpu" if check_only else "cuda"
    dt = torch.float32 if check_only else torch.bfloat16
    D, B = (32, 128) if check_only else (128, 128)
    rows, failures, regs = [], [], {}
    for name, cu_list, H, kf, G in cases(check_only):
        T = cu_list[-1]
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(T, H, D, device=dev, dtype=dt, generator=gen)
        k, v = [torch.randn(T, H // G, D, device=dev, dtype=dt, generator=gen) for _ in range(2)]
        cu = torch.tensor(cu_list, dtype=torch.int32)
        sel = select_blocks(q, k, cu, kept_fraction=kf, block_size=B)
        scale = D ** -0.5
        o, lse = tk.sparse_attn_fwd(q, k, v, sel, scale)
        do = torch.randn_like(o)
        _, delta = tk.sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, scale)
        dk_ref, dv_ref = tk.sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, scale)
        runs = {"pkg": lambda: tk.sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, scale)}
        for vname, kw in VARIANTS.items():
            if check_only:
                kw = {**kw, "warps": 4}
            try:
                dk, dv = dkdv_var(vname, do, q, k, v, lse, delta, sel, scale, **kw)
                err = max((dk.float() - dk_ref.float()).abs().max().item(),
                          (dv.float() - dv_ref.float()).abs().max().item())
                print(f"{name} {vname}: max diff vs package {err:.3e}", flush=True)
                if not err <= (1e-4 if check_only else 2e-2):
                    failures.append((name, vname, err))
                runs[vname] = (lambda vname=vname, kw=kw: dkdv_var(vname, do, q, k, v, lse, delta, sel, scale, **kw))
                ck = COMPILED.get(vname)
                if ck is not None and hasattr(ck, "n_regs"):
                    regs[vname] = (ck.n_regs, ck.n_spills)
            except Exception as e:  # a variant that does not compile on this Triton is reported, not fatal
                print(f"{name} {vname}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                failures.append((name, vname, repr(e)[:200]))
        if check_only:
            continue
        times = {r: [] for r in runs}
        for _ in range(3):
            for r, fn in runs.items():
                times[r].append(triton.testing.do_bench(fn, warmup=10, rep=80))
        med = {r: statistics.median(t) for r, t in times.items()}
        for r, t in med.items():
            row = dict(case=name, T=T, kept_fraction=kf, G=G, kernel=r, ms=round(t, 4),
                       speedup_vs_package=round(med["pkg"] / t, 4),
                       regs=regs.get(r, ("", ""))[0], spills=regs.get(r, ("", ""))[1])
            rows.append(row)
            print(row, flush=True)
        del q, k, v, o, lse, do, delta, sel, dk_ref, dv_ref
        torch.cuda.empty_cache()
    if rows:
        with open(f"{out}/dkdv_lab13_h200.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    with open(f"{out}/dkdv_lab13_failures.json", "w") as f:
        json.dump(failures, f, indent=1)
    print("failures:", failures)


if __name__ == "__main__":
    main()
