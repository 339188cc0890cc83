"""Lab 18 (scratch): the grid points whose ratio to Flex moved between runs, timed in five interleaved rounds
(ours, Flex; `do_bench` fwd+bwd each, median), plus their CUDA-graph GPU time (H200, H=16, D=128, bf16,
block 128, one sequence, the grid's inputs and selections).

Usage: PYTHONPATH=.:benchmarks python3 lab/rounds_lab18.py OUT
"""
import csv
import statistics
import sys

import torch
import triton
from torch.nn.attention.flex_attention import flex_attention

from attention import cu_from_lens, flex_block_mask_single, make_qkv
from kernels.sparse_attention import select_blocks, sparse_attention
from kernels.sparse_attention import triton_kernels as tk


def main():
    out = sys.argv[1]
    H, D, B = 16, 128, 128
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for T, sp in ((32768, 0.9), (8192, 0.75), (8192, 0.9), (8192, 0.95)):
        q, k, v = make_qkv(T, H, H, D, torch.bfloat16)
        do = torch.randn_like(q)
        cu = cu_from_lens([T])
        qb, kb, vb = [x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v)]
        dob = do.transpose(0, 1).unsqueeze(0).contiguous()
        sel = select_blocks(q, k, cu, kept_fraction=1 - sp, block_size=B)
        bm = flex_block_mask_single(sel, H, T, B)
        fns = {"ours": lambda: torch.autograd.grad(sparse_attention(q, k, v, cu, selection=sel, backend="triton"),
                                                   (q, k, v), do),
               "flex": lambda: torch.autograd.grad(flex(qb, kb, vb, block_mask=bm), (qb, kb, vb), dob)}
        times = {n: [] for n in fns}
        for _ in range(5):
            for n, fn in fns.items():
                times[n].append(triton.testing.do_bench(fn, warmup=10, rep=40))
        graph = {n: triton.testing.do_bench_cudagraph(fn, return_mode="median") for n, fn in fns.items()}
        row = dict(T=T, sparsity=sp, kept_pairs=tk.kept_pairs(q, k, sel),
                   ours_rounds=" ".join(f"{t:.4f}" for t in times["ours"]),
                   flex_rounds=" ".join(f"{t:.4f}" for t in times["flex"]),
                   ours_median=round(statistics.median(times["ours"]), 4),
                   flex_median=round(statistics.median(times["flex"]), 4),
                   ratio_median=round(statistics.median(times["flex"]) / statistics.median(times["ours"]), 3),
                   ours_graph=round(graph["ours"], 4), flex_graph=round(graph["flex"], 4),
                   ratio_graph=round(graph["flex"] / graph["ours"], 3))
        rows.append(row)
        print(row, flush=True)
    with open(f"{out}/rounds_lab18_h200.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
