"""Lab 8 (second run: 8b, with the overlap rule of triton_kernels._overlap_backward): dQ on a side stream alongside dK/dV (delta from a pre-pass) vs the committed sequential backward
(lab/tk_old.py = triton_kernels.py of 2b93fba), fwd+bwd through autograd and backward alone, H200.
Also: a host profile of select_blocks at 32K / kept 0.1.  python3 lab/bwd_overlap_lab8.py OUT"""
import csv
import json
import statistics
import sys

import torch
import triton

sys.path.insert(0, ".")
sys.path.insert(0, "lab")
import tk_old  # noqa: E402
from kernels.sparse_attention import select_blocks  # noqa: E402
from kernels.sparse_attention import triton_kernels as tk  # noqa: E402

out = sys.argv[1]
D, B = 128, 128
S = D ** -0.5


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def long_tail(total=65536, seed=0):
    sys.path.insert(0, "benchmarks")
    from attention import long_tail_lengths
    return long_tail_lengths(total, seed)


cases = [("8k_dense", 16, 16, [8192], 1.0), ("8k_kf0.5", 16, 16, [8192], 0.5), ("8k_kf0.1", 16, 16, [8192], 0.1),
         ("32k_dense", 16, 16, [32768], 1.0), ("32k_kf0.1", 16, 16, [32768], 0.1),
         ("32k_kf0.1_gqa4", 16, 4, [32768], 0.1), ("32k_kf0.1_gqa8", 16, 2, [32768], 0.1),
         ("128k_kf0.25", 16, 16, [131072], 0.25),
         ("packed64k_kf0.1", 16, 16, long_tail(), 0.1), ("packed64k_dense", 16, 16, long_tail(), 1.0)]
rows = []
for name, Hq, Hkv, lens, kf in cases:
    T = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    sel = select_blocks(q, k, cu, kept_fraction=kf, block_size=B)
    do = torch.randn_like(q)
    with torch.no_grad():
        o, lse = tk.sparse_attn_fwd(q, k, v, sel, S)

    variants = {
        "fb_old": lambda: torch.autograd.grad(tk_old.SparseAttentionFunction.apply(q, k, v, sel, S), (q, k, v), do),
        "fb_new": lambda: torch.autograd.grad(tk.SparseAttentionFunction.apply(q, k, v, sel, S), (q, k, v), do),
        "bwd_old": lambda: tk_old.sparse_attn_bwd(do, q, k, v, o, lse, sel, S),
        "bwd_new": lambda: tk.sparse_attn_bwd(do, q, k, v, o, lse, sel, S),
    }
    ga = tk_old.sparse_attn_bwd(do, q, k, v, o, lse, sel, S)
    gb = tk.sparse_attn_bwd(do, q, k, v, o, lse, sel, S)
    gc = tk.sparse_attn_bwd(do, q, k, v, o, lse, sel, S)
    torch.cuda.synchronize()
    maxdiff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ga, gb))
    determ = all(torch.equal(a, b) for a, b in zip(gb, gc))
    times = {n: [] for n in variants}
    for _ in range(3):  # interleaved rounds: drift hits every variant alike
        for n, fn in variants.items():
            times[n].append(bench(fn))
    row = dict(case=name, Hq=Hq, Hkv=Hkv, T=T, kept=kf, overlap=tk._overlap_backward(q, k, sel),
               maxdiff_vs_old=maxdiff, deterministic=determ,
               **{n: round(statistics.median(t), 4) for n, t in times.items()})
    row["fb_new_over_old"] = round(row["fb_old"] / row["fb_new"], 3)
    row["bwd_new_over_old"] = round(row["bwd_old"] / row["bwd_new"], 3)
    print(json.dumps(row), flush=True)
    rows.append(row)
    del q, k, v, o, lse, do, sel, ga, gb, gc
    torch.cuda.empty_cache()
with open(f"{out}/bwd_overlap_lab8b_h200.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)

