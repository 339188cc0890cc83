"""Lab 17 (scratch): host cost of the TMA launches at the grid's host-bound points. Our fwd+bwd with TMA at
every size (TMA_MIN_PAIRS = 0), with pointer tiles everywhere (CONFIG_OVERRIDES TMA=False) and with the
package's rule (TMA from TMA_MIN_PAIRS kept token pairs), against Flex in the same run: host time per call on the calling thread and through autograd's device thread (300 calls
enqueued without a sync, median of 5 rounds), `do_bench` and `do_bench_cudagraph` (GPU time) fwd+bwd
(H200, H=16, D=128, bf16, block 128, one sequence).

Usage: PYTHONPATH=.:lab:benchmarks python3 lab/host_tma_lab17.py OUT
"""
import csv
import statistics
import sys
import time

import torch
import triton
from torch.nn.attention.flex_attention import flex_attention

from attention import flex_block_mask_single
from kernels.sparse_attention import select_blocks, sparse_attention
from kernels.sparse_attention import triton_kernels as tk

PTR = {k: {"TMA": False} for k in ("fwd", "dq", "dkdv")}
RULE = tk.TMA_MIN_PAIRS


def host_us(fn, n=300, rounds=5):
    ts = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(ts), 1)


def measure(fb):
    r = dict(host_autograd_us=host_us(fb))
    torch.autograd.set_multithreading_enabled(False)
    try:
        r["host_1thread_us"] = host_us(fb)
    finally:
        torch.autograd.set_multithreading_enabled(True)
    r["do_bench_ms"] = round(statistics.median(triton.testing.do_bench(fb, warmup=10, rep=60) for _ in range(3)), 4)
    r["graph_ms"] = round(triton.testing.do_bench_cudagraph(fb, return_mode="median"), 4)
    return r


def main():
    out = sys.argv[1]
    T, H, D, B = 8192, 16, 128, 128
    flex = torch.compile(flex_attention, dynamic=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = [torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3)]
    do = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qb, kb, vb = [x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v)]
    dob = do.transpose(0, 1).unsqueeze(0).contiguous()
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    rows = []
    for kf in (0.05, 0.1, 0.25, 0.5):
        sel = select_blocks(q.detach(), k.detach(), cu, kept_fraction=kf, block_size=B)
        bm = flex_block_mask_single(sel, H, T, B)
        ours = lambda: torch.autograd.grad(sparse_attention(q, k, v, cu, selection=sel, backend="triton"),  # noqa
                                           (q, k, v), do)
        theirs = lambda: torch.autograd.grad(flex(qb, kb, vb, block_mask=bm), (qb, kb, vb), dob)  # noqa: E731
        pairs = int(sel.q2k_cnt.sum()) * B * B
        for rnd in range(2):
            for impl in ("tma", "ptr", "rule", "flex"):
                tk.CONFIG_OVERRIDES[(B, D)] = PTR if impl == "ptr" else {}
                tk.TMA_MIN_PAIRS = 0 if impl == "tma" else RULE
                r = dict(kept_fraction=kf, kept_pairs=pairs, round=rnd, impl=impl,
                         **measure(theirs if impl == "flex" else ours))
                rows.append(r)
                print(r, flush=True)
        tk.CONFIG_OVERRIDES.clear()
        tk.TMA_MIN_PAIRS = RULE
    with open(f"{out}/host_tma_lab17_h200.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
