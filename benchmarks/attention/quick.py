"""``--quick``: a short follow-up: bf16 correctness with the fused selection, the selection's cost, and our
kernel's times at a few grid points."""
from __future__ import annotations

import json
from functools import partial

import torch

from sparsebalance.kernels.sparse_attention import KernelOptions, backward, forward, select_blocks
from .check import CHECK_LENS, against_reference
from .common import (B, D, H, TORCH_SELECTION, bench, csv_emitter, cu_from_lens, kept_fwd_flops, log,
                     long_tail_lengths, make_qkv, sparse_pair, timed_row, weighted_kept_fraction)
from .grid import GRID_FIELDS


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
    for sp in sparsities:
        for mode in ("kept_fraction", "torch_select") if (T == 32768 and sp == 0.9) else ("kept_fraction",):
            select_opts = TORCH_SELECTION if mode == "torch_select" else KernelOptions()
            s_ms = bench(partial(select_blocks, q, k, cu, kept_fraction=1 - sp, block_size=B, options=select_opts))
            sel = select_blocks(q, k, cu, kept_fraction=1 - sp, block_size=B)
            fwd, fwdbwd = sparse_pair(q, k, v, do, cu, sel, options)
            f_ms = bench(fwd)
            fb_ms = bench(fwdbwd)
            base = dict(case=case, T=T, ndocs=len(lens), sparsity=sp, kept_fraction=weighted_kept_fraction(sel, lens),
                        impl="triton_sparse")
            yield dict(timed_row(base, f_ms, fb_ms, kept_fwd_flops(sel, H)),
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
