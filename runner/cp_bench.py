"""``python -m runner.cp_bench [--lengths ...] [--cp ...] [--p ...] [--kept ...] [overrides]``: one CP rank's
attention on one device against what ``sim.cost`` predicts for that rank's attention.

For one sequence of each length, CP degree and budget (top-p, or a fixed kept fraction), the whole sequence's
selection comes from the kernel (``select_blocks``), and CP rank 0's work of one layer runs on the local
device, forward then backward, in both of the runner's CP attentions: the default (``runner.cp_kernel``:
the kernel over the whole sequence with rank 0's queries in place and the selection cut to its rows;
``kernel_fwd_ms`` / ``kernel_bwd_ms``) and the reference ring of PyTorch pieces (``runner.cp.attention_piece``
over every rank's K/V shard and the log-sum-exp merge; ``fwd_ms`` / ``bwd_ms``). The ring's transfers are
not run: this times the compute that the simulator prices as ``attn_fwd`` / ``attn_bwd`` per layer and CP
rank (``micro_batch_cost(..., Layout(dp=1, cp=cp)).attn_*_ms / layers``). The kernel's whole-sequence
forward and backward (cp = 1) is timed beside them. Timing: CUDA events on the GPU, the host clock on the
CPU, the median of ``--repeats`` after one warm-up.

Beside the times, each rank's share of the selection's kept work (key blocks x query tokens, averaged over KV
heads) as the kernel's selection puts it on the zigzag shards, against ``sim.cp_shards``'s model of it
(``slowest_share`` / ``predicted_slowest_share``: the most loaded rank's, which the cost model prices; both
include the shards' block rounding, which the cost model leaves in its dense price).

Writes ``--out`` (CSV): length, cp, budget, kept fraction, both attentions' measured and the predicted forward
and backward ms, their ratios, the kernel's whole-sequence times and the kept-work shares. Overrides are ``sim.run``'s
config (model, cost, block size).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import pandas as pd
import torch
from omegaconf import OmegaConf

from sparsebalance.kernels.sparse_attention import select_blocks, sparse_attention
from sparsebalance.runner.cp import Shards, attention_piece, merge_pieces
from sparsebalance.runner.cp_kernel import own_rows
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.core import ConfigError, fail
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.cp_shards import kept_share_shift
from sparsebalance.sim.setup import prepare


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median ms of ``fn()`` after one untimed call (Triton compiles there)."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def rank_masks(sel, shards: Shards, block_size: int, device) -> list[torch.Tensor]:
    """CP rank 0's ``[Hkv, t_q, t_k]`` masks over every rank's shard of a one-sequence micro-batch."""
    dense = sel.to_dense_mask()  # [Hkv, NB, NB]
    geo = shards.geometry(block_size, device)
    qpos, qblk = geo.positions[0][0], geo.blocks[0][0]
    masks = []
    for source in range(shards.cp):
        kpos, kblk = geo.positions[source][0], geo.blocks[source][0]
        masks.append(dense[:, qblk][:, :, kblk] & (kpos[None, :] <= qpos[:, None])[None])
    return masks


def rank_shares(per_row: torch.Tensor, shards: Shards, block_size: int) -> list[float]:
    """Each CP rank's share of a one-sequence selection's work: every query token does its block row's
    ``per_row`` key blocks."""
    work = [float(per_row[shards.positions(r) // block_size].sum()) for r in range(shards.cp)]
    return [w / sum(work) for w in work]


def shares(sel, shards: Shards, block_size: int, length: int) -> tuple[list[float], list[float]]:
    """``(measured, modelled)`` kept-work shares per rank: the selection's (mean over KV heads) and
    ``sim.cp_shards``'s, the latter being the dense selection's share plus the modelled shift (the cost model
    prices the dense share as 1/cp; the shift is what it adds for the selection)."""
    measured = rank_shares(sel.q2k_cnt.double().mean(0).cpu(), shards, block_size)
    dense = rank_shares(torch.arange(1, sel.q2k_cnt.shape[1] + 1, dtype=torch.float64), shards, block_size)
    shift = kept_share_shift([length], [float(sel.kept_fraction[0])], shards.cp, block_size)[:, 0]
    return measured, [d + x for d, x in zip(dense, shift.tolist(), strict=True)]


def time_kernel_rank(q, k, v, cu, sel, shards: Shards, device, repeats: int) -> tuple[float, float]:
    """CP rank 0's attention as ``runner.cp_kernel`` computes it once the keys are gathered: the kernel over the
    whole sequence with rank 0's queries in place and the selection cut to its rows (forward, backward ms)."""
    mine = shards.mine.to(device)
    restricted = own_rows(sel, mine)
    placed = torch.zeros_like(q).index_copy(0, mine, q[mine]).requires_grad_()
    kk, vv = (x.detach().requires_grad_() for x in (k, v))
    grad = torch.zeros_like(q).index_copy(0, mine, torch.randn_like(q[mine]))

    def forward():
        return sparse_attention(placed, kk, vv, cu, selection=restricted)

    fwd = timed(forward, device, repeats)
    return fwd, timed(lambda: torch.autograd.backward(forward(), grad), device, repeats) - fwd


def measure(length: int, cp: int, budget: dict, shape, block_size: int, device, dtype, repeats: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(length)
    q = torch.randn(length, shape.heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(length, shape.kv_heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
            for _ in range(2))
    cu = torch.tensor([0, length], dtype=torch.int32)
    sel = select_blocks(q, k, cu, block_size=block_size, **{m: torch.tensor([v]) for m, v in budget.items()})
    shards = Shards.build(cu, cp, 0)
    masks = rank_masks(sel, shards, block_size, device)
    mine = shards.mine.to(device)
    ql = q[mine].detach().requires_grad_()
    kv = [(k[s.to(device)].detach().requires_grad_(), v[s.to(device)].detach().requires_grad_()) for s in shards.index]
    scale = shape.head_dim ** -0.5
    grad = torch.randn_like(ql)

    def forward():
        pieces = [attention_piece(ql, kk, vv, m, scale) for (kk, vv), m in zip(kv, masks, strict=True)]
        return merge_pieces([o for o, _ in pieces], [lse for _, lse in pieces]).to(dtype)

    def backward():
        out = forward()
        torch.autograd.backward(out, grad)

    fwd = timed(forward, device, repeats)
    bwd = timed(backward, device, repeats) - fwd
    qw, kw, vw = (x.detach().requires_grad_() for x in (q, k, v))
    whole_grad = torch.randn_like(qw)

    def whole_forward():
        return sparse_attention(qw, kw, vw, cu, selection=sel)

    whole_fwd = timed(whole_forward, device, repeats)
    whole_bwd = timed(lambda: torch.autograd.backward(whole_forward(), whole_grad), device, repeats) - whole_fwd
    kernel_fwd, kernel_bwd = time_kernel_rank(q, k, v, cu, sel, shards, device, repeats)
    kept = float(sel.kept_fraction[0])
    measured, model = shares(sel, shards, block_size, length)
    return {"length": length, "cp": cp, "p": budget.get("p", float("nan")),
            "kept_fraction_budget": budget.get("kept_fraction", float("nan")), "kept_fraction": kept,
            "fwd_ms": fwd, "bwd_ms": bwd, "kernel_fwd_ms": kernel_fwd, "kernel_bwd_ms": kernel_bwd,
            "whole_kernel_fwd_ms": whole_fwd, "whole_kernel_bwd_ms": whole_bwd,
            "rank0_share": measured[0], "predicted_rank0_share": model[0],
            "slowest_share": max(measured), "predicted_slowest_share": max(model)}


def predicted(cost, row: dict, layers: int) -> dict:
    """``sim.cost``'s attention ms of one layer on one CP rank, at the kernel's kept fraction."""
    mb = cost.micro_batch_cost([row["length"]], [row["kept_fraction"]], Layout(dp=1, cp=row["cp"]))
    return {"predicted_fwd_ms": mb.attn_fwd_ms / layers, "predicted_bwd_ms": mb.attn_bwd_ms / layers}


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--cp", default="2,4")
    parser.add_argument("--p", default="1.0,0.9", help="top-p budgets")
    parser.add_argument("--kept", default="0.1", help="fixed kept-fraction budgets ('' for none)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--out", default="cp_bench.csv")
    return parser.parse_known_args(argv)


def budgets(args) -> list[dict]:
    """The selection budgets to run: every ``--p`` (top-p), then every ``--kept`` (top-k by kept fraction)."""
    return ([{"p": float(x)} for x in args.p.split(",") if x]
            + [{"kept_fraction": float(x)} for x in args.kept.split(",") if x])


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        setup = prepare(OmegaConf.to_object(compose_config(overrides)))
    except ConfigError as exc:
        fail(str(exc).splitlines()[0])
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if name == "auto" else name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cost, shape = setup.cost, setup.cost.model
    rows = []
    for length in map(int, args.lengths.split(",")):
        for cp in map(int, args.cp.split(",")):
            for budget in budgets(args):
                row = measure(length, cp, budget, shape, cost.block_size, device, dtype, args.repeats)
                row.update(predicted(cost, row, shape.layers))
                for kind in ("", "kernel_"):
                    for pass_ in ("fwd", "bwd"):
                        row[f"{kind}{pass_}_ratio"] = row[f"{kind}{pass_}_ms"] / row[f"predicted_{pass_}_ms"]
                print(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
                rows.append(row)
    pd.DataFrame(rows).to_csv(args.out, index=False, float_format="%.6g")
    return 0


if __name__ == "__main__":
    sys.exit(main())
