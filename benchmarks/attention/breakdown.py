"""``--kernels``: each kernel alone on the fair batch, beside its HBM floor."""
from __future__ import annotations

import dataclasses
import json

import torch

from sparsebalance.kernels.sparse_attention import select_blocks
from .common import B, D, bench, cu_from_lens, fwdbwd_tflops, kept_fwd_flops, log, make_qkv
from .fair import FAIR_HEADS, fair_lengths
from .tune import kernel_launchers


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
