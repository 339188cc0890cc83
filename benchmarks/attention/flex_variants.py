"""``--flex-variants``: Flex on the fair batch's aligned documents with exactly our kept blocks, compiled in
each mode and, in the default mode, with fixed tile options: which construction of the peer is strongest at
the target points."""
from __future__ import annotations

import dataclasses
import json

import torch

from sparsebalance.kernels.backends.flash_sparse import selection_block_mask
from sparsebalance.kernels.sparse_attention import select_blocks
from .common import B, FLEX_MODES, compiled_flex, flex_pair, interleaved_ms, log, sparse_pair
from .fair import FAIR_HEADS, fair_batch


FLEX_VARIANT_POINTS = {"mha": (0.9, 0.95), "gqa": (0.9,)}
FLEX_KERNEL_OPTIONS = {"bm64_bn64": dict(BLOCK_M=64, BLOCK_N=64), "w4_s3": dict(num_warps=4, num_stages=3),
                       "bwd64": dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64),
                       "bwd32_64": dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32),
                       "bwd64_128": dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64)}


def flex_variant_fns(compiled: dict, batch: dict, bm, G: int) -> dict:
    """{name: (fwd, fwd+bwd)} of Flex in every compile mode of ``compiled`` and every FLEX_KERNEL_OPTIONS."""
    fns = {f"flex_{mode}": flex_pair(flex, batch["al_heads"], bm, G) for mode, flex in compiled.items()}
    fns.update({f"flex_default_{name}": flex_pair(compiled["default"], batch["al_heads"], bm, G, options)
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
            fns = {"ours": sparse_pair(q, k, v, do, docs, sel, options)}
            mask = selection_block_mask(sel, Hq, batch["aligned_end"])
            fns.update(flex_variant_fns(compiled, batch, mask, Hq // Hkv))
            timed = interleaved_ms(fns, args.rounds)
            ms = {n: round(t[1], 4) if isinstance(t, tuple) else f"error: {t!r:.200}" for n, t in timed.items()}
            log("FLEX_VARIANTS", json.dumps(dict(heads=f"{Hq}:{Hkv}", sparsity=sp, fwdbwd_ms=ms, over_ours={
                n: round(t / ms["ours"], 3) for n, t in ms.items() if isinstance(t, float)})))
        del batch
        torch.cuda.empty_cache()
