"""``--check``: bf16 / fp16 forward and gradients against the fp32 reference, and bitwise determinism of the
backward."""
from __future__ import annotations

import dataclasses
import json
import math

import torch

from sparsebalance.kernels.sparse_attention import (KernelOptions, select_blocks, sparse_attention,
                                                    sparse_attention_naive)
from .common import cu_from_lens, log, make_qkv, write_csv


def rel_errors(outs, refs) -> list[float]:
    """Max abs error over max abs reference, per tensor (inf where not finite)."""
    errs = []
    for a, b in zip(outs, refs, strict=True):
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
        same = all(torch.equal(a, b) for a, b in zip(g, g2, strict=True))
    qf, kf, vf = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = sparse_attention_naive(qf, kf, vf, cu, sel)
    gr = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    return rel_errors((o, *g), (ref, *gr)), same
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
                    errs = dict(zip(("o", "dq", "dk", "dv"), errs, strict=True))
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
