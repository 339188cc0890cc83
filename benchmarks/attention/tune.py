"""``--tune`` and ``--short-vs-long``: launch configs timed per kernel, each kernel launched alone."""
from __future__ import annotations

import json
import math
from functools import partial

import torch

from sparsebalance.kernels.sparse_attention import KernelOptions, backward, forward, launch, select_blocks
from .common import B, D, H, bench, cu_from_lens, log, long_tail_lengths, make_qkv


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
        best[kind] = dict(zip(CONFIG_KEYS, scored[0][1], strict=False))
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
            opts = KernelOptions(tiles={(B, D): {kind: dict(zip(CONFIG_KEYS, cand, strict=False))}}, compiled=compiled)
            try:
                ms = bench(partial(launchers[base], opts))
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
            row[f"fwd_{name}"] = round(bench(partial(forward.sparse_attn_fwd, q, k, v, sel, scale, opts)), 4)
            row[f"bwd_{name}"] = round(bench(partial(backward.sparse_attn_bwd, do, q, k, v, o, lse, sel, scale, opts)),
                                       4)
        log("SHORT_VS_LONG", json.dumps(row))
