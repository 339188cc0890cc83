"""Benchmark and GPU checks of kernels.sparse_attention (run on an H200).

    python -m benchmarks.attention --check            # bf16/fp16 fwd + grads vs the fp32 naive reference
    python -m benchmarks.attention --tune             # time a few (BM, BN, warps, stages, grid order) per kernel
    python -m benchmarks.attention --tune --apply-tuned --check --bench --csv grid.csv --check-csv check.csv
    python -m benchmarks.attention --csv out.csv      # the benchmark grid (default)
    python -m benchmarks.attention --rounds 3 --csv out.csv   # each point 3 times, implementations in turn: medians
    python -m benchmarks.attention --no-packed --lengths 131072 --csv part.csv   # part of the grid (split over calls)
    python -m benchmarks.attention --selection        # selection time vs fwd+bwd, 3 repeats
    python -m benchmarks.attention --kernels --sparsities 0.9,0.95   # per-kernel times on the fair batch
    python -m benchmarks.attention --flex-variants    # Flex's compile modes and tile options against ours

Grid: single sequences L in {8K, 32K, 128K} x sparsity {0, .5, .75, .9, .95} and a packed 64K-token batch of
long-tail documents; H=16, D=128, bf16, block 128. Sparsity s means ``kept_fraction = 1 - s`` (selection by
routing score, diagonal always kept). Compared in the same run: FlexAttention (``torch.compile(flex_attention)``
in ``--flex-mode``, by default max-autotune-no-cudagraphs, its fastest construction measured, with a BlockMask
built from the very same selection) and cuDNN SDPA (dense causal). Effective TFLOP/s count the
attended (query, key) pairs of kept blocks: fwd = 4*D*pairs*Hq, fwd+bwd = 3.5x that. If a config fails its
error is recorded in the CSV and the run continues.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import math
import os
import statistics
import time
import traceback

import torch

from kernels.sparse_attention import (KernelOptions, VarlenBatch, select_blocks, sparse_attention,
                                      sparse_attention_naive)
from kernels.sparse_attention import backward, forward, launch
from sim.core import ArgumentParser, ConfigError, number_list, one_line_errors

H, D, B = 16, 128, 128  # the grid's heads, head dim and block size (tuning and --config apply to (B, D))
TORCH_SELECTION = KernelOptions(selection="torch")
GRID_FIELDS = ["case", "T", "ndocs", "sparsity", "kept_fraction", "impl", "fwd_ms", "fwdbwd_ms", "fwd_tflops",
               "fwdbwd_tflops", "speedup_vs_flex_fwdbwd", "error"]
GRAPH_FIELDS = ["fwd_graph_ms", "fwdbwd_graph_ms", "speedup_vs_flex_fwdbwd_graph"]


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


def rel_errors(outs, refs) -> list[float]:
    """Max abs error over max abs reference, per tensor (inf where not finite)."""
    errs = []
    for a, b in zip(outs, refs):
        e = (a.float() - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
        errs.append(e if math.isfinite(e) else float("inf"))
    return errs


def against_reference(q, k, v, cu, sel, options: KernelOptions, det: bool):
    """Relative errors of (o, dq, dk, dv) against the fp32 reference with NaN-poisoned outputs, and (``det``)
    whether a second backward is bitwise equal."""
    poison = dataclasses.replace(options, poison_outputs=True)
    o = sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=poison)
    do = torch.randn_like(o)
    g = torch.autograd.grad(o, (q, k, v), do)
    same = True
    if det:
        g2 = torch.autograd.grad(sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=poison),
                                 (q, k, v), do)
        same = all(torch.equal(a, b) for a, b in zip(g, g2))
    qf, kf, vf = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = sparse_attention_naive(qf, kf, vf, cu, sel)
    gr = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    return rel_errors((o, *g), (ref, *gr)), same


def write_csv(path, rows: list[dict]):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


# ---------------------------------------------------------------------------------------------- check
CHECK_LENS = [1, 17, 300, 1000, 64, 129, 1, 2047, 130]
CHECK_TOL = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 5e-3)}  # (output, gradients)


def check(args):
    # only what launches compiles: a check validates numbers, not a training run's first step
    options = dataclasses.replace(args.options, precompile=False)
    torch.manual_seed(0)
    cu = cu_from_lens(CHECK_LENS)
    T = sum(CHECK_LENS)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for hd in (64, 128):
            for bs in (64, 128):
                for (Hq, Hkv), budget in (((8, 2), dict(p=0.9)), ((4, 4), dict(kept_fraction=0.3)),
                                          ((8, 1), dict(p=1.0))):
                    q, k, v = make_qkv(T, Hq, Hkv, hd, dtype, seed=hd + bs)
                    sel = select_blocks(q, k, cu, block_size=bs, **budget, options=options)
                    errs, det = against_reference(q, k, v, cu, sel, options, det=True)
                    errs = dict(zip(("o", "dq", "dk", "dv"), errs))
                    ft, gt = CHECK_TOL[dtype]
                    ok = errs["o"] <= ft and max(errs["dq"], errs["dk"], errs["dv"]) <= gt and det
                    row = dict(dtype=str(dtype).split(".")[-1], D=hd, B=bs, Hq=Hq, Hkv=Hkv, budget=str(budget),
                               **{f"rel_err_{k_}": f"{v_:.2e}" for k_, v_ in errs.items()},
                               deterministic=det, ok=ok)
                    rows.append(row)
                    log(json.dumps(row))
    ok_all = all(row["ok"] for row in rows)
    log("CHECK", "PASS" if ok_all else "FAIL")
    if args.csv:
        write_csv(args.csv, rows)
    return ok_all


# ---------------------------------------------------------------------------------------------- tune
def tune_shapes() -> dict:
    """(name, document lengths, kept fraction) of the shapes of each row-length class."""
    return {"long": (("single128k_kf0.25", [131072], 0.25), ("single32k_dense", [32768], 1.0),
                     ("single32k_kf0.1", [32768], 0.1)),
            "short": (("packed64k_kf0.1", long_tail_lengths(65536), 0.1), ("single8k_kf0.1", [8192], 0.1))}


def tune(args):
    """Time candidate configs of each kernel config (``fwd``, ``dq``, ``dkdv`` for long rows and their
    ``_short`` twins) on shapes of its row-length class, each kernel launched alone (the dK/dV kernel on a
    delta from one dQ pass), and pick the lowest sum of times relative to each shape's best (so no shape
    dominates by its size). Returns the winners."""
    shapes = tune_shapes()
    res = {}
    for cls, cls_shapes in shapes.items():
        for name, lens, kf in cls_shapes:
            tune_shape(args, res, cls, name, lens, kf)
            torch.cuda.empty_cache()
    best = {}
    for kind, cands in args.tune_cands.items():
        names = [n for n, _, _ in shapes["short" if kind.endswith("_short") else "long"]]
        ok = [c for c in cands if all(math.isfinite(res[(kind, c)][n]) for n in names)]
        if not ok:
            continue
        low = {n: min(res[(kind, c)][n] for c in ok) for n in names}
        scored = sorted((sum(res[(kind, c)][n] / low[n] for n in names), c) for c in ok)
        log(f"TUNE_RANK {kind} " + " ".join(f"{c}:{sc:.3f}" for sc, c in scored))
        best[kind] = dict(zip(CONFIG_KEYS, scored[0][1]))
    log("TUNE_BEST", json.dumps(best))
    return best


def kernel_launchers(q, k, v, sel):
    """{kind: launcher(options)} timing each kernel alone on one shape: the forward, dQ, and dK/dV on the
    delta of one dQ pass."""
    scale = D ** -0.5
    o, lse = forward.sparse_attn_fwd(q, k, v, sel, scale)
    do = torch.randn_like(o)
    _, delta = backward.sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, scale)
    return {"fwd": lambda opts: forward.sparse_attn_fwd(q, k, v, sel, scale, opts),
            "dq": lambda opts: backward.sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, scale, options=opts),
            "dkdv": lambda opts: backward.sparse_attn_bwd_dkdv(do, q, k, v, lse, delta, sel, scale, opts)}


def tune_shape(args, res: dict, cls: str, name: str, lens, kf):
    """Time every candidate of the ``cls`` row class on one shape into ``res[(kind, cand)][name]``."""
    q, k, v = make_qkv(sum(lens), H, H, D, torch.bfloat16, grad=False)
    sel = select_blocks(q, k, cu_from_lens(lens), kept_fraction=kf, block_size=B)
    assert (sel.row_blocks * B < launch.SHORT_ROW_TOKENS) == (cls == "short"), \
        f"{name}: longest row {sel.row_blocks} blocks"
    launchers = kernel_launchers(q, k, v, sel)
    for kind, cands in args.tune_cands.items():
        if kind.endswith("_short") != (cls == "short"):
            continue
        base = kind.split("_")[0]
        for cand in cands:
            compiled = {}
            opts = KernelOptions(tiles={(B, D): {kind: dict(zip(CONFIG_KEYS, cand))}}, compiled=compiled)
            try:
                ms = bench(lambda: launchers[base](opts))
                info = f"regs={compiled[base].n_regs} spills={compiled[base].n_spills}"
            except Exception as e:  # noqa: BLE001
                ms, info = float("nan"), repr(e)[:200]
            res.setdefault((kind, cand), {})[name] = ms
            log(f"tune {name} {kind} {cand} {ms:.3f} ms {info}")


# A config tuple names these keys in order (a shorter tuple leaves the rest at the defaults); dkdv: BN is the
# program's KV tile, BM the query sub-tile; WS exists in the forward only (the dK/dV candidates leave TMA on);
# maxnreg 0: no register cap.
CONFIG_KEYS = ("BM", "BN", "num_warps", "num_stages", "HEAD_OUTER", "TMA", "WS", "maxnreg")
TUNE_CANDS = {
    "fwd": [(128, 128, 8, 2, True, True, True), (128, 128, 8, 3, True, True, True),
            (128, 128, 8, 3, True, False, False), (128, 64, 8, 3, True, False, False)],
    "fwd_short": [(64, 32, 4, 2, True, True, False, 128), (64, 32, 4, 2, True, True, False, 0),
                  (64, 64, 4, 3, True, True, False, 0), (64, 64, 4, 3, True, True, True, 0),
                  (64, 64, 4, 3, True, False, False, 0)],
    "dq": [(128, 128, 8, 2, True, True), (128, 128, 8, 3, True, True), (128, 128, 8, 3, True, False),
           (64, 64, 4, 3, True, False)],
    "dq_short": [(64, 32, 4, 2, True, True), (64, 64, 4, 2, True, True), (64, 64, 4, 3, True, True),
                 (64, 64, 4, 3, True, False)],
    "dkdv": [(64, 64, 4, 2, True), (64, 64, 4, 3, True), (128, 64, 8, 2, True)],
    "dkdv_short": [(64, 64, 4, 2, True), (64, 64, 4, 3, True), (64, 64, 4, 1, True)],
}


def tiles_option(configs: dict) -> KernelOptions:
    """Options with ``{kind: {key: value}}`` launch configs for the grid's (block, head dim)."""
    return KernelOptions(tiles={(B, D): configs})


# ---------------------------------------------------------------------------------------------- bench
def _dense_to_ordered(dense):
    """[1, H, NB, NB] bool -> (num [1, H, NB], indices [1, H, NB, NB]) with kept blocks first, ascending, and
    the rest of each row a permutation of the other blocks (what create_block_mask produces)."""
    num = dense.sum(-1).to(torch.int32)
    idx = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, idx


def flex_block_mask_single(sel, H, L, B):
    """BlockMask for one sequence (blocks aligned with Flex's): diagonal = partial (causal mask_mod),
    other kept blocks = full."""
    from torch.nn.attention.flex_attention import BlockMask

    dense = sel.to_dense_mask()[None]  # [1, H, NB, NB]
    assert dense.shape[1] == H
    eye = torch.eye(dense.shape[-1], dtype=torch.bool, device=dense.device)
    part_num, part_idx = _dense_to_ordered(dense & eye)
    full_num, full_idx = _dense_to_ordered(dense & ~eye)

    sel_dense = dense[0]

    def mask_mod(b, h, q_idx, kv_idx):  # only evaluated on partial (diagonal) blocks by the fused kernel
        return (q_idx >= kv_idx) & sel_dense[h, q_idx // B, kv_idx // B]

    return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=B, mask_mod=mask_mod,
                                    seq_lengths=(L, L))


def flex_block_mask_packed(sel, H, T, B):
    from torch.nn.attention.flex_attention import create_block_mask

    lay = sel.layout
    dense = sel.to_dense_mask()  # [H, NB, NB]
    tok_doc = lay.block_doc[lay.token_block]
    tok_blk = lay.token_block

    def mask_mod(b, h, q_idx, kv_idx):
        same = tok_doc[q_idx] == tok_doc[kv_idx]
        return same & (kv_idx <= q_idx) & dense[h, tok_blk[q_idx], tok_blk[kv_idx]]

    dev = sel.q2k_idx.device
    return create_block_mask(mask_mod, 1, H, T, T, device=dev, BLOCK_SIZE=B, _compile=dev.type == "cuda")




def selection_cost(emit, options: KernelOptions, lengths=(32768,), repeats=1):
    """Selection time against our fwd+bwd on the same selection, single sequences, sparsity 0.9 (top-k and
    top-p budgets), with ``cu_seqlens`` on the host (as a data loader hands it over; the layout needs its
    values there) and on the GPU (one more device->host copy and sync per call). Selection is host-bound (a
    few launches), so ``repeats`` shows its spread."""
    for L in lengths:
        try:
            q, k, v = make_qkv(L, H, H, D, torch.bfloat16)
            cu = cu_from_lens([L])
            do = torch.randn_like(q)
            for _ in range(repeats):
                for mode, kw, c in (("kept_fraction=0.1", dict(kept_fraction=0.1), cu.cpu()),
                                    ("kept_fraction=0.1,cu_seqlens_on_gpu", dict(kept_fraction=0.1), cu),
                                    ("p=0.9", dict(p=0.9), cu.cpu())):
                    s_ms = bench(lambda: select_blocks(q, k, c, block_size=B, **kw))
                    sel = select_blocks(q, k, cu, block_size=B, **kw)
                    fb_ms = bench(lambda: torch.autograd.grad(
                        sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=options), (q, k, v),
                        do))
                    emit(dict(case=f"selection_{L // 1024}k", T=L, ndocs=1,
                              sparsity=round(1 - float(sel.kept_fraction[0]), 4),
                              kept_fraction=round(float(sel.kept_fraction[0]), 4), impl=f"select[{mode}]",
                              fwd_ms=round(s_ms, 4), fwdbwd_ms=round(fb_ms, 4),
                              error=f"select/attn_fwdbwd={s_ms / fb_ms:.3f}"))
        except Exception as e:  # noqa: BLE001
            emit(dict(case=f"selection_{L // 1024}k", impl="select", error=repr(e)[:300]))


def short_vs_long(args):
    """On short-row selections (MHA and GQA), time each kernel with its short-row config and with its
    long-row config (every launch of the row class); prints one JSON row per shape."""
    cases = [((16, 2), [1024], 0.2), ((16, 2), [2048], 0.2), ((16, 2), [4096], 0.1), ((16, 2), [8192], 0.1),
             ((16, 2), [16384], 0.05), ((32, 8), [2048], 0.2), ((32, 8), [8192], 0.1), ((16, 16), [8192], 0.1),
             ((16, 2), long_tail_lengths(65536), 0.1), ((16, 16), long_tail_lengths(65536), 0.1)]
    scale = D ** -0.5
    as_long = tiles_option({f"{k_}_short": dict(launch.DEFAULT_CONFIG[k_]) for k_ in ("fwd", "dq", "dkdv")})
    for (Hq, Hkv), lens, kf in cases:
        q, k, v = make_qkv(sum(lens), Hq, Hkv, D, torch.bfloat16, grad=False)
        sel = select_blocks(q, k, cu_from_lens(lens), kept_fraction=kf, block_size=B)
        o, lse = forward.sparse_attn_fwd(q, k, v, sel, scale)
        do = torch.randn_like(o)
        row = dict(Hq=Hq, Hkv=Hkv, T=sum(lens), ndocs=len(lens), kf=kf, row_tokens=sel.row_blocks * B)
        for name, opts in (("short", KernelOptions()), ("long", as_long)):
            row[f"fwd_{name}"] = round(bench(lambda: forward.sparse_attn_fwd(q, k, v, sel, scale, opts)), 4)
            row[f"bwd_{name}"] = round(bench(lambda: backward.sparse_attn_bwd(do, q, k, v, o, lse, sel, scale,
                                                                              opts)), 4)
        log("SHORT_VS_LONG", json.dumps(row))


def kernel_floor_bytes(T: int, Hq: int, Hkv: int, D: int, elem_size: int) -> dict:
    """{kind: least HBM bytes} of each kernel that :func:`kernel_launchers` times, for Q and O ``[T, Hq, D]``,
    K and V ``[T, Hkv, D]`` of ``elem_size`` bytes and LSE and delta float32 ``[Hq, T]``. Every token keeps its
    diagonal block at any sparsity, so each kernel touches every row of each of its operands; the floor assumes
    each operand crosses HBM once (L2 reuse perfect: K/V across a GQA group's heads and query tiles, Q/dO across
    the KV tiles that attend them) and leaves out the selection's lists (an int32 per kept block)."""
    q, kv, rows = T * Hq * D * elem_size, T * Hkv * D * elem_size, T * Hq * 4
    return {"fwd": 2 * q + 2 * kv + rows,  # read Q, K, V; write O, LSE
            "dq": 4 * q + 2 * kv + 2 * rows,  # read Q, dO, O, K, V, LSE; write dQ, delta (no delta given)
            "dkdv": 2 * q + 4 * kv + 2 * rows}  # read Q, dO, K, V, LSE, delta; write dK, dV


def copy_bytes_per_ms(nbytes: int = 1 << 30) -> float:
    """HBM bytes per ms of a device-to-device copy of ``nbytes`` (read + write): the bandwidth that the kernels'
    floors divide by, measured in the same run since no kernel reaches the datasheet's peak."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src), rep=100)


def kept_fwd_flops(sel, Hq: int) -> int:
    """Forward FLOPs over the kept blocks of ``sel`` for ``Hq`` query heads of the grid's head dim D: 4*D per
    attended (query, key) pair of each query head (QK^T and PV, a multiply-add each)."""
    return 4 * D * (Hq // sel.num_kv_heads) * sel.kept_block_pairs_tokens()


def fwdbwd_tflops(fwd_flops: float, ms: float) -> float:
    """Effective fwd+bwd TFLOP/s of ``ms`` (the backward counts 2.5x the forward's FLOPs)."""
    return round(3.5 * fwd_flops / ms / 1e9, 1)


def floor_fields(kernel_ms: dict, floor_bytes: dict, bytes_per_ms: float, fwd_flops: float) -> dict:
    """A --kernels row's distance from the memory bound: each kernel's floor (``<kind>_floor_ms``: its
    :func:`kernel_floor_bytes` at ``bytes_per_ms``), the kernels' summed times (``sum_ms``) and floors
    (``floor_sum_ms``), and the effective fwd+bwd TFLOP/s of each: reached (``tflops``) and the bound of any
    kernels that read each operand once at this sparsity (``floor_tflops``)."""
    floors = {kind: floor_bytes[kind] / bytes_per_ms for kind in kernel_ms}
    sum_ms, floor_ms = sum(kernel_ms.values()), sum(floors.values())
    return {**{f"{kind}_floor_ms": round(ms, 4) for kind, ms in floors.items()},
            "sum_ms": round(sum_ms, 4), "floor_sum_ms": round(floor_ms, 4),
            "tflops": fwdbwd_tflops(fwd_flops, sum_ms), "floor_tflops": fwdbwd_tflops(fwd_flops, floor_ms)}


def kernel_breakdown(args):
    """Where the fair batch's time goes at each sparsity: each kernel (forward, dQ, dK/dV) timed alone, for
    every head configuration of --fair-heads on the aligned batch, beside the same batch with each row cut to
    its diagonal block (the floor of any sparsity); with the share of rows that keep their diagonal alone
    and the diagonal blocks' share of the kept FLOPs, and how far the kernels are from the memory bound
    (:func:`floor_fields`, at the copy bandwidth measured once up front). One JSON row per point."""
    aligned, _ = fair_lengths()
    cu = cu_from_lens(aligned)
    options = dataclasses.replace(args.options, precompile=False)
    bytes_per_ms = copy_bytes_per_ms()
    log("HBM", json.dumps(dict(copy_gbs=round(bytes_per_ms / 1e6, 1))))
    for heads in args.fair_heads:
        Hq, Hkv = FAIR_HEADS[heads]
        q, k, v = make_qkv(sum(aligned), Hq, Hkv, D, torch.bfloat16, grad=False)
        floor_bytes = kernel_floor_bytes(sum(aligned), Hq, Hkv, D, q.element_size())
        # every row keeps at least its diagonal block, so a budget of almost nothing keeps it alone
        diagonal = select_blocks(q, k, cu, kept_fraction=1e-9, block_size=B, options=options)
        diagonal_pairs = diagonal.kept_block_pairs_tokens()
        for sp in ["diagonal", *args.sparsities]:
            sel = diagonal if sp == "diagonal" else select_blocks(q, k, cu, kept_fraction=1.0 - sp, block_size=B,
                                                                  options=options)
            row = dict(heads=f"{Hq}:{Hkv}", sparsity=sp,
                       diagonal_only_rows=round(float((sel.q2k_cnt == 1).float().mean()), 4),
                       diagonal_flop_share=round(diagonal_pairs / sel.kept_block_pairs_tokens(), 4))
            kernel_ms = {kind: bench(lambda run=run: run(options), rep=100)
                         for kind, run in kernel_launchers(q, k, v, sel).items()}
            row.update({f"{kind}_ms": round(ms, 4) for kind, ms in kernel_ms.items()})
            row.update(floor_fields(kernel_ms, floor_bytes, bytes_per_ms, kept_fwd_flops(sel, Hq)))
            log("KERNELS", json.dumps(row))
        del q, k, v
        torch.cuda.empty_cache()


def grid_cases(lengths, packed: bool) -> list:
    """(case, document lengths) of the grid: the packed 64K micro-batch (unless ``packed`` is false), then one
    single sequence per length."""
    return ([("packed64k", long_tail_lengths(65536))] if packed else []) + [("single", [L]) for L in lengths]


def csv_emitter(out, fields: list):
    """``emit(row)``: one CSV row (missing fields empty), flushed, and its JSON on stdout."""
    w = csv.DictWriter(out, fieldnames=fields)
    w.writeheader()

    def emit(row):
        w.writerow({k: row.get(k, "") for k in fields})
        out.flush()
        log(json.dumps(row))
    return emit


def add_graph_times(row: dict, T: int, graph_max_tokens: int, fwd, fwdbwd):
    """The CUDA-graph times of one implementation into its row (where T <= --graph-max-tokens); a graph that
    cannot be captured is noted in the row's error field."""
    if T > graph_max_tokens:
        return
    try:
        g_f, g_fb = graph_times(fwd, fwdbwd)
        row.update(fwd_graph_ms=round(g_f, 4), fwdbwd_graph_ms=round(g_fb, 4))
    except Exception as e:  # noqa: BLE001
        row["error"] = (row.get("error", "") + f" graph: {e!r:.200}").strip()


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


def run_bench(args):
    import triton

    flex = compiled_flex(args.flex_mode)
    fields = GRID_FIELDS[:-1] + GRAPH_FIELDS + GRID_FIELDS[-1:] if args.graph_max_tokens else GRID_FIELDS
    tiles = {kind: dict(cfg) for kind, cfg in args.options.tile_overrides(B, D).items()}
    meta = dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(),
                configs=tiles or "default", rounds=args.rounds, flex_mode=args.flex_mode)
    with open(args.csv, "w", newline="") as out:
        emit = csv_emitter(out, fields)
        log("META", json.dumps(meta, default=str))
        selection_cost(emit, args.options)
        t_start = time.time()
        for case, lens in grid_cases(args.lengths, args.packed):
            if time.time() - t_start > args.deadline_s:
                emit(dict(case=case, T=sum(lens), ndocs=len(lens), impl="all", error="skipped: --deadline-s reached"))
                continue
            bench_case(args, emit, flex, case, lens, t_start)
            torch.cuda.empty_cache()


def bench_case(args, emit, flex, case: str, lens: list, t_start: float):
    """The rows of one grid case: cuDNN dense (single sequences), then every sparsity."""
    T = sum(lens)
    log(f"== {case} T={T} ndocs={len(lens)} max_doc={max(lens)}")
    q, k, v = make_qkv(T, H, H, D, torch.bfloat16)
    do = torch.randn_like(q)
    # FlexAttention and cuDNN take [1, H, T, D]
    heads_first = [x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v)]
    dob = do.transpose(0, 1).unsqueeze(0).contiguous()
    if case == "single":
        emit(cudnn_row(args, case, lens, heads_first, dob))
    for sp in args.sparsities:
        if time.time() - t_start > args.deadline_s:
            emit(dict(case=case, T=T, ndocs=len(lens), sparsity=sp, impl="all", error="skipped: --deadline-s reached"))
            continue
        bench_point(args, emit, flex, case, lens, sp, (q, k, v, do), (*heads_first, dob))


def cudnn_row(args, case: str, lens: list, heads_first: list, dob) -> dict:
    """cuDNN dense causal attention on one sequence (the dense reference)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qb, kb, vb = heads_first
    T = sum(lens)
    try:
        def cudnn_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        cudnn_fb = lambda: torch.autograd.grad(cudnn_fwd(), (qb, kb, vb), dob)  # noqa: E731
        timed = interleaved_ms({"cudnn": (cudnn_fwd, cudnn_fb)}, args.rounds)["cudnn"]
        if isinstance(timed, Exception):
            raise timed
        flops = 4 * D * H * sum(n * (n + 1) // 2 for n in lens)
        row = timed_row(dict(case=case, T=T, ndocs=len(lens), sparsity=0.0, kept_fraction=1.0, impl="cudnn_dense"),
                        *timed, flops)
        add_graph_times(row, T, args.graph_max_tokens, cudnn_fwd, cudnn_fb)
        return row
    except Exception as e:  # noqa: BLE001
        return dict(case=case, T=T, ndocs=len(lens), impl="cudnn_dense", error=repr(e)[:300])


def flex_fns(args, emit, flex, case: str, sel, base: dict, heads_first) -> tuple | None:
    """FlexAttention's (fwd, fwd+bwd) over the selection's BlockMask, and a note of the mask's build time;
    None where it is skipped (dense single sequences above --flex-dense-max) or the mask fails (its row
    emitted)."""
    qb, kb, vb, dob = heads_first
    T = base["T"]
    if case == "single" and base["sparsity"] == 0.0 and T > args.flex_dense_max:
        emit(dict(base, impl="flex", error=f"skipped: dense flex at T={T} > --flex-dense-max"))
        return None
    try:
        t0 = time.time()
        bm = (flex_block_mask_single(sel, H, T, B) if case == "single"
              else flex_block_mask_packed(sel, H, T, B))
        note = f"block_mask_build_s={time.time() - t0:.2f}"
        ffwd = lambda: flex(qb, kb, vb, block_mask=bm)  # noqa: E731
        return (ffwd, lambda: torch.autograd.grad(ffwd(), (qb, kb, vb), dob)), note
    except Exception as e:  # noqa: BLE001
        emit(dict(base, impl="flex", error=repr(e)[:300]))
        traceback.print_exc()
        return None


def bench_point(args, emit, flex, case: str, lens: list, sp: float, tensors, heads_first):
    """Our kernel and FlexAttention at one sparsity of one case, timed in turns; their rows."""
    q, k, v, do = tensors
    T = sum(lens)
    cu = cu_from_lens(lens)
    try:
        sel = select_blocks(q, k, cu, kept_fraction=1.0 - sp, block_size=B)
        flops = 4 * D * sel.kept_block_pairs_tokens()  # pairs over KV heads == H here
        weight = torch.tensor(lens, device="cuda").float() ** 2
        kept = float((sel.kept_fraction * weight).sum() / weight.sum())
    except Exception as e:  # noqa: BLE001
        emit(dict(case=case, T=T, ndocs=len(lens), sparsity=sp, impl="select", error=repr(e)[:300]))
        return
    base = dict(case=case, T=T, ndocs=len(lens), sparsity=sp, kept_fraction=round(kept, 4))
    fwd = lambda: sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=args.options)  # noqa: E731
    fns = {"triton_sparse": (fwd, lambda: torch.autograd.grad(fwd(), (q, k, v), do))}
    flex_timed = flex_fns(args, emit, flex, case, sel, base, heads_first)
    if flex_timed is not None:
        fns["flex"], note = flex_timed
    rows = {}
    for impl, timed in interleaved_ms(fns, args.rounds).items():
        if isinstance(timed, Exception):
            rows[impl] = dict(base, impl=impl, error=repr(timed)[:300])
            continue
        rows[impl] = timed_row(dict(base, impl=impl), *timed, flops)
        add_graph_times(rows[impl], T, args.graph_max_tokens, *fns[impl])
    ours, theirs = rows["triton_sparse"], rows.get("flex")
    if theirs is not None:
        if "fwd_ms" in theirs:
            diff = (fns["flex"][0]()[0].transpose(0, 1).float() - fwd().float()).abs().max().item()
            note += f" maxdiff_vs_triton={diff:.2e}"
        theirs["error"] = (note + " " + theirs.get("error", "")).strip()
        emit(theirs)
        add_speedups(ours, theirs)
    emit(ours)


def add_speedups(ours: dict, theirs: dict):
    """Flex's time over ours (fwd+bwd; also from the CUDA graphs where both were replayed)."""
    if "fwdbwd_ms" in ours and "fwdbwd_ms" in theirs:
        ours["speedup_vs_flex_fwdbwd"] = round(theirs["fwdbwd_ms"] / ours["fwdbwd_ms"], 3)
        if "fwdbwd_graph_ms" in ours and "fwdbwd_graph_ms" in theirs:
            ours["speedup_vs_flex_fwdbwd_graph"] = round(theirs["fwdbwd_graph_ms"] / ours["fwdbwd_graph_ms"], 3)


# ---------------------------------------------------------------------------------------------- fair
# The fair comparison: one packed micro-batch of long-tail documents, MHA (the grid's 16 heads) and GQA 32:4.
# Flex's blocks are global, ours per document: on documents that do not start at a block boundary, Flex's
# token-level document mask (create_block_mask) makes blocks straddle documents and computes them all, which
# is most of our lead on packed batches. Flex's best constructions are measured beside it: documents aligned to
# the block size with Flex handed exactly our kept blocks (BlockMask.from_kv_blocks, enable_gqa), and the
# unaligned documents each padded to a whole number of blocks (what a Flex user does, a few % more tokens).
FAIR_HEADS = {"mha": (16, 16), "gqa": (32, 4)}
FAIR_SPARSITIES = {"mha": (0.0, 0.75, 0.9, 0.95), "gqa": (0.0, 0.5, 0.9)}
FAIR_FIELDS = ["case", "heads", "T", "ndocs", "padded_T", "sparsity", "kept_fraction", "impl", "fwd_ms", "fwdbwd_ms",
               "fwd_tflops", "fwdbwd_tflops", "error"]
# (peer, ours) rows of each construction: ours on the batch the construction starts from
FAIR_PAIRS = (("flex_token_mask", "triton_sparse"), ("flex_padded", "triton_sparse"),
              ("flex_exact", "triton_sparse_aligned"), ("flex_flash_exact", "triton_sparse_aligned"),
              ("cudnn_per_document_dense", "triton_sparse"))


def fair_lengths(total: int = 65536, seed: int = 0) -> tuple[list[int], list[int]]:
    """(aligned, unaligned) document lengths of one packed batch: the long-tail lengths rounded up to whole
    blocks and trimmed, largest first, to ``total`` tokens; and the same documents each shorter by 0..B-1
    tokens (at least one left), so that padding them back to whole blocks gives the aligned batch."""
    aligned = [-(-n // B) * B for n in long_tail_lengths(total, seed)]
    while sum(aligned) > total:
        aligned[aligned.index(max(aligned))] -= B
    g = torch.Generator().manual_seed(seed + 1)
    cut = torch.randint(0, B, (len(aligned),), generator=g).tolist()
    return aligned, [n - min(c, n - 1) for n, c in zip(aligned, cut)]


def exact_block_mask(sel, Hq: int, kv_end: torch.Tensor):
    """BlockMask over a batch whose documents are whole blocks (aligned or padded) from our selection's kept
    blocks, per query head (each KV head's blocks for its group): kept blocks below the diagonal full, the
    diagonal partial, masked causally and past each document's real end ``kv_end`` (per token)."""
    from torch.nn.attention.flex_attention import BlockMask

    dense = sel.to_dense_mask().repeat_interleave(Hq // sel.num_kv_heads, dim=0)[None]  # [1, Hq, NB, NB]
    eye = torch.eye(dense.shape[-1], dtype=torch.bool, device=dense.device)
    part_num, part_idx = _dense_to_ordered(dense & eye)
    full_num, full_idx = _dense_to_ordered(dense & ~eye)

    def mask_mod(b, h, q_idx, kv_idx):  # evaluated on the diagonal blocks only
        return (q_idx >= kv_idx) & (kv_idx < kv_end[q_idx])

    T = kv_end.numel()
    return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=B, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


def padded_positions(lens: list[int], device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each real token in the padded batch, each padded token's document end in padded
    coordinates), documents padded to whole blocks."""
    starts, pos, ends = 0, [], []
    for n in lens:
        nb = -(-n // B) * B
        pos.append(torch.arange(starts, starts + n))
        ends.append(torch.full((nb,), starts + n))
        starts += nb
    return torch.cat(pos).to(device), torch.cat(ends).to(device)


def heads_first(*xs):
    """[T, H, D] -> [1, H, T, D] leaves (what FlexAttention and SDPA take)."""
    return [x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in xs]


def fair_flex_fns(flex, tensors, bm, G: int, kernel_options: dict | None = None):
    """FlexAttention's (fwd, fwd+bwd) on [1, H, T, D] tensors (q, k, v, do) over a BlockMask, with
    ``kernel_options`` (a backend, tile sizes) where given."""
    qb, kb, vb, dob = tensors
    opts = {"kernel_options": kernel_options} if kernel_options else {}
    fwd = lambda: flex(qb, kb, vb, block_mask=bm, enable_gqa=G > 1, **opts)  # noqa: E731
    return fwd, lambda: torch.autograd.grad(fwd(), (qb, kb, vb), dob)


def sparse_fns(q, k, v, do, docs, sel, options: KernelOptions):
    """Our (fwd, fwd+bwd) on [T, H, D] leaves over the selection ``sel`` of the documents ``docs``."""
    fwd = lambda: sparse_attention(q, k, v, docs, selection=sel, options=options)  # noqa: E731
    return fwd, lambda: torch.autograd.grad(fwd(), (q, k, v), do)


def padded_tensors(pos: torch.Tensor, T_pad: int, q, k, v, do):
    """[1, H, T_pad, D] copies of q, k, v, dO with each real token at its padded position, zeros between."""
    out = []
    for x in (q, k, v, do):
        p = torch.zeros(T_pad, *x.shape[1:], device=x.device, dtype=x.dtype)
        p[pos] = x.detach()
        out.append(p)
    return [*heads_first(*out[:3]), out[3].transpose(0, 1).unsqueeze(0).contiguous()]


def cudnn_per_document_fns(q, k, v, do, lens):
    """cuDNN SDPA, dense causal, one call per document: (fwd, fwd+bwd); its launches cost host time that
    do_bench counts wherever the GPU runs short of it. cuDNN refuses a key length of 1 (torch 2.11: "cudnn
    SDPA does not support key/value sequence length 1"), so a one-token document goes to whichever SDPA
    backend torch picks for it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    spans = torch.tensor([0, *lens]).cumsum(0).tolist()
    G = q.shape[1] // k.shape[1]

    def fwd():
        outs = []
        for s, e in zip(spans, spans[1:]):
            qd, kd, vd = [x[s:e].transpose(0, 1)[None] for x in leaves]
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if e - s > 1 else contextlib.nullcontext():
                o = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=G > 1)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    return fwd, lambda: torch.autograd.grad(fwd(), leaves, do)


class Sticky:
    """An implementation that failed once (e.g. FlexAttention's FLASH backend without its packages) keeps
    that error for the rest of the run instead of paying for another try at every point."""

    def __init__(self):
        self.errors = {}

    def fns(self, name: str, make):
        if name in self.errors:
            return self.errors[name]
        try:
            return make()
        except Exception as e:  # noqa: BLE001 (recorded in the implementation's rows)
            self.errors[name] = e
            return e


def fair_point(args, emit, flex, sticky: Sticky, heads: str, sp: float, batch: dict):
    """Every implementation at one sparsity of one head configuration, timed in turns; their rows."""
    Hq, Hkv = FAIR_HEADS[heads]
    G = Hq // Hkv
    fns, flops, base = {}, {}, {}
    for name, key in (("triton_sparse", "unaligned"), ("triton_sparse_aligned", "aligned")):
        q, k, v, do, cu, lens = batch[key]
        sel = select_blocks(q, k, cu, kept_fraction=1.0 - sp, block_size=B, options=args.options)
        weight = torch.tensor(lens, device=q.device).float() ** 2
        base[name] = dict(case="packed64k", heads=f"{Hq}:{Hkv}", T=sum(lens), ndocs=len(lens), sparsity=sp,
                          kept_fraction=round(float((sel.kept_fraction * weight).sum() / weight.sum()), 4))
        flops[name] = kept_fwd_flops(sel, Hq)
        fns[name] = sparse_fns(q, k, v, do, cu, sel, args.options)
        batch[key + "_sel"] = sel
    un, al = batch["unaligned"], batch["aligned"]
    if heads == "mha":  # the token-level document mask: the construction of the --bench grid (MHA only)
        fns["flex_token_mask"] = sticky.fns(f"flex_token_mask_{sp}", lambda: fair_flex_fns(
            flex, batch["un_heads"], flex_block_mask_packed(batch["unaligned_sel"], Hq, sum(un[5]), B), G))
    fns["flex_padded"] = sticky.fns(f"flex_padded_{sp}", lambda: fair_flex_fns(
        flex, batch["padded"], exact_block_mask(batch["unaligned_sel"], Hq, batch["padded_end"]), G))
    exact = exact_block_mask(batch["aligned_sel"], Hq, batch["aligned_end"])
    fns["flex_exact"] = fair_flex_fns(flex, batch["al_heads"], exact, G)
    fns["flex_flash_exact"] = sticky.fns("flash", lambda: probed(fair_flex_fns(flex, batch["al_heads"], exact, G,
                                                                                {"BACKEND": "FLASH"})))
    if sp == 0.0:
        # One cuDNN call per document: through nested (jagged) tensors, torch 2.11's cuDNN path made an illegal
        # memory access on the H200 on this batch, which poisons the CUDA context for every later timing.
        fns["cudnn_per_document_dense"] = sticky.fns(f"cudnn_docs_{heads}", lambda: probed(
            cudnn_per_document_fns(*un[:4], un[5])))
    for impl, timed in interleaved_ms({n: f for n, f in fns.items() if not isinstance(f, Exception)},
                                      args.rounds).items():
        ours = "triton_sparse_aligned" if impl in ("flex_exact", "flex_flash_exact", "triton_sparse_aligned") \
            else "triton_sparse"
        row = dict(base[ours], impl=impl, padded_T=batch["padded_T"] if impl == "flex_padded" else "")
        emit(dict(row, error=repr(timed)[:300]) if isinstance(timed, Exception) else timed_row(row, *timed,
                                                                                              flops[ours]))
    for impl, err in fns.items():
        if isinstance(err, Exception):
            emit(dict(base["triton_sparse"], impl=impl, error=f"absent: {err!r:.300}"))


def probed(fns):
    """(fwd, fwd+bwd) after one fwd+bwd, so that an implementation that cannot run here fails at once with its
    own message: FlexAttention's FLASH backend (FlashAttention-4) without flash-attn-4 and nvidia-cutlass-dsl."""
    fns[1]()
    return fns


def fair_batch(heads: str) -> dict:
    """The packed batch of one head configuration: aligned and unaligned documents, their tensors, the
    unaligned ones padded to whole blocks, and the per-token document ends Flex's masks read."""
    Hq, Hkv = FAIR_HEADS[heads]
    aligned, unaligned = fair_lengths()
    batch = {}
    for key, lens in (("aligned", aligned), ("unaligned", unaligned)):
        q, k, v = make_qkv(sum(lens), Hq, Hkv, D, torch.bfloat16, seed=len(key))
        docs = VarlenBatch.from_cu_seqlens(cu_from_lens(lens))  # once per batch, as the runner hands it over
        batch[key] = (q, k, v, torch.randn_like(q), docs, lens)
    q, k, v, do = batch["unaligned"][:4]
    pos, padded_end = padded_positions(unaligned, q.device)
    batch.update(padded=padded_tensors(pos, padded_end.numel(), q, k, v, do), padded_end=padded_end,
                 padded_T=padded_end.numel(), aligned_end=padded_positions(aligned, q.device)[1],
                 un_heads=[*heads_first(q, k, v), do.transpose(0, 1).unsqueeze(0).contiguous()],
                 al_heads=[*heads_first(*batch["aligned"][:3]),
                           batch["aligned"][3].transpose(0, 1).unsqueeze(0).contiguous()])
    return batch


def run_fair(args):
    """The fair grid (see FAIR_HEADS): every head configuration's sparsities, into ``args.csv``. Our kernels
    compile only what they launch here (no precompile: GPU time of the call, not of a training run)."""
    import triton

    flex = compiled_flex(args.flex_mode)
    sticky = Sticky()
    args = argparse.Namespace(**{**vars(args), "options": dataclasses.replace(args.options, precompile=False)})
    t_start = time.time()
    with open(args.csv, "w", newline="") as out:
        emit = csv_emitter(out, FAIR_FIELDS)
        log("META", json.dumps(dict(torch=torch.__version__, triton=triton.__version__,
                                    gpu=torch.cuda.get_device_name(), rounds=args.rounds, flex_mode=args.flex_mode)))
        for heads in args.fair_heads:
            batch = fair_batch(heads)
            for sp in FAIR_SPARSITIES[heads]:
                if time.time() - t_start > args.deadline_s:
                    emit(dict(case="packed64k", heads="{}:{}".format(*FAIR_HEADS[heads]), sparsity=sp, impl="all",
                              error="skipped: --deadline-s reached"))
                    continue
                fair_point(args, emit, flex, sticky, heads, sp, batch)
            del batch
            torch.cuda.empty_cache()


# Flex on the fair batch's aligned documents with exactly our kept blocks, compiled in each mode and, in the
# default mode, with fixed tile options: which construction of the peer is strongest at the target points.
FLEX_VARIANT_POINTS = {"mha": (0.9, 0.95), "gqa": (0.9,)}
FLEX_KERNEL_OPTIONS = {"bm64_bn64": dict(BLOCK_M=64, BLOCK_N=64), "w4_s3": dict(num_warps=4, num_stages=3),
                       "bwd64": dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64),
                       "bwd32_64": dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32),
                       "bwd64_128": dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64)}


def flex_variant_fns(compiled: dict, batch: dict, bm, G: int) -> dict:
    """{name: (fwd, fwd+bwd)} of Flex in every compile mode of ``compiled`` and every FLEX_KERNEL_OPTIONS."""
    fns = {f"flex_{mode}": fair_flex_fns(flex, batch["al_heads"], bm, G) for mode, flex in compiled.items()}
    fns.update({f"flex_default_{name}": fair_flex_fns(compiled["default"], batch["al_heads"], bm, G, options)
                for name, options in FLEX_KERNEL_OPTIONS.items()})
    return fns


def flex_variants(args):
    """One JSON row per point of FLEX_VARIANT_POINTS of each --fair-heads configuration: fwd+bwd ms of ours
    (aligned) and of each Flex variant, timed in turns (``interleaved_ms``), and each one's time over ours. A
    variant that cannot run records its error (a tile option Flex cannot fit)."""
    compiled = {mode: compiled_flex(mode) for mode in FLEX_MODES}
    options = dataclasses.replace(args.options, precompile=False)
    for heads in args.fair_heads:
        sparsities = FLEX_VARIANT_POINTS[heads]
        Hq, Hkv = FAIR_HEADS[heads]
        batch = fair_batch(heads)
        q, k, v, do, docs, _ = batch["aligned"]
        for sp in sparsities:
            sel = select_blocks(q, k, docs, kept_fraction=1.0 - sp, block_size=B, options=options)
            fns = {"ours": sparse_fns(q, k, v, do, docs, sel, options)}
            fns.update(flex_variant_fns(compiled, batch, exact_block_mask(sel, Hq, batch["aligned_end"]), Hq // Hkv))
            timed = interleaved_ms(fns, args.rounds)
            ms = {n: round(t[1], 4) if isinstance(t, tuple) else f"error: {t!r:.200}" for n, t in timed.items()}
            log("FLEX_VARIANTS", json.dumps(dict(heads=f"{Hq}:{Hkv}", sparsity=sp, fwdbwd_ms=ms, over_ours={
                n: round(t / ms["ours"], 3) for n, t in ms.items() if isinstance(t, float)})))
        del batch
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- quick
def quick(args):
    """Short follow-up: bf16 correctness with the fused selection, selection cost, and our kernel's times at
    a few grid points (no Flex: compare with the full grid's Flex rows of the same GPU)."""
    quick_check(args.options)
    quick_points(args)
    packed_selection_match()
    selection_profile()
    kernel_info()


def quick_check(options: KernelOptions):
    """bf16 fwd and grads over the fused selection against the fp32 reference; the fused selection against
    the torch one."""
    torch.manual_seed(0)
    cu = cu_from_lens(CHECK_LENS)
    ok_all = True
    for hd in (64, 128):
        for bs in (64, 128):
            q, k, v = make_qkv(sum(CHECK_LENS), 8, 2, hd, torch.bfloat16, seed=hd + bs)
            sel_t = select_blocks(q, k, cu, block_size=bs, p=0.9, options=TORCH_SELECTION)
            try:
                sel = select_blocks(q, k, cu, block_size=bs, p=0.9)
                d1, d2 = sel.to_dense_mask(), sel_t.to_dense_mask()
                same = f"{int((d1 != d2).sum())} of {int(d2.sum())} blocks differ"
            except Exception as e:  # noqa: BLE001
                same = f"triton selection failed: {e!r:.300}"
                sel = sel_t
            errs, _ = against_reference(q, k, v, cu, sel, options, det=False)
            ok = errs[0] <= 1e-2 and max(errs[1:]) <= 2e-2
            ok_all &= ok
            log(json.dumps(dict(D=hd, B=bs, selection_vs_torch=same, rel_err_o_dq_dk_dv=[f"{e:.2e}" for e in errs],
                                ok=ok)))
    log("QUICK_CHECK", "PASS" if ok_all else "FAIL")


def quick_points(args):
    """Our kernel's times at a few grid points, with the selection's cost (fused, and torch at 32K / 0.9)."""
    with open(args.csv, "w", newline="") as out:
        emit = csv_emitter(out, GRID_FIELDS)
        for case, lens, sps in (("packed64k", long_tail_lengths(65536), (0.9, 0.95)), ("single", [8192], (0.9,)),
                                ("single", [32768], (0.0, 0.9))):
            for row in quick_case_rows(args.options, case, lens, sps):
                emit(row)


def quick_case_rows(options: KernelOptions, case: str, lens: list, sparsities):
    T = sum(lens)
    cu = cu_from_lens(lens)
    q, k, v = make_qkv(T, H, H, D, torch.bfloat16)
    do = torch.randn_like(q)
    lw = torch.tensor(lens, device="cuda", dtype=torch.float32) ** 2  # same weighting as the full grid
    for sp in sparsities:
        for mode in ("kept_fraction", "torch_select") if (T == 32768 and sp == 0.9) else ("kept_fraction",):
            select_opts = TORCH_SELECTION if mode == "torch_select" else KernelOptions()
            s_ms = bench(lambda: select_blocks(q, k, cu, kept_fraction=1 - sp, block_size=B, options=select_opts))
            sel = select_blocks(q, k, cu, kept_fraction=1 - sp, block_size=B)
            fwd = lambda: sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=options)  # noqa: E731
            f_ms = bench(fwd)
            fb_ms = bench(lambda: torch.autograd.grad(fwd(), (q, k, v), do))
            base = dict(case=case, T=T, ndocs=len(lens), sparsity=sp,
                        kept_fraction=round(float((sel.kept_fraction * lw).sum() / lw.sum()), 4), impl="triton_sparse")
            yield dict(timed_row(base, f_ms, fb_ms, 4 * D * sel.kept_block_pairs_tokens()),
                       error=f"select_ms[{'torch' if mode == 'torch_select' else 'triton'}]={s_ms:.3f} "
                             f"select/fwdbwd={s_ms / fb_ms:.3f}")


def packed_selection_match():
    """Fused (GPU) vs torch selection on the packed batch: same blocks, reverse lists and per-document stats."""
    lens = long_tail_lengths(65536)
    cu = cu_from_lens(lens)
    q, k, v = make_qkv(sum(lens), H, H, D, torch.bfloat16, grad=False)
    a = select_blocks(q, k, cu, kept_fraction=0.1, block_size=B, options=TORCH_SELECTION)
    b = select_blocks(q, k, cu, kept_fraction=0.1, block_size=B)
    nnz = int(a.k2q_ptr[-1])
    log("PACKED_SELECTION_MATCH", json.dumps(dict(
        cnt=torch.equal(a.q2k_cnt, b.q2k_cnt), k2q_ptr=torch.equal(a.k2q_ptr, b.k2q_ptr),
        k2q_idx=torch.equal(a.k2q_idx[:nnz], b.k2q_idx[:nnz]), k2q_end=torch.equal(a.k2q_end[:nnz], b.k2q_end[:nnz]),
        kept_fraction_maxdiff=float((a.kept_fraction - b.kept_fraction).abs().max()),
        coverage_maxdiff=float((a.coverage - b.coverage).abs().max()))))


def selection_profile():
    """Where the selection time goes at 32K / 0.9 (host launches vs device kernels)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        q, k, v = make_qkv(32768, H, H, D, torch.bfloat16, grad=False)
        cu = cu_from_lens([32768])
        for _ in range(3):
            select_blocks(q, k, cu, kept_fraction=0.1, block_size=B)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                select_blocks(q, k, cu, kept_fraction=0.1, block_size=B)
            torch.cuda.synchronize()
        log(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    except Exception as e:  # noqa: BLE001
        log("SELECT_PROFILE failed", repr(e)[:300])


def kernel_info():
    """Where the backward time goes at 32K / 0.9, and what the compiler made of each kernel."""
    try:
        L, scale = 32768, D ** -0.5
        q, k, v = make_qkv(L, H, H, D, torch.bfloat16, grad=False)
        sel = select_blocks(q, k, cu_from_lens([L]), kept_fraction=0.1, block_size=B)
        compiled = {}
        opts = KernelOptions(compiled=compiled)
        o, lse = forward.sparse_attn_fwd(q, k, v, sel, scale, opts)
        do = torch.randn_like(o)
        t_f = bench(lambda: forward.sparse_attn_fwd(q, k, v, sel, scale, opts))
        t_b = bench(lambda: backward.sparse_attn_bwd(do, q, k, v, o, lse, sel, scale, opts))
        info = {}
        for name, ck in compiled.items():
            try:
                ptx = ck.asm.get("ptx", "")
                info[name] = dict(regs=ck.n_regs, spills=ck.n_spills, cp_async=ptx.count("cp.async"),
                                  wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"))
            except Exception as e:  # noqa: BLE001
                info[name] = repr(e)[:100]
        log("KERNEL_INFO", json.dumps(info))
        log(f"KERNELS_32K_0.9 fwd_ms={t_f:.3f} bwd_ms={t_b:.3f}")
    except Exception as e:  # noqa: BLE001
        log("KERNEL_INFO failed", repr(e)[:300])


# ---------------------------------------------------------------------------------------------- table
def case_label(case: str, T: int, ndocs: int) -> str:
    return f"packed {T // 1024}K ({ndocs} documents)" if case.startswith("packed") else f"single {T // 1024}K"


def cell(ms: float, speedup: float) -> str:
    return "-" if math.isnan(ms) else f"{ms:.2f}" + ("" if math.isnan(speedup) else f" ({speedup:.2f}x)")


# the columns each table reads, of a grid CSV and of a --fair CSV (which has ``heads``)
TABLE_COLUMNS = {"grid": ("case", "T", "ndocs", "sparsity", "impl", "fwd_ms", "fwdbwd_ms", "speedup_vs_flex_fwdbwd",
                          "error"),
                 "fair": ("heads", "T", "ndocs", "padded_T", "sparsity", "impl", "fwdbwd_ms", "fwdbwd_tflops", "error")}
TABLE_INPUT = "allowed: a grid CSV (--bench --csv) or a --fair CSV of python -m benchmarks.attention"


def read_results(path: str):
    """The rows of a grid or --fair CSV; any other file is one ConfigError line naming it."""
    import pandas as pd

    try:
        df = pd.read_csv(path, dtype={"error": str})  # an all-empty column would read as float
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--table {path!r}: not a readable CSV ({str(exc).splitlines()[0]}); {TABLE_INPUT}") from None
    missing = [c for c in TABLE_COLUMNS["fair" if "heads" in df else "grid"] if c not in df]
    if missing:
        raise ConfigError(f"--table {path!r}: no column {missing[0]!r}; {TABLE_INPUT}")
    if df.empty:
        raise ConfigError(f"--table {path!r}: a header without rows; {TABLE_INPUT}")
    return df


def results_table(path: str) -> str:
    """Markdown of a grid CSV (of a --fair CSV: :func:`fair_table`): our fwd+bwd ms and FlexAttention's time over ours per case and sparsity (by
    ``do_bench``, and by CUDA-graph replay where the grid has it), the dense point against cuDNN, and the
    selection's cost."""
    df = read_results(path)
    if "heads" in df:
        return fair_table(df)
    ours, cudnn = df[df.impl == "triton_sparse"], df[df.impl == "cudnn_dense"].set_index("T")
    sparsities = sorted(ours.sparsity.unique())
    lines = ["| fwd+bwd ms (FlexAttention's time / ours) | " + " | ".join(f"sparsity {s:g}" for s in sparsities)
             + " | dense: cuDNN's time / ours |", "| --- " * (len(sparsities) + 2) + "|"]
    timings = (("", "fwdbwd_ms", "speedup_vs_flex_fwdbwd"),
               (", CUDA graph", "fwdbwd_graph_ms", "speedup_vs_flex_fwdbwd_graph"))
    for (case, T, ndocs), g in ours.groupby(["case", "T", "ndocs"], sort=False):
        g = g.set_index("sparsity")
        for suffix, ms, speedup in timings:
            if ms not in g or g[ms].isna().all():
                continue
            cells = [cell(g[ms].get(s, float("nan")), g[speedup].get(s, float("nan"))) for s in sparsities]
            dense = (f"{cudnn.loc[T, ms] / g.loc[0.0, ms]:.2f}x" if T in cudnn.index and 0.0 in g.index
                     and not math.isnan(cudnn.loc[T, ms]) else "-")
            lines.append(f"| {case_label(case, T, ndocs)}{suffix} | " + " | ".join(cells) + f" | {dense} |")
    return "\n".join(lines + selection_lines(df)) + "\n"


FAIR_COLUMNS = (("flex_token_mask", "Flex, token-level document mask"), ("flex_padded", "Flex, documents padded"),
                ("flex_exact", "Flex, aligned, exact blocks"), ("flex_flash_exact", "Flex FLASH, aligned, exact blocks"),
                ("cudnn_per_document_dense", "cuDNN dense, a call per document"))


def fair_table(df) -> str:
    """Markdown of a --fair CSV: per head configuration and sparsity, our fwd+bwd ms and effective TFLOP/s on
    the unaligned and the aligned batch, and each other implementation's ms with its time over ours (above 1:
    ours is faster) against ours on the batch it starts from (FAIR_PAIRS); then why any is absent."""
    ours_of = {theirs: ours for theirs, ours in FAIR_PAIRS}
    lines = ["| heads | sparsity | ours, unaligned: ms (TFLOP/s) | ours, aligned: ms (TFLOP/s) | "
             + " | ".join(title for _, title in FAIR_COLUMNS) + " |", "| --- " * (4 + len(FAIR_COLUMNS)) + "|"]
    timed = df[df.fwdbwd_ms.notna()]
    for (heads, sp), g in timed.groupby(["heads", "sparsity"], sort=False):
        g = g.set_index("impl")

        def ours(impl):
            return f"{g.fwdbwd_ms[impl]:.2f} ({g.fwdbwd_tflops[impl]:.0f})" if impl in g.index else "-"

        cells = [f"{g.fwdbwd_ms[i]:.2f} ({g.fwdbwd_ms[i] / g.fwdbwd_ms[ours_of[i]]:.2f}x)"
                 if i in g.index and ours_of[i] in g.index else "-" for i, _ in FAIR_COLUMNS]
        lines.append(f"| {heads} | {sp:g} | {ours('triton_sparse')} | {ours('triton_sparse_aligned')} | "
                     + " | ".join(cells) + " |")
    absent = df[df.error.fillna("").str.startswith("absent")].drop_duplicates("impl")
    notes = [f"* {dict(FAIR_COLUMNS).get(r.impl, r.impl)}: {r.error}" for r in absent.itertuples()]
    padded = df[df.impl == "flex_padded"].dropna(subset=["padded_T"]).head(1)
    notes += [f"* padded batch: {int(r.padded_T)} tokens for {int(r.T)} ({r.padded_T / r.T - 1:.1%} more), "
              f"{int(r.ndocs)} documents" for r in padded.itertuples()]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def selection_lines(df) -> list[str]:
    """One line per selection mode: its time and its share of fwd+bwd over the grid's selection rows."""
    sel = df[df.case.str.startswith("selection")]
    out = []
    for impl, g in sel.groupby("impl", sort=False):
        share = g.error.str.extract(r"select/attn_fwdbwd=([0-9.]+)", expand=False).astype(float) * 100
        T = int(g["T"].iloc[0])
        out.append(f"* selection ({impl[len('select['):-1]}) at {T // 1024}K tokens: {g.fwd_ms.min():.2f}-"
                   f"{g.fwd_ms.max():.2f} ms, {share.min():.1f}-{share.max():.1f}% of the fwd+bwd over it "
                   f"({len(g)} samples)")
    return [""] + out if out else []


# ---------------------------------------------------------------------------------------------- CLI
def int_at_least(minimum: int, what: str):
    """An argparse type: one integer >= ``minimum`` (``what`` names it in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what} (an integer >= {minimum})")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m benchmarks.attention")
    ap.add_argument("--table", metavar="GRID_CSV", default=None,
                    help="print the markdown results table of a grid CSV and exit (no GPU needed)")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--fair", action="store_true",
                    help="the fair comparison on a packed 64K batch, MHA and GQA 32:4: FlexAttention on the token-level "
                         "document mask, on whole-block (aligned) documents with exactly our kept blocks, on padded "
                         "documents, its FLASH backend, cuDNN dense (the README's table: --table of its CSV)")
    ap.add_argument("--fair-heads", type=number_list(str, lambda x: x in FAIR_HEADS, ", ".join(FAIR_HEADS)),
                    default=",".join(FAIR_HEADS),
                    help="--fair's head configurations, in this order (to split the grid over calls)")
    ap.add_argument("--quick", action="store_true", help="short follow-up check + a few of our grid points")
    ap.add_argument("--short-vs-long", action="store_true", help="short- vs long-row configs, MHA and GQA")
    ap.add_argument("--kernels", action="store_true",
                    help="each kernel alone on the fair batch at --sparsities and with only the diagonal blocks kept "
                         "(--fair-heads' head configurations): where the time goes; beside each kernel's <kind>_ms "
                         "its HBM floor <kind>_floor_ms (each operand read and written once, at a measured copy "
                         "bandwidth), their sums sum_ms and floor_sum_ms, and the effective fwd+bwd TFLOP/s of "
                         "each: tflops and floor_tflops")
    ap.add_argument("--selection", action="store_true", help="selection cost vs fwd+bwd at 8K/32K/128K, 3 repeats")
    ap.add_argument("--flex-mode", choices=FLEX_MODES, default=FLEX_MODES[0],
                    help="how FlexAttention is compiled in the grid and --fair (default: max-autotune-no-cudagraphs, "
                         "its fastest construction measured; 'default' compiles in seconds instead of minutes; "
                         "max-autotune-coordinate-descent is torchtitan's)")
    ap.add_argument("--flex-variants", action="store_true",
                    help="Flex in each --flex-mode and with fixed tile options against ours on the fair batch at "
                         "MHA 0.9 / 0.95 and GQA 0.9 (--rounds; --fair-heads to split it over calls): which "
                         "construction of the peer is strongest")
    ap.add_argument("--apply-tuned", action="store_true", help="--tune's winners for the other modes")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--check-csv", default=None, help="--check's CSV when --csv is the grid's")
    ap.add_argument("--config", default=None,
                    help="json {kind: [BM, BN, warps, stages, head_outer, tma, ws, maxnreg]} for block 128, D 128 (a "
                         "shorter list leaves the rest at the defaults)")
    ap.add_argument("--lengths", type=number_list(int, lambda x: x > 0, "positive token counts"),
                    default="8192,32768,131072")
    ap.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True,
                    help="include the packed 64K micro-batch (--no-packed: single sequences only, e.g. to split the "
                         "grid over calls)")
    ap.add_argument("--sparsities", type=number_list(float, lambda x: 0 <= x < 1, "sparsities in [0, 1)"),
                    default="0,0.5,0.75,0.9,0.95")
    ap.add_argument("--flex-dense-max", type=int, default=1 << 30)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip the remaining grid after this")
    ap.add_argument("--rounds", type=int_at_least(1, "a round count"), default=1,
                    help="time each grid point this many times, the implementations taking turns; report medians")
    ap.add_argument("--graph-max-tokens", type=int_at_least(0, "a token count"), default=0,
                    help="also time fwd and fwd+bwd replayed from CUDA graphs (GPU time without the host's launch "
                         "overhead) at grid points of at most this many tokens (0: none)")
    args = ap.parse_args(argv)
    if args.table is not None:
        if not os.path.isfile(args.table):
            ap.error(f"--table {args.table!r}: no such file (a grid CSV of this benchmark)")
        return args
    if not torch.cuda.is_available():
        ap.error("no CUDA GPU here: this benchmark times the kernels, FlexAttention and cuDNN on one (the CPU "
                 "correctness tests are `python -m pytest tests/kernels`)")
    args.tune_cands = {k: [tuple(c) for c in v] for k, v in TUNE_CANDS.items()}
    configs = json.loads(args.config) if args.config else {}
    args.options = tiles_option({kind: dict(zip(CONFIG_KEYS, c)) for kind, c in configs.items() if c})
    return args


@one_line_errors
def main(argv=None):
    args = parse_args(argv)
    if args.table is not None:
        print(results_table(args.table), end="")
        return
    if args.tune:
        best = tune(args)
        if args.apply_tuned:
            args.options = tiles_option(best)
    if args.check:
        check(argparse.Namespace(**{**vars(args), "csv": args.check_csv or args.csv}))
    if args.short_vs_long:
        short_vs_long(args)
    if args.kernels:
        kernel_breakdown(args)
    if args.flex_variants:
        flex_variants(args)
    if args.selection:
        selection_cost(lambda row: log(json.dumps(row)), args.options, lengths=(8192, 32768, 131072), repeats=3)
    if args.quick:
        args.csv = args.csv or "attention_quick.csv"
        quick(args)
    if args.fair:
        args.csv = args.csv or "attention_fair.csv"
        run_fair(args)
    if args.bench or not (args.check or args.tune or args.quick or args.selection or args.short_vs_long
                          or args.fair or args.kernels or args.flex_variants):
        if args.csv is None:
            args.csv = "attention_bench.csv"
        run_bench(args)


if __name__ == "__main__":
    main()
