"""Lab 9c (scratch): host time of fwd+bwd at 8K / kept 0.05 by where the backward runs, and the selection at
32K / kept 0.1 (cu_seqlens on host / GPU). Usage: python3 lab/host_lab9c.py OUT"""
import json
import sys
import time

import torch
import triton.testing

from kernels.sparse_attention import select_blocks, sparse_attention
from kernels.sparse_attention import triton_kernels as tk

out = sys.argv[1]
H, D, B = 16, 128, 128
rows = []


def per_call(fn, n=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return round((t1 - t0) / n * 1e6, 1)


def rec(name, fn):
    r = dict(name=name, host_us=per_call(fn), bench_ms=round(triton.testing.do_bench(fn, warmup=10, rep=60), 4))
    rows.append(r)
    print(json.dumps(r), flush=True)


class BwdOnly(torch.autograd.Function):
    """identity forward, our backward kernels in backward: the engine thread's cost on our launches"""
    @staticmethod
    def forward(ctx, q, k, v, o, lse, sel):
        ctx.sel, ctx.t = sel, (q, k, v, o, lse)
        return q.view_as(q)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.t
        return (*tk.sparse_attn_bwd(do, q, k, v, o, lse, ctx.sel, D ** -0.5), None, None, None)


class Nop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.view_as(q)

    @staticmethod
    def backward(ctx, do):
        return do, None, None


g = torch.Generator(device="cuda").manual_seed(0)
for L, kf in ((8192, 0.05), (32768, 0.1)):
    q, k, v = [torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3)]
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    do = torch.randn_like(q)
    sel = select_blocks(q, k, cu, kept_fraction=kf, block_size=B)
    with torch.no_grad():
        o, lse = tk.sparse_attn_fwd(q, k, v, sel, D ** -0.5)
    tag = f"{L // 1024}k_kf{kf}"
    fb = lambda: torch.autograd.grad(sparse_attention(q, k, v, cu, selection=sel, backend="triton"), (q, k, v), do)  # noqa
    rec(f"{tag} fwdbwd autograd.grad", fb)
    if L == 8192:
        def fb_single_thread():
            with torch.autograd.set_multithreading_enabled(False):
                return fb()
        rec(f"{tag} fwdbwd autograd.grad, multithreading off", fb_single_thread)
        rec(f"{tag} raw fwd", lambda: tk.sparse_attn_fwd(q, k, v, sel, D ** -0.5))
        rec(f"{tag} raw bwd", lambda: tk.sparse_attn_bwd(do, q, k, v, o, lse, sel, D ** -0.5))
        rec(f"{tag} raw fwd+bwd", lambda: (tk.sparse_attn_fwd(q, k, v, sel, D ** -0.5),
                                          tk.sparse_attn_bwd(do, q, k, v, o, lse, sel, D ** -0.5)))
        rec(f"{tag} nop autograd.grad", lambda: torch.autograd.grad(Nop.apply(q, k, v), (q,), do))
        rec(f"{tag} bwd-only autograd.grad", lambda: torch.autograd.grad(BwdOnly.apply(q, k, v, o, lse, sel),
                                                                        (q, k, v), do))
    else:
        for where, c in (("host", cu.cpu()), ("gpu", cu)):
            rec(f"{tag} select cu on {where}", lambda: select_blocks(q, k, c, kept_fraction=kf, block_size=B))
        rec(f"{tag} select p=0.9 cu on host", lambda: select_blocks(q, k, cu.cpu(), p=0.9, block_size=B))
    del q, k, v, do, sel, o, lse
with open(f"{out}/lab9c.json", "w") as f:
    json.dump(rows, f, indent=1)
