"""Lab 19 (scratch): TMA descriptors built on the device (tl.make_tensor_descriptor in each program, in
allocator scratch) against host-built ones (TensorDescriptor objects, encoded by Triton's launcher on every
launch), each with the TMA_MIN_PAIRS rule (2^27) and the device ones also at every size, against Flex in the
same run (single sequences): host time per fwd+bwd on the calling thread (calls enqueued without a sync,
median of 3), `do_bench` fwd+bwd through autograd and `do_bench_cudagraph` (GPU time), three interleaved
rounds (H200, H=16, D=128, bf16, block 128). Also checks that device and host descriptors give bitwise equal
outputs and gradients.

Usage: PYTHONPATH=.:benchmarks python3 lab/devdesc_lab19.py OUT
"""
import csv
import statistics
import sys
import time

import torch
import triton
from torch.nn.attention.flex_attention import flex_attention

from attention import cu_from_lens, flex_block_mask_single, long_tail_lengths, make_qkv
from kernels.sparse_attention import select_blocks, sparse_attention
from kernels.sparse_attention import triton_kernels as tk

RULE = tk.TMA_MIN_PAIRS
VARIANTS = {"host": (False, RULE), "dev": (True, RULE), "dev_all": (True, 0)}


def host_us(fn, n, rounds=3):
    ts = []
    torch.autograd.set_multithreading_enabled(False)
    try:
        for _ in range(rounds):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            ts.append((time.perf_counter() - t) / n * 1e6)
            torch.cuda.synchronize()
    finally:
        torch.autograd.set_multithreading_enabled(True)
    return round(statistics.median(ts), 1)


def bitwise(q, k, v, do, cu, sel):
    """Device against host descriptors, TMA at every size (a function: no autograd graph outlives it, which
    would break the CUDA-graph capture that follows)."""
    res = {}
    for dev in (False, True):
        tk.DEVICE_DESCRIPTORS, tk.TMA_MIN_PAIRS = dev, 0
        o = sparse_attention(q, k, v, cu, selection=sel, backend="triton")
        res[dev] = (o.detach(), *torch.autograd.grad(o, (q, k, v), do))
    return all(torch.equal(a, b) for a, b in zip(res[False], res[True]))


def set_variant(name):
    tk.DEVICE_DESCRIPTORS, tk.TMA_MIN_PAIRS = VARIANTS[name]


def main():
    out = sys.argv[1]
    H, D, B = 16, 128, 128
    flex = torch.compile(flex_attention, dynamic=False)
    points = [(8192, kf) for kf in (0.05, 0.1, 0.25, 0.5, 1.0)] + [(32768, 0.1), (32768, 1.0), ("packed", 0.1)]
    rows = []
    f = open(f"{out}/devdesc_lab19_h200.csv", "w", newline="")
    w = None
    for T, kf in points:
        lens = long_tail_lengths(65536) if T == "packed" else [T]
        Ttot = sum(lens)
        q, k, v = make_qkv(Ttot, H, H, D, torch.bfloat16)
        do = torch.randn_like(q)
        cu = cu_from_lens(lens)
        cu_host = cu.cpu()
        sel = select_blocks(q.detach(), k.detach(), cu_host, kept_fraction=kf, block_size=B)
        ours = lambda: torch.autograd.grad(sparse_attention(q, k, v, cu_host, selection=sel, backend="triton"),  # noqa
                                           (q, k, v), do)
        fns = {name: ours for name in VARIANTS}
        if T != "packed":
            qb, kb, vb = [x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v)]
            dob = do.transpose(0, 1).unsqueeze(0).contiguous()
            bm = flex_block_mask_single(sel, H, T, B)
            fns["flex"] = lambda: torch.autograd.grad(flex(qb, kb, vb, block_mask=bm), (qb, kb, vb), dob)  # noqa
        # bitwise: device against host descriptors (TMA at every size, so both build descriptors)
        equal = bitwise(q, k, v, do, cu_host, sel)
        graph = {}
        for name, fn in fns.items():
            if name in VARIANTS:
                set_variant(name)
            graph[name] = triton.testing.do_bench_cudagraph(fn, return_mode="median")
        n = max(10, min(200, int(60 / graph["host"])))
        for rnd in range(3):
            for name, fn in fns.items():
                if name in VARIANTS:
                    set_variant(name)
                r = dict(T=T, kept_fraction=kf, kept_pairs=tk.kept_pairs(q, k, sel), round=rnd, impl=name,
                         bitwise_dev_host=equal, host_1thread_us=host_us(fn, n),
                         do_bench_ms=round(triton.testing.do_bench(fn, warmup=10, rep=60), 4),
                         graph_ms=round(graph[name], 4))
                rows.append(r)
                print(r, flush=True)
                if w is None:
                    w = csv.DictWriter(f, fieldnames=list(r))
                    w.writeheader()
                w.writerow(r)
                f.flush()
        set_variant("host")
    f.close()
    # summary: medians per point and impl
    import pandas as pd
    df = pd.DataFrame(rows)
    print(df.groupby(["T", "kept_fraction", "impl"], sort=False)[["host_1thread_us", "do_bench_ms", "graph_ms"]]
          .median().to_string())


if __name__ == "__main__":
    main()
