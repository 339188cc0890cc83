"""Lab 9b (scratch): cProfile of the fwd+bwd host path at 8K / kept 0.05. Usage: python3 lab/cprof_lab9b.py OUT"""
import cProfile
import pstats
import sys
import time

import torch

from kernels.sparse_attention import select_blocks, sparse_attention
from kernels.sparse_attention import triton_kernels as tk

out = sys.argv[1]
H, D, B, L = 16, 128, 128, 8192
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = [torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3)]
cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
do = torch.randn_like(q)
sel = select_blocks(q, k, cu, kept_fraction=0.05, block_size=B)
fb = lambda: torch.autograd.grad(sparse_attention(q, k, v, cu, selection=sel, backend="triton"), (q, k, v), do)  # noqa


class Nop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.view_as(q)

    @staticmethod
    def backward(ctx, do):
        return do, None, None


nop = lambda: torch.autograd.grad(Nop.apply(q, k, v), (q,), do)  # noqa: E731
with torch.no_grad():
    o, lse = tk.sparse_attn_fwd(q, k, v, sel, D ** -0.5)
raw_bwd = lambda: tk.sparse_attn_bwd(do, q, k, v, o, lse, sel, D ** -0.5)  # noqa: E731


def per_call(fn, n=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


for name, fn in (("fwdbwd", fb), ("nop_grad", nop), ("raw_bwd", raw_bwd)):
    print(name, "host us/call", round(per_call(fn), 1), flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    with open(f"{out}/cprof_{name}.txt", "w") as f:
        pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(35)
