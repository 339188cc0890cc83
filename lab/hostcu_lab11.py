"""Lab 11 (scratch): the runner's attention call (selection + fwd + bwd, budgets given) with cu_seqlens and
budgets on the GPU (as the runner passed them before 0bf430b) and on the host, one call and 8 back to back
(as 8 layers would run), Qwen2.5-3B heads (16 q, 2 kv), D=128, bf16, block 128, a packed 16K micro-batch.
Usage: python3 lab/hostcu_lab11.py OUT"""
import json
import statistics
import sys

import torch
import triton.testing

from kernels.sparse_attention import sparse_attention

out = sys.argv[1]
g = torch.Generator(device="cuda").manual_seed(0)
lens = [8192, 4096, 2048, 1024, 1024]
T = sum(lens)
q = torch.randn(T, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
k, v = [torch.randn(T, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2)]
do = torch.randn_like(q)
cu_h = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
rows = []
for mode, budget in (("kept_fraction", [0.1, 0.25, 0.5, 1.0, 0.3]), ("p", [0.9, 0.8, 0.95, 1.0, 0.9])):
    b_h = torch.tensor(budget)
    for where, cu, b in (("gpu", cu_h.cuda(), b_h.cuda()), ("host", cu_h, b_h)):
        def layer():
            return torch.autograd.grad(sparse_attention(q, k, v, cu, block_size=128, **{mode: b}), (q, k, v), do)

        def layers8():
            for _ in range(8):
                layer()
        r = dict(mode=mode, where=where)
        for name, fn in (("one_ms", layer), ("eight_ms", layers8)):
            r[name] = round(statistics.median(triton.testing.do_bench(fn, warmup=5, rep=50) for _ in range(3)), 4)
        rows.append(r)
        print(json.dumps(r), flush=True)
with open(f"{out}/hostcu_lab11_h200.json", "w") as f:
    json.dump(rows, f, indent=1)
