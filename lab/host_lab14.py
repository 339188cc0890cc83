"""Lab 14 (scratch): where the host time of fwd+bwd goes at the grid's host-bound 8K points (H=16, D=128, bf16,
block 128, one sequence, kept 0.05 and 0.1), ours against FlexAttention in the same run.

Host time per call: 300 calls enqueued back to back without a sync (the GPU work is shorter than the host's,
so the enqueue rate is the host cost), median of 5 rounds; also triton.testing.do_bench as the grid times it.
Rows: our launches called directly; the public call's forward under no_grad; fwd+bwd through autograd with
its device thread (the default) and with torch.autograd.set_multithreading_enabled(False); the same for Flex;
an empty autograd Function on CUDA tensors; and the pieces of our launch code (an allocation, a tensor
descriptor, Triton's JIT dispatch against calling the compiled kernel's runner directly).

Usage: PYTHONPATH=. python3 lab/host_lab14.py OUT
"""
import json
import statistics
import sys
import time

import torch
import triton
from torch.nn.attention.flex_attention import flex_attention

from kernels.sparse_attention import select_blocks, sparse_attention
from kernels.sparse_attention import triton_kernels as tk

sys.path.insert(0, "benchmarks")
from attention import flex_block_mask_single  # noqa: E402


def host_us(fn, n=300, rounds=5):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) / n * 1e6)
    return round(statistics.median(out), 1)


class Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, do):
        return do, None, None


def main():
    out = sys.argv[1]
    H, D, B, L = 16, 128, 128, 8192
    res = {"torch": torch.__version__, "triton": triton.__version__}
    flex = torch.compile(flex_attention, dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = [torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3)]
    do = torch.randn_like(q)
    qb, kb, vb = [x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v)]
    dob = do.transpose(0, 1).unsqueeze(0).contiguous()
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    scale = D ** -0.5
    for kf in (0.05, 0.1):
        sel = select_blocks(q, k, cu, kept_fraction=kf, block_size=B)
        bm = flex_block_mask_single(sel, H, L, B)
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        o, lse = tk.sparse_attn_fwd(qd, kd, vd, sel, scale)
        fwd = lambda: sparse_attention(q, k, v, cu, selection=sel, backend="triton")  # noqa: E731
        fwdbwd = lambda: torch.autograd.grad(fwd(), (q, k, v), do)  # noqa: E731
        ffwd = lambda: flex(qb, kb, vb, block_mask=bm)  # noqa: E731
        ffwdbwd = lambda: torch.autograd.grad(ffwd(), (qb, kb, vb), dob)  # noqa: E731
        qe = q.detach().clone().requires_grad_()
        empty = lambda: torch.autograd.grad(Empty.apply(qe, k, v), (qe,), do)  # noqa: E731
        # the forward's launch arguments, as sparse_attn_fwd passes them, for the direct-runner row
        lay = sel.layout
        cfg = tk.get_config("fwd", B, D, row_blocks=sel.row_blocks)
        kdesc, vdesc = tk._descriptors(cfg, cfg["BN"], kd, vd)
        grid = tk._grid(cfg, H, lay.num_blocks * (B // cfg["BM"]))
        args = (qd, kd, vd, o, lse, kdesc, vdesc, lay.block_start, lay.block_end, sel.q2k_start, sel.q2k_cnt,
                sel.q_order, scale * tk.LOG2E, L, lay.num_blocks, sel.q2k_idx.shape[-1],
                qd.stride(0), qd.stride(1), kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1), o.stride(0),
                o.stride(1))
        consts = dict(G=1, BLOCK=B, BM=cfg["BM"], BN=cfg["BN"], D=D, PREC="tf32", HEAD_OUTER=cfg["HEAD_OUTER"],
                      TMA=kdesc is not None, WS=kdesc is not None and cfg.get("WS", False))
        launch = dict(num_warps=cfg["num_warps"], num_stages=tk._stages(cfg, kdesc is not None))
        compiled = tk._fwd_kernel[grid](*args, **consts, **launch)
        runner = compiled[grid]
        params = list(tk._fwd_kernel.arg_names)
        full = [dict(zip(params[:len(args)], args), **consts)[p] for p in params]
        r = {}
        r["fwd_direct"] = host_us(lambda: tk.sparse_attn_fwd(qd, kd, vd, sel, scale))
        r["bwd_direct"] = host_us(lambda: tk.sparse_attn_bwd(do, qd, kd, vd, o, lse, sel, scale))
        r["fwd_jit_launch_only"] = host_us(lambda: tk._fwd_kernel[grid](*args, **consts, **launch))
        try:
            r["fwd_runner_launch_only"] = host_us(lambda: runner(*full))
        except Exception as e:  # the runner's argument convention differs between Triton versions
            r["fwd_runner_launch_only"] = f"failed: {e!r:.200}"
        r["empty_alloc"] = host_us(lambda: torch.empty(L, H, D, device="cuda", dtype=torch.bfloat16))
        r["tensor_descriptor"] = host_us(lambda: tk._descriptors(cfg, cfg["BN"], kd, vd))
        with torch.no_grad():
            r["public_fwd_nograd"] = host_us(fwd)
        r["public_fwd_grad"] = host_us(fwd)
        r["ours_fwdbwd_autograd"] = host_us(fwdbwd)
        r["flex_fwd"] = host_us(ffwd)
        r["flex_fwdbwd_autograd"] = host_us(ffwdbwd)
        r["empty_fn_autograd"] = host_us(empty)
        torch.autograd.set_multithreading_enabled(False)
        try:
            r["ours_fwdbwd_autograd_1thread"] = host_us(fwdbwd)
            r["flex_fwdbwd_autograd_1thread"] = host_us(ffwdbwd)
            r["empty_fn_autograd_1thread"] = host_us(empty)
        finally:
            torch.autograd.set_multithreading_enabled(True)
        r["do_bench_ours_fwdbwd_ms"] = round(triton.testing.do_bench(fwdbwd, warmup=10, rep=100), 4)
        r["do_bench_flex_fwdbwd_ms"] = round(triton.testing.do_bench(ffwdbwd, warmup=10, rep=100), 4)
        res[f"kept_{kf}"] = r
        print(kf, json.dumps(r, indent=1), flush=True)
    with open(f"{out}/host_lab14_h200.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
