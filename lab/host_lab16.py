"""Lab 16b (scratch): where our fwd+bwd's host time goes at 8K / kept 0.05 (the grid's 8K / 0.95 point), on
the calling thread (`torch.autograd.set_multithreading_enabled(False)`): host time per call (300 calls
enqueued without a sync, median of 5 rounds) and a cProfile of 300 calls, with Triton's launch internals
(H200, H=16, D=128, bf16, block 128).

Usage: PYTHONPATH=.:lab python3 lab/host_lab16.py OUT
"""
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

from kernels.sparse_attention import select_blocks, sparse_attention


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


def main():
    out = sys.argv[1]
    T, H, D, B = 8192, 16, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = [torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3)]
    do = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    res = {}
    for kf in (0.05, 0.1):
        sel = select_blocks(q.detach(), k.detach(), cu, kept_fraction=kf, block_size=B)
        fwd = lambda: sparse_attention(q, k, v, cu, selection=sel, backend="triton")  # noqa: E731
        fb = lambda: torch.autograd.grad(fwd(), (q, k, v), do)  # noqa: E731
        with torch.no_grad():
            r = dict(fwd_nograd=host_us(fwd))
        r["fwdbwd_autograd"] = host_us(fb)
        torch.autograd.set_multithreading_enabled(False)
        r["fwdbwd_1thread"] = host_us(fb)
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(300):
            fb()
        prof.disable()
        torch.cuda.synchronize()
        torch.autograd.set_multithreading_enabled(True)
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(45)
            with open(f"{out}/host_lab16_kf{kf}_{key}.txt", "w") as f:
                f.write(s.getvalue())
        res[f"kept_{kf}"] = r
        print(kf, r, flush=True)
    with open(f"{out}/host_lab16_h200.json", "w") as f:
        json.dump(dict(torch=torch.__version__, triton=__import__("triton").__version__, **res), f, indent=1)


if __name__ == "__main__":
    main()
