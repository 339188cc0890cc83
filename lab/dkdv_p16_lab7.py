"""Scratch lab (not for landing): dK/dV keeping P in 16 bits between the dV and dS steps (SWAP=1: fp16, 2:
bf16) so that 16 fewer registers per thread are live across the dP matmul, alone and with pipelining, timed
against the package kernel in the same run. `python lab/dkdv_p16_lab7.py cpu|ptx|cuda OUT`."""
import itertools, os, sys
import torch, triton, triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.sparse_attention import select_blocks
from kernels.sparse_attention import triton_kernels as tk
from kernels.sparse_attention.triton_kernels import _program_tile


@triton.jit
def _tile(kk, vv, dk, dv, Qh, DOh, LSEh, DELh, q0, qlen, kv0, offs_n, offs_m, offs_d, sqt, sdot, qk_scale,
          MASK_DIAG: tl.constexpr, PREC: tl.constexpr, SWAP: tl.constexpr):
    qmask = offs_m < qlen
    rows = tl.minimum(q0 + offs_m, q0 + qlen - 1).to(tl.int64)
    qT = tl.load(Qh + rows[None, :] * sqt + offs_d[:, None])
    do = tl.load(DOh + rows[:, None] * sdot + offs_d[None, :])
    lse = tl.load(LSEh + q0 + offs_m, mask=qmask, other=float("inf"))
    delta = tl.load(DELh + q0 + offs_m, mask=qmask, other=0.0)
    sT = tl.dot(kk, qT, input_precision=PREC) * qk_scale
    pT = tl.math.exp2(sT - lse[None, :])
    if MASK_DIAG:
        pT = tl.where((kv0 + offs_n[:, None] <= q0 + offs_m[None, :]) & qmask[None, :], pT, 0.0)
    if SWAP == 0:
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        dpT = tl.dot(vv, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
    else:
        # P kept in 16 bits for dS (fp16: 11-bit significand, P in [0, 1]; bf16: the dV operand itself)
        if SWAP == 1:
            pk = pT.to(tl.float16)
        else:
            pk = pT.to(do.dtype)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        dpT = tl.dot(vv, tl.trans(do), input_precision=PREC)
        dsT = pk.to(tl.float32) * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _kernel(Q, K, V, DO, DK, DV, LSE, DELTA, blk_start, blk_end, k2q_ptr, k2q_start, k2q_end, k_order,
            qk_scale, sm_scale, T, NB,
            sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sdkt, sdkh, sdvt, sdvh,
            G: tl.constexpr, BLOCK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
            D: tl.constexpr, PREC: tl.constexpr, HEAD_OUTER: tl.constexpr, SWAP: tl.constexpr,
            STAGES: tl.constexpr):
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
                    dk, dv = _tile(kk, vv, dk, dv, Qh, DOh, LSEh, DELh, mq, ke - mq, n0, offs_n, offs_m,
                                   offs_d, sqt, sdot, qk_scale, MASK_DIAG=True, PREC=PREC, SWAP=SWAP)
            if STAGES == 1:
                q0 = tl.load(k2q_start + e0, mask=e0 < e_end, other=0)
                qe = tl.load(k2q_end + e0, mask=e0 < e_end, other=0)
                for it in range(0, n_it):
                    nxt = it + 1
                    e = e0 + nxt // NSM
                    q0_next = tl.load(k2q_start + e, mask=nxt < n_it, other=0) + (nxt % NSM) * BM
                    qe_next = tl.load(k2q_end + e, mask=nxt < n_it, other=0)
                    dk, dv = _tile(kk, vv, dk, dv, Qh, DOh, LSEh, DELh, q0, qe - q0, n0, offs_n, offs_m,
                                   offs_d, sqt, sdot, qk_scale, MASK_DIAG=False, PREC=PREC, SWAP=SWAP)
                    q0 = q0_next
                    qe = qe_next
            else:
                for it in tl.range(0, n_it, num_stages=STAGES):
                    e = e0 + it // NSM
                    q0 = tl.load(k2q_start + e) + (it % NSM) * BM
                    qe = tl.load(k2q_end + e)
                    dk, dv = _tile(kk, vv, dk, dv, Qh, DOh, LSEh, DELh, q0, qe - q0, n0, offs_n, offs_m,
                                   offs_d, sqt, sdot, qk_scale, MASK_DIAG=False, PREC=PREC, SWAP=SWAP)
        dk = dk * sm_scale
        tl.store(DK + nb * sdkt + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=nmask[:, None])
        tl.store(DV + nb * sdvt + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=nmask[:, None])


# name: (BN, BM, warps, stages, SWAP)
VARIANTS = {
    "copy_128x64_w8_s1": (128, 64, 8, 1, 0),
    "p16_128x64_w8_s1": (128, 64, 8, 1, 1),
    "pbf_128x64_w8_s1": (128, 64, 8, 1, 2),
    "p16_128x64_w8_s2": (128, 64, 8, 2, 1),
    "p16_128x64_w8_s3": (128, 64, 8, 3, 1),
    "p16_128x32_w8_s2": (128, 32, 8, 2, 1),
    "copy_128x32_w8_s2": (128, 32, 8, 2, 0),
    "p16_64x64_w4_s1": (64, 64, 4, 1, 1),
    "p16_64x64_w4_s2": (64, 64, 4, 2, 1),
}


def dkdv(do, q, k, v, lse, delta, sel, sm_scale, BN, BM, w, s, swap):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    BN, BM = min(BN, B), min(BM, B)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    ck = _kernel[(NB * (B // BN), Hkv)](
        q, k, v, do, dk, dv, lse, delta, lay.block_start, lay.block_end, sel.k2q_ptr, sel.k2q_start, sel.k2q_end,
        sel.k_order, sm_scale * tk.LOG2E, sm_scale, T, NB,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        G=Hq // Hkv, BLOCK=B, BN=BN, BM=BM, D=D, PREC=tk._prec(q.dtype), HEAD_OUTER=True, SWAP=swap, STAGES=s,
        num_warps=w, num_stages=s)
    return dk, dv, ck


def ptx():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from benchmarks.kernel_ptx import signature, divisible_by_16, resources
    for name, (BN, BM, w, s, swap) in VARIANTS.items():
        for G in (1, 4):
            consts = dict(G=G, BLOCK=128, BM=BM, BN=BN, D=128, PREC="tf32", HEAD_OUTER=True, SWAP=swap, STAGES=s)
            sig = signature(_kernel, consts)
            src = ASTSource(fn=_kernel, signature=sig,
                            constexprs={(list(sig).index(k),): v for k, v in consts.items()},
                            attrs=divisible_by_16(sig))
            c = triton.compile(src, target=triton.backends.compiler.GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=w, num_stages=s))
            print(name, f"G={G}", resources(c.asm["cubin"]), flush=True)


def run(shapes, dev, bench):
    rows = []
    for name, lens, Hq, Hkv, kf in shapes:
        T, D, B = sum(lens), (128 if dev == "cuda" else 16), (128 if dev == "cuda" else 32)
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
        args = (do, q, k, v, lse, delta, sel, sc)
        rk, rv = tk.sparse_attn_bwd_dkdv(*args)
        ref_ms = bench(lambda: tk.sparse_attn_bwd_dkdv(*args)) if bench else float("nan")
        dq_ms = bench(lambda: tk.sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, sc)) if bench else float("nan")
        print(f"{name} package dkdv {ref_ms:.3f} ms dq {dq_ms:.3f} ms", flush=True)
        for vn, cfg in VARIANTS.items():
            try:
                dk, dv, ck = dkdv(*args, *cfg)
                err = max((dk.float() - rk.float()).abs().max().item(), (dv.float() - rv.float()).abs().max().item())
                ms = bench(lambda: dkdv(*args, *cfg)) if bench else float("nan")
                info = f"regs={getattr(ck, 'n_regs', '?')} spills={getattr(ck, 'n_spills', '?')}"
            except Exception as ex:  # noqa: BLE001
                err, ms, info = float("nan"), float("nan"), repr(ex)[:300]
            rows.append(dict(shape=name, variant=vn, ms=ms, ref_ms=ref_ms, ratio=ref_ms / ms, err=err, info=info))
            print(f"{name} {vn} {ms:.3f} ms ratio {ref_ms / ms:.3f} err {err:.2e} {info}", flush=True)
        del q, k, v, o, lse, do, delta, sel, args
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "cpu":
        run([("docs", [70, 1, 130, 64, 200], 4, 2, 0.5), ("single", [320], 2, 2, 1.0)], "cpu", None)
    elif sys.argv[1] == "ptx":
        ptx()
    else:
        import pandas as pd
        from triton.testing import do_bench
        shapes = [("128k_kf0.25", [131072], 16, 16, 0.25), ("32k_dense", [32768], 16, 16, 1.0),
                  ("32k_kf0.1", [32768], 16, 16, 0.1), ("8k_dense", [8192], 16, 16, 1.0),
                  ("gqa4_32k_kf0.25", [32768], 16, 4, 0.25)]
        rows = run(shapes, "cuda", lambda f: do_bench(f, warmup=25, rep=150))
        df = pd.DataFrame(rows)
        df.to_csv(os.path.join(sys.argv[2], "lab7.csv"), index=False)
        print(df.pivot(index="variant", columns="shape", values="ratio").round(3).to_string())
