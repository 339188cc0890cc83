"""Scratch lab (not for landing): a FlexAttention-style dK/dV loop (loop-carried row vector, pointer jumps,
unmasked Q/dO/lse/delta: single sequences only) timed alone against the package kernel."""
import itertools, math, os, sys
import torch, triton, triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.sparse_attention import select_blocks
from kernels.sparse_attention import triton_kernels as tk
from kernels.sparse_attention.triton_kernels import _program_tile, _dkdv_tile


@triton.jit
def _flex_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, blk_start, blk_end, k2q_ptr, k2q_start, k2q_end, k_order,
                 qk_scale, sm_scale, T, NB,
                 sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sdkt, sdkh, sdvt, sdvh,
                 G: tl.constexpr, BLOCK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                 D: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr, COND_JUMP: tl.constexpr):
    """Flex-style loop, valid only when every non-diagonal query block is full (single sequences, T % BLOCK == 0)."""
    hk, c, ks, ke, n0 = _program_tile(k_order, blk_start, blk_end, BLOCK, BN, True)
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
            first = tl.load(k2q_start + e0, mask=e0 < e_end, other=0)
            rows = first + offs_m
            e = e0
            for it in tl.range(0, n_it, num_stages=STAGES):
                qT = tl.load(Qh + rows[None, :].to(tl.int64) * sqt + offs_d[:, None])
                lse = tl.load(LSEh + rows)
                sT = tl.dot(kk, qT, input_precision=PREC) * qk_scale
                pT = tl.math.exp2(sT - lse[None, :])
                do = tl.load(DOh + rows[:, None].to(tl.int64) * sdot + offs_d[None, :])
                dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
                delta = tl.load(DELh + rows)
                dpT = tl.dot(vv, tl.trans(do), input_precision=PREC)
                dsT = pT * (dpT - delta[None, :])
                dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PREC)
                if COND_JUMP:
                    jump = (it + 1) % NSM == 0
                    nxt = tl.load(k2q_start + e + 1, mask=jump & (it + 1 < n_it), other=0)
                    step = tl.where(jump, nxt - (tl.load(k2q_start + e) + (NSM - 1) * BM), BM)
                    e = e + jump.to(tl.int32)
                else:
                    nxt_it = it + 1
                    en = e0 + nxt_it // NSM
                    step = tl.load(k2q_start + en, mask=nxt_it < n_it, other=0) + (nxt_it % NSM) * BM - rows.min(0)
                rows += step
        dk = dk * sm_scale
        tl.store(DK + nb * sdkt + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=nmask[:, None])
        tl.store(DV + nb * sdvt + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=nmask[:, None])


def flex_like(do, q, k, v, lse, delta, sel, sm_scale, BN, BM, w, s, cj):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    BN, BM = min(BN, B), min(BM, B)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    ck = _flex_kernel[(NB * (B // BN), Hkv)](
        q, k, v, do, dk, dv, lse, delta, lay.block_start, lay.block_end, sel.k2q_ptr, sel.k2q_start, sel.k2q_end,
        sel.k_order, sm_scale * tk.LOG2E, sm_scale, T, NB,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        G=Hq // Hkv, BLOCK=B, BN=BN, BM=BM, D=D, PREC=tk._prec(q.dtype), STAGES=s, COND_JUMP=cj,
        num_warps=w, num_stages=s)
    return dk, dv, ck


def pkg(cfg):
    def f(do, q, k, v, lse, delta, sel, sc):
        B, D = sel.layout.block_size, q.shape[2]
        tk.CONFIG_OVERRIDES[(B, D)] = {"dkdv": cfg}
        try:
            dk, dv = tk.sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, sc)
        finally:
            tk.CONFIG_OVERRIDES.clear()
        return dk, dv, tk.LAST_COMPILED["dkdv"]
    return f


def cfg(BM, BN, w, s):
    return dict(BM=BM, BN=BN, num_warps=w, num_stages=s, HEAD_OUTER=True)


VARIANTS = {
    "flex_s1": lambda *a: flex_like(*a, 128, 64, 8, 1, False),
    "flex_s2": lambda *a: flex_like(*a, 128, 64, 8, 2, False),
    "flex_s3": lambda *a: flex_like(*a, 128, 64, 8, 3, False),
    "flexcj_s1": lambda *a: flex_like(*a, 128, 64, 8, 1, True),
    "flexcj_s2": lambda *a: flex_like(*a, 128, 64, 8, 2, True),
    "flexcj_s3": lambda *a: flex_like(*a, 128, 64, 8, 3, True),
    "flex_bm32_s2": lambda *a: flex_like(*a, 128, 32, 8, 2, False),
    "flex_bm32_s3": lambda *a: flex_like(*a, 128, 32, 8, 3, False),
    "flex_bm32_s4": lambda *a: flex_like(*a, 128, 32, 8, 4, False),
    "flexcj_bm32_s3": lambda *a: flex_like(*a, 128, 32, 8, 3, True),
    "flex_bm32_w4_s3": lambda *a: flex_like(*a, 128, 32, 4, 3, False),
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
        _, delta = tk.sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, sc)
        args = (do, q, k, v, lse, delta, sel, sc)
        rk, rv = tk.sparse_attn_bwd_dkdv(*args)
        ref_ms = bench(lambda: tk.sparse_attn_bwd_dkdv(*args)) if bench else float("nan")
        print(f"{name} default {tk.get_config('dkdv', B, D, sel.row_blocks)} {ref_ms:.3f} ms", flush=True)
        for vn, fn in VARIANTS.items():
            if fn is None:
                continue
            try:
                dk, dv, ck = fn(*args)
                err = max((dk.float() - rk.float()).abs().max().item(), (dv.float() - rv.float()).abs().max().item())
                ms = bench(lambda: fn(*args)) if bench else float("nan")
                info = f"regs={getattr(ck, 'n_regs', '?')} spills={getattr(ck, 'n_spills', '?')}"
            except Exception as ex:  # noqa: BLE001
                err, ms, info = float("nan"), float("nan"), repr(ex)[:300]
            rows.append(dict(shape=name, variant=vn, ms=ms, ref_ms=ref_ms, ratio=ref_ms / ms, err=err))
            print(f"{name} {vn} {ms:.3f} ms ratio {ref_ms / ms:.3f} err {err:.2e} {info}", flush=True)
        del q, k, v, o, lse, do, delta, sel, args
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "cpu":
        run([("single", [320], 2, 2, 1.0), ("single_kf", [448], 2, 2, 0.5), ("gqa", [384], 4, 2, 0.6)], "cpu", None)
    else:
        import pandas as pd
        from triton.testing import do_bench
        shapes = [("128k_kf0.25", [131072], 16, 16, 0.25), ("32k_dense", [32768], 16, 16, 1.0),
                  ("32k_kf0.1", [32768], 16, 16, 0.1), ("8k_dense", [8192], 16, 16, 1.0),
                  ("8k_kf0.25", [8192], 16, 16, 0.25), ("gqa4_32k_kf0.25", [32768], 16, 4, 0.25)]
        rows = run(shapes, "cuda", lambda f: do_bench(f, warmup=25, rep=150))
        df = pd.DataFrame(rows)
        df.to_csv(os.path.join(sys.argv[2], "lab3.csv"), index=False)
        print(df.pivot(index="variant", columns="shape", values="ratio").round(3).to_string())
