"""Lab 9 (scratch): where the host and GPU time go in fwd+bwd at 8K/0.9-0.95 and 32K/0.9, and in the
selection at 32K/0.9 (cu_seqlens on the GPU and on the host). Usage: python3 lab/prof_lab9.py OUTDIR"""
import json
import sys
import time

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from kernels.sparse_attention import select_blocks, sparse_attention
from kernels.sparse_attention import triton_kernels as tk

out = sys.argv[1]
H, D, B = 16, 128, 128
rows = []


def log(**row):
    rows.append(row)
    print(json.dumps(row), flush=True)


def host_ms(fn, n=30):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e3, (t2 - t0) / n * 1e3


def table(name, fn, n=5):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    with open(f"{out}/{name}.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
        f.write("\n\n")
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


g = torch.Generator(device="cuda").manual_seed(0)
for L, kf in ((8192, 0.05), (8192, 0.1), (32768, 0.1)):
    q, k, v = [torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3)]
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    do = torch.randn_like(q)
    sel = select_blocks(q, k, cu, kept_fraction=kf, block_size=B)
    fwd = lambda: sparse_attention(q, k, v, cu, selection=sel, backend="triton")  # noqa: E731
    fb = lambda: torch.autograd.grad(fwd(), (q, k, v), do)  # noqa: E731
    with torch.no_grad():
        o, lse = tk.sparse_attn_fwd(q, k, v, sel, D ** -0.5)
    raw_fwd = lambda: tk.sparse_attn_fwd(q, k, v, sel, D ** -0.5)  # noqa: E731
    raw_bwd = lambda: tk.sparse_attn_bwd(do, q, k, v, o, lse, sel, D ** -0.5)  # noqa: E731
    raw_dq = lambda: tk.sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, D ** -0.5)  # noqa: E731
    _, delta = raw_dq()
    raw_dkdv = lambda: tk.sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, D ** -0.5)  # noqa: E731
    name = f"{L // 1024}k_kf{kf}"
    r = dict(case=name, row_blocks=sel.row_blocks, overlap=tk._overlap_backward(q, k, sel))
    for nm, fn in (("fwdbwd", fb), ("fwd", fwd), ("raw_fwd", raw_fwd), ("raw_bwd", raw_bwd), ("raw_dq", raw_dq),
                   ("raw_dkdv", raw_dkdv)):
        r[nm + "_bench_ms"] = round(triton.testing.do_bench(fn, warmup=10, rep=60), 4)
        r[nm + "_host_ms"], r[nm + "_hostsync_ms"] = [round(x, 4) for x in host_ms(fn)]
    for kind in ("fwd", "dq", "dkdv"):
        c = tk.LAST_COMPILED.get(kind)
        if c is not None:
            r[kind + "_regs_spills"] = (getattr(c, "n_regs", None), getattr(c, "n_spills", None))
    log(**r)
    table(f"fwdbwd_{name}", fb)
    if L == 32768:
        cuh = cu.cpu()
        for nm, c in (("cu_gpu", cu), ("cu_host", cuh)):
            sfn = lambda: select_blocks(q, k, c, kept_fraction=kf, block_size=B)  # noqa: E731
            hs = host_ms(sfn)
            log(case=f"select_{name}_{nm}", bench_ms=round(triton.testing.do_bench(sfn, warmup=10, rep=60), 4),
                host_ms=round(hs[0], 4), hostsync_ms=round(hs[1], 4))
            table(f"select_{name}_{nm}", sfn)
    del q, k, v, do, sel, o, lse
with open(f"{out}/lab9.json", "w") as f:
    json.dump(rows, f, indent=1)
