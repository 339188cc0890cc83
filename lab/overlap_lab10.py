"""Lab 10 (scratch): the widened overlap rule (up to 64 dK/dV programs per SM where queries keep >= 2048 keys)
against the previous rule (32 per SM), backward alone, 32K MHA at kept 1 / 0.5 / 0.25 / 0.1, 8K dense as a
control; 3 interleaved rounds, median. Usage: python3 lab/overlap_lab10.py OUT"""
import csv
import statistics
import sys

import torch
import triton.testing

from kernels.sparse_attention import select_blocks
from kernels.sparse_attention import triton_kernels as tk

out = sys.argv[1]
H, D, B = 16, 128, 128
g = torch.Generator(device="cuda").manual_seed(0)
rows = []
for L, kf in ((32768, 1.0), (32768, 0.5), (32768, 0.25), (32768, 0.1), (8192, 1.0)):
    q, k, v = [torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    cu = torch.tensor([0, L], dtype=torch.int32)
    sel = select_blocks(q, k, cu, kept_fraction=kf, block_size=B)
    o, lse = tk.sparse_attn_fwd(q, k, v, sel, D ** -0.5)
    do = torch.randn_like(o)
    times = {"old": [], "new": []}
    decisions = {}
    for _ in range(3):
        for rule, wide in (("old", 1 << 60), ("new", tk.OVERLAP_WIDE_KEYS_PER_QUERY)):
            saved = tk.OVERLAP_WIDE_KEYS_PER_QUERY
            tk.OVERLAP_WIDE_KEYS_PER_QUERY = wide
            decisions[rule] = tk._overlap_backward(q, k, sel)
            times[rule].append(triton.testing.do_bench(
                lambda: tk.sparse_attn_bwd(do, q, k, v, o, lse, sel, D ** -0.5), warmup=10, rep=100))
            tk.OVERLAP_WIDE_KEYS_PER_QUERY = saved
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    r = dict(T=L, kept_fraction=kf, kept_entries=sel.kept_entries, overlap_old=decisions["old"],
             overlap_new=decisions["new"], bwd_old_ms=round(old, 4), bwd_new_ms=round(new, 4),
             speedup=round(old / new, 4))
    rows.append(r)
    print(r, flush=True)
    del q, k, v, o, lse, do, sel
with open(f"{out}/overlap_lab10_h200.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
