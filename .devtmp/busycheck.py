import torch
from calibrate.timing import bench_gpu, bench_gpu_busy
from kernels.sparse_attention import VarlenBatch, select_blocks, sparse_attention
for L, kf in ((32768, 0.25), (2048, 0.25), (1024, 0.05)):
    q = torch.randn(L, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(L, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    docs = VarlenBatch.from_cu_seqlens(torch.tensor([0, L], dtype=torch.int32))
    sel = select_blocks(q, k, docs, kept_fraction=torch.tensor([kf]), block_size=128)
    f = lambda: sparse_attention(q, k, v, docs, selection=sel)
    e, b = bench_gpu(f, 1.0), bench_gpu_busy(f, 1.0)
    print(f"L={L} kf={kf}: events {e.median_ms:.4f} ms, busy {b.median_ms:.4f} ms (p20 {b.p20_ms:.4f} p80 {b.p80_ms:.4f}), ratio {b.median_ms / e.median_ms:.3f}")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
g = lambda: a @ a
e, b = bench_gpu(g, 1.0), bench_gpu_busy(g, 1.0)
print(f"matmul 8192: events {e.median_ms:.4f} busy {b.median_ms:.4f} ratio {b.median_ms / e.median_ms:.3f}")
for L, kf in ((32768, 0.25), (2048, 0.25)):
    q = torch.randn(L, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(L, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(L, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    docs = VarlenBatch.from_cu_seqlens(torch.tensor([0, L], dtype=torch.int32))
    sel = select_blocks(q.detach(), k.detach(), docs, kept_fraction=torch.tensor([kf]), block_size=128)
    out = sparse_attention(q, k, v, docs, selection=sel); go = torch.randn_like(out)
    f = lambda: out.backward(go, retain_graph=True)
    e, b = bench_gpu(f, 1.0, grad_to_none=[q, k, v]), bench_gpu_busy(f, 1.0, grad_to_none=[q, k, v])
    print(f"bwd L={L} kf={kf}: events {e.median_ms:.4f} ms, busy {b.median_ms:.4f} ms, ratio {b.median_ms / e.median_ms:.3f}")
