"""Lab 20 (scratch): what the issue's no-atomics rule costs. The package backward (dQ kernel + dK/dV kernel,
P recomputed in both: 7 matmuls) against dK/dV that also adds each key tile's dQ to an fp32 buffer with
atomics (`lab/tk_atomic.py`: 5 matmuls, not deterministic): per element (8 warps / 2 stages; round a also
timed 4 warps / 2 stages and 8 warps / 1 stage, slower) or as one TMA bulk reduction per tile (4 and 8 warps); backward alone, `do_bench`, three
interleaved rounds, median, and CUDA-graph GPU time; plus the forward and cuDNN's dense fwd+bwd for the
dense rate (H200, H=16, D=128, bf16, block 128). Checks dK/dV bitwise against the package, dQ's difference,
and whether two atomic runs give the same dQ.

Usage: PYTHONPATH=.:lab:benchmarks python3 lab/atomic_dq_lab20.py OUT
"""
import csv
import statistics
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.tools.tensor_descriptor import TensorDescriptor

import tk_atomic as ta
from attention import cu_from_lens, long_tail_lengths, make_qkv
from kernels.sparse_attention import select_blocks
from kernels.sparse_attention import triton_kernels as tk

VARIANTS = {"atomic_w8s2": (8, 2, False), "tma_reduce_w4s2": (4, 2, True), "tma_reduce_w8s2": (8, 2, True)}


def bwd_atomic(do, q, k, v, o, lse, sel, sm_scale, warps, stages, dqtma):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    lay = sel.layout
    B, NB = lay.block_size, lay.num_blocks
    delta = tk.sparse_attn_bwd_delta(o, do)
    dqa = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    cfg = tk.get_config("dkdv", B, D, row_blocks=sel.row_blocks)
    qd, dod = tk._descriptors(cfg, cfg["BM"], tk.kept_pairs(q, k, sel), q, do)
    dqd = TensorDescriptor(dqa, [T, Hq * D], [Hq * D, 1], [cfg["BM"], D]) if dqtma else None
    ta._bwd_dkdv_kernel[tk._grid(cfg, Hkv, NB * (B // cfg["BN"]))](
        q, k, v, do, dk, dv, dqa, lse, delta, qd, dod, dqd, lay.block_start, lay.block_end, sel.k2q_ptr, sel.k2q_start,
        sel.k2q_end, sel.k_order, sm_scale * tk.LOG2E, sm_scale, T, NB,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), dqa.stride(0), dqa.stride(1),
        G=Hq // Hkv, BLOCK=B, BN=cfg["BN"], BM=cfg["BM"], D=D, PREC=tk._prec(q.dtype), HEAD_OUTER=cfg["HEAD_OUTER"],
        TMA=qd is not None, DQTMA=dqtma, num_warps=warps, num_stages=stages)
    return dqa.to(q.dtype), dk, dv


def main():
    out = sys.argv[1]
    H, D, B = 16, 128, 128
    scale = D ** -0.5
    points = [("8k", [8192], 1.0), ("32k", [32768], 1.0), ("32k", [32768], 0.1), ("128k", [131072], 0.1),
              ("packed64k", long_tail_lengths(65536), 1.0), ("packed64k", long_tail_lengths(65536), 0.1)]
    f = open(f"{out}/atomic_dq_lab20_h200.csv", "w", newline="")
    w = None
    for name, lens, kf in points:
        T = sum(lens)
        q, k, v = [x.detach() for x in make_qkv(T, H, H, D, torch.bfloat16)]
        do = torch.randn_like(q)
        sel = select_blocks(q, k, cu_from_lens(lens).cpu(), kept_fraction=kf, block_size=B)
        o, lse = tk.sparse_attn_fwd(q, k, v, sel, scale)
        fns = {"package": lambda: tk.sparse_attn_bwd(do, q, k, v, o, lse, sel, scale)}
        for vn, (wp, st, dt) in VARIANTS.items():
            fns[vn] = (lambda wp=wp, st=st, dt=dt: bwd_atomic(do, q, k, v, o, lse, sel, scale, wp, st, dt))
        ref = fns["package"]()
        checks = {}
        for vn in VARIANTS:
            a, b = fns[vn](), fns[vn]()
            checks[vn] = dict(dkdv_bitwise=bool(torch.equal(a[1], ref[1]) and torch.equal(a[2], ref[2])),
                              dq_maxdiff=float((a[0].float() - ref[0].float()).abs().max()),
                              dq_rerun_equal=bool(torch.equal(a[0], b[0])))
        times = {vn: [] for vn in fns}
        for _ in range(3):
            for vn, fn in fns.items():
                times[vn].append(triton.testing.do_bench(fn, warmup=10, rep=60))
        fwd_ms = triton.testing.do_bench(lambda: tk.sparse_attn_fwd(q, k, v, sel, scale), warmup=10, rep=60)
        pairs = sel.kept_block_pairs_tokens()
        cudnn_fb = ""
        if len(lens) == 1 and kf == 1.0:
            qb, kb, vb = [x.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v)]
            dob = do.transpose(0, 1).unsqueeze(0).contiguous()

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ob = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
                return torch.autograd.grad(ob, (qb, kb, vb), dob)
            cudnn_fb = round(triton.testing.do_bench(cudnn, warmup=10, rep=60), 4)
        for vn, fn in fns.items():
            bwd = statistics.median(times[vn])
            r = dict(case=name, T=T, kept_fraction=kf, impl=vn, bwd_rounds=" ".join(f"{t:.4f}" for t in times[vn]),
                     bwd_ms=round(bwd, 4), bwd_graph_ms=round(triton.testing.do_bench_cudagraph(fn), 4),
                     fwd_ms=round(fwd_ms, 4), fwdbwd_tflops=round(3.5 * 4 * D * pairs / (fwd_ms + bwd) / 1e9, 1),
                     cudnn_fwdbwd_ms=cudnn_fb, **checks.get(vn, {}))
            print(r, flush=True)
            if w is None:
                w = csv.DictWriter(f, fieldnames=list(r) + ["dkdv_bitwise", "dq_maxdiff", "dq_rerun_equal"])
                w.writeheader()
            w.writerow(r)
            f.flush()
        del q, k, v, do, o, lse, sel, ref, fns
        torch.cuda.empty_cache()
    f.close()


if __name__ == "__main__":
    main()
