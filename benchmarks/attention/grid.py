"""The benchmark grid (``--bench``, the default): single sequences and a packed batch, our kernel against
FlexAttention on the same selection and cuDNN dense, and the selection's cost."""
from __future__ import annotations

import json
from functools import partial
import time
import traceback

import torch

from sparsebalance.kernels.sparse_attention import KernelOptions, select_blocks, sparse_attention
from .common import (B, D, H, bench, compiled_flex, csv_emitter, cu_from_lens, flex_pair, graph_times, heads_first,
                     interleaved_ms, kept_fwd_flops, log, long_tail_lengths, make_qkv, sparse_pair, timed_row,
                     weighted_kept_fraction)
from .masks import flex_block_mask_packed, flex_block_mask_single


GRID_FIELDS = ["case", "T", "ndocs", "sparsity", "kept_fraction", "impl", "fwd_ms", "fwdbwd_ms", "fwd_tflops",
               "fwdbwd_tflops", "speedup_vs_flex_fwdbwd", "error"]
GRAPH_FIELDS = ["fwd_graph_ms", "fwdbwd_graph_ms", "speedup_vs_flex_fwdbwd_graph"]


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
                    s_ms = bench(partial(select_blocks, q, k, c, block_size=B, **kw))
                    sel = select_blocks(q, k, cu, block_size=B, **kw)
                    fb_ms = bench(lambda q=q, k=k, v=v, cu=cu, sel=sel, do=do: torch.autograd.grad(
                        sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=options), (q, k, v),
                        do))
                    emit(dict(case=f"selection_{L // 1024}k", T=L, ndocs=1,
                              sparsity=round(1 - float(sel.kept_fraction[0]), 4),
                              kept_fraction=round(float(sel.kept_fraction[0]), 4), impl=f"select[{mode}]",
                              fwd_ms=round(s_ms, 4), fwdbwd_ms=round(fb_ms, 4),
                              error=f"select/attn_fwdbwd={s_ms / fb_ms:.3f}"))
        except Exception as e:  # noqa: BLE001
            emit(dict(case=f"selection_{L // 1024}k", impl="select", error=repr(e)[:300]))


def grid_cases(lengths, packed: bool) -> list:
    """(case, document lengths) of the grid: the packed 64K micro-batch (unless ``packed`` is false), then one
    single sequence per length."""
    return ([("packed64k", long_tail_lengths(65536))] if packed else []) + [("single", [L]) for L in lengths]


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
    heads = heads_first(q, k, v, do)  # FlexAttention and cuDNN take these
    if case == "single":
        emit(cudnn_row(args, case, lens, heads))
    for sp in args.sparsities:
        if time.time() - t_start > args.deadline_s:
            emit(dict(case=case, T=T, ndocs=len(lens), sparsity=sp, impl="all", error="skipped: --deadline-s reached"))
            continue
        bench_point(args, emit, flex, case, lens, sp, (q, k, v, do), heads)


def cudnn_row(args, case: str, lens: list, heads: list) -> dict:
    """cuDNN dense causal attention on one sequence (the dense reference)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qb, kb, vb, dob = heads
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


def flex_fns(args, emit, flex, case: str, sel, base: dict, heads) -> tuple | None:
    """FlexAttention's (fwd, fwd+bwd) over the selection's BlockMask, and a note of the mask's build time;
    None where it is skipped (dense single sequences above --flex-dense-max) or the mask fails (its row
    emitted)."""
    T = base["T"]
    if case == "single" and base["sparsity"] == 0.0 and T > args.flex_dense_max:
        emit(dict(base, impl="flex", error=f"skipped: dense flex at T={T} > --flex-dense-max"))
        return None
    try:
        t0 = time.time()
        bm = (flex_block_mask_single(sel, H, T, B) if case == "single"
              else flex_block_mask_packed(sel, H, T, B))
        note = f"block_mask_build_s={time.time() - t0:.2f}"
        return flex_pair(flex, heads, bm, 1), note
    except Exception as e:  # noqa: BLE001
        emit(dict(base, impl="flex", error=repr(e)[:300]))
        traceback.print_exc()
        return None


def bench_point(args, emit, flex, case: str, lens: list, sp: float, tensors, heads):
    """Our kernel and FlexAttention at one sparsity of one case, timed in turns; their rows."""
    q, k, v, do = tensors
    T = sum(lens)
    cu = cu_from_lens(lens)
    try:
        sel = select_blocks(q, k, cu, kept_fraction=1.0 - sp, block_size=B)
        flops = kept_fwd_flops(sel, H)
        kept = weighted_kept_fraction(sel, lens)
    except Exception as e:  # noqa: BLE001
        emit(dict(case=case, T=T, ndocs=len(lens), sparsity=sp, impl="select", error=repr(e)[:300]))
        return
    base = dict(case=case, T=T, ndocs=len(lens), sparsity=sp, kept_fraction=kept)
    fns = {"triton_sparse": sparse_pair(q, k, v, do, cu, sel, args.options)}
    fwd = fns["triton_sparse"][0]
    flex_timed = flex_fns(args, emit, flex, case, sel, base, heads)
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
