"""Shared pieces of the attention benchmark: the grid's shape, timing in turns, inputs, CSV rows,
FLOP counts, and how FlexAttention is compiled."""
from __future__ import annotations

import csv
import json
import math
import statistics
import traceback

import torch

from sparsebalance.kernels.sparse_attention import KernelOptions, sparse_attention


H, D, B = 16, 128, 128  # the grid's heads, head dim and block size (tuning and --config apply to (B, D))
TORCH_SELECTION = KernelOptions(selection="torch")


def log(*a):
    print(*a, flush=True)


def bench(fn, rep=40, warmup=10):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep)


def interleaved_ms(fns: dict, rounds: int) -> dict:
    """Median fwd and fwd+bwd ms (``bench``) of each implementation in ``fns`` (name: (fwd, fwdbwd)) over
    ``rounds`` rounds in which the implementations take turns, so that a slow stretch of a noisy host hits
    them all (single samples of host-bound points move by up to 2x on the H200 machine). An implementation
    that raises gets its exception instead and sits out the remaining rounds."""
    times = {name: ([], []) for name in fns}
    failed = {}
    for _ in range(rounds):
        for name, (fwd, fwdbwd) in fns.items():
            if name in failed:
                continue
            try:
                f_ms = bench(fwd)
                times[name][1].append(bench(fwdbwd))
                times[name][0].append(f_ms)
            except Exception as e:  # noqa: BLE001 (recorded in the implementation's row)
                failed[name] = e
                traceback.print_exc()
    return {name: failed[name] if name in failed else (statistics.median(f), statistics.median(fb))
            for name, (f, fb) in times.items()}


def graph_times(fwd, fwdbwd):
    """fwd and fwd+bwd ms replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``): GPU time without
    the host's launch overhead, which ``bench`` includes wherever the host cannot keep ahead of the GPU."""
    import triton.testing

    return (triton.testing.do_bench_cudagraph(fwd, return_mode="median"),
            triton.testing.do_bench_cudagraph(fwdbwd, return_mode="median"))


def make_qkv(T, Hq, Hkv, D, dtype, seed=0, grad=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, Hq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(T, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(T, Hkv, D, device="cuda", dtype=dtype, generator=g)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def cu_from_lens(lens):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device="cuda")


def long_tail_lengths(total=65536, seed=0):
    """Long-tail document lengths (lognormal, 16..32K tokens) summing to exactly ``total``."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        x = int(math.exp(6.5 + 1.6 * torch.randn(1, generator=g).item()))
        lens.append(max(16, min(32768, x)))
    lens[-1] -= sum(lens) - total
    if lens[-1] <= 0:
        lens.pop()
        lens[-1] += total - sum(lens)
    return lens


def write_csv(path, rows: list[dict]):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def kept_fwd_flops(sel, Hq: int) -> int:
    """Forward FLOPs over the kept blocks of ``sel`` for ``Hq`` query heads of the grid's head dim D: 4*D per
    attended (query, key) pair of each query head (QK^T and PV, a multiply-add each)."""
    return 4 * D * (Hq // sel.num_kv_heads) * sel.kept_block_pairs_tokens()


def fwdbwd_tflops(fwd_flops: float, ms: float) -> float:
    """Effective fwd+bwd TFLOP/s of ``ms`` (the backward counts 2.5x the forward's FLOPs)."""
    return round(3.5 * fwd_flops / ms / 1e9, 1)


def csv_emitter(out, fields: list):
    """``emit(row)``: one CSV row (missing fields empty), flushed, and its JSON on stdout."""
    w = csv.DictWriter(out, fieldnames=fields)
    w.writeheader()

    def emit(row):
        w.writerow({k: row.get(k, "") for k in fields})
        out.flush()
        log(json.dumps(row))
    return emit


def timed_row(base: dict, f_ms: float, fb_ms: float, flops: float) -> dict:
    return dict(base, fwd_ms=round(f_ms, 4), fwdbwd_ms=round(fb_ms, 4), fwd_tflops=round(flops / f_ms / 1e9, 1),
                fwdbwd_tflops=fwdbwd_tflops(flops, fb_ms))


# How --flex-mode compiles flex_attention (torch.compile arguments). Max-autotune times Flex's Triton template
# over its tile configs on the first call of each shape (150-250 s per head configuration of the fair batch on
# an H100) and is 2-3% faster there than the default mode (--flex-variants); coordinate-descent tuning on top
# of it, as torchtitan compiles Flex, is no faster there (within 0.4% for MHA, 2.8% slower for GQA).
FLEX_COMPILES = {
    "max-autotune-no-cudagraphs": dict(mode="max-autotune-no-cudagraphs"),
    "default": {},
    "max-autotune-coordinate-descent": dict(options={"max_autotune": True, "coordinate_descent_tuning": True}),
}
FLEX_MODES = tuple(FLEX_COMPILES)


def compiled_flex(mode: str):
    """flex_attention compiled as FLEX_COMPILES[mode] says."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, **FLEX_COMPILES[mode])


def heads_first(q, k, v, do) -> list:
    """Contiguous [1, H, T, D] copies of [T, H, D] q, k, v, dO (what FlexAttention and SDPA take): q, k, v as
    leaves that require grad, dO a plain copy."""
    out = [x.detach().transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, do)]
    return [x.requires_grad_() for x in out[:3]] + out[3:]


def weighted_kept_fraction(sel, lens) -> float:
    """The selection's kept fraction over its documents ``lens``, each weighted by its length squared (its
    causal pairs, roughly), to 4 places: one number per grid point however the documents keep."""
    weight = torch.tensor(lens, device=sel.kept_fraction.device).float() ** 2
    return round(float((sel.kept_fraction * weight).sum() / weight.sum()), 4)


def flex_pair(flex, tensors, bm, G: int, kernel_options: dict | None = None):
    """FlexAttention's (fwd, fwd+bwd) on [1, H, T, D] tensors (q, k, v, do) over a BlockMask, with
    ``kernel_options`` (a backend, tile sizes) where given."""
    qb, kb, vb, dob = tensors
    opts = {"kernel_options": kernel_options} if kernel_options else {}
    fwd = lambda: flex(qb, kb, vb, block_mask=bm, enable_gqa=G > 1, **opts)  # noqa: E731
    return fwd, lambda: torch.autograd.grad(fwd(), (qb, kb, vb), dob)


def sparse_pair(q, k, v, do, docs, sel, options: KernelOptions):
    """Our (fwd, fwd+bwd) on [T, H, D] leaves over the selection ``sel`` of the documents ``docs``."""
    fwd = lambda: sparse_attention(q, k, v, docs, selection=sel, options=options)  # noqa: E731
    return fwd, lambda: torch.autograd.grad(fwd(), (q, k, v), do)
