"""Launch rules of the attention kernels: tile tables, when TMA descriptors are used, when the backward
overlaps its two kernels, and the host helpers every launcher shares."""
from __future__ import annotations

import functools
import os
import threading

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError
from triton.tools.tensor_descriptor import TensorDescriptor

from .options import KernelOptions

LOG2E = 1.4426950408889634

# Tunables per kernel kind: tiles, warps, stages and grid order, chosen by ``python -m benchmarks.attention
# --tune`` on an H200 at block 128, D 128. Each kernel has a long-row and a short-row config: large tiles
# amortise their setup and halve K/V re-reads on long rows (which matters once K/V outgrow L2, e.g. 128K
# tokens), small 4-warp tiles (twice the programs, more per SM) win when every row is short, as in packed
# batches of short documents or at high sparsity on 8K tokens.
# HEAD_OUTER puts the head on grid axis 1, so the programs running together share one head's K/V (axis 0 =
# head otherwise). dK/dV takes 64-key tiles with 4 warps and 2 stages for long rows as well: computed
# query-major (see backward._dkdv_tile) they compile without spills and pipeline, which beats 128-key tiles
# with 8 warps (key-major, unpipelined, spilling) by 4-13%.
# TMA: the forward and dQ load their K/V tiles, dK/dV its Q/dO tiles, through tensor descriptors (1.01-1.16x
# per kernel on an H200); the long-row forward's loop is also warp-specialised (WS), which gains only with
# TMA and gives dQ nothing.
# FALLBACK_STAGES: the stages where TMA is asked for but cannot run (pointer tiles): those tuned for pointer
# tiles (2-stage pointer-tile dQ spills).
# Short rows at high sparsity: most programs hold the diagonal block alone (60% of the rows of a packed 64K
# batch at sparsity 0.9), so a launch is bound by memory traffic and latency, not by matmul rate (a batch of
# diagonal blocks alone runs at 1.2-2x the time of reading each operand once: `benchmarks.attention --kernels`),
# and the more programs an SM keeps in flight, the more of that latency they hide. The short-row forward and dQ
# therefore take 32-key sub-tiles (half the K/V stage memory), and the forward a cap of 128 registers (maxnreg,
# with TMA tiles: no spills), so that more programs share an SM.
# GQA_HEAD_OUTER replaces HEAD_OUTER where query heads share K/V (GQA): with the head on axis 0, the programs
# of one row's heads run together and a group's programs read the same K/V tiles from L2.
DEFAULT_CONFIG = {
    "fwd": dict(BM=128, BN=128, num_warps=8, num_stages=2, HEAD_OUTER=True, TMA=True, WS=True, FALLBACK_STAGES=3),
    "fwd_short": dict(BM=64, BN=32, num_warps=4, num_stages=2, HEAD_OUTER=True, GQA_HEAD_OUTER=False, TMA=True,
                      WS=False, FALLBACK_STAGES=3, maxnreg=128),
    "dq": dict(BM=128, BN=128, num_warps=8, num_stages=2, HEAD_OUTER=True, TMA=True, FALLBACK_STAGES=3),
    "dq_short": dict(BM=64, BN=32, num_warps=4, num_stages=2, HEAD_OUTER=True, GQA_HEAD_OUTER=False, TMA=True,
                     FALLBACK_STAGES=3),
    "dkdv": dict(BN=64, BM=64, num_warps=4, num_stages=2, HEAD_OUTER=True, TMA=True),
    "dkdv_short": dict(BN=64, BM=64, num_warps=4, num_stages=2, HEAD_OUTER=True, TMA=True),
}
SHORT_ROW_TOKENS = 2048  # a selection whose longest row keeps fewer key tokens than this is "short"

# TMA costs host time on every launch: two TensorDescriptor objects here, and in Triton's launcher a CUtensorMap
# encoded per descriptor and the argument list re-packed in Python, about a third of the host path at 8K
# tokens / kept 0.05. Below this many kept (query, key) token pairs the GPU time TMA saves is a few
# microseconds (at 8K, H=16, D=128: pointer tiles cost 1-3.5% more GPU time at 3e7-6e7 pairs but cut the
# host-bound fwd+bwd by 0.2 ms; at 1.4e8 and more they cost 6-8%, which a GPU-bound training step would pay),
# so such launches take pointer tiles.
TMA_MIN_PAIRS = 1 << 27

# dQ runs on a side stream alongside dK/dV where dK/dV has few programs per SM: there the two kernels' last
# waves overlap. The backward gains 2-6%, and 19-28% where dK/dV has fewer programs than the GPU has slots
# (GQA 32:4 or 16:2 at 2K-8K tokens, 1-4 programs per SM, H100), however little is kept; 32K GQA 32:4 at kept
# 0.1 (15.5 per SM) still gains 1-2%, 8K MHA at kept 0.1 (15.5) is even (+0.8% H100, -1% H200, host-bound).
# With more programs the delta pre-pass it needs (one more read of O and dO) costs more than the overlap
# saves: 3% on packed 64K MHA at kept 0.1 (124 programs per SM), 1-9% on packed 64K GQA 32:4 at kept 0.5-0.05
# (31 per SM, H100), and at ~60 per SM (32K MHA) the gain is noise.
OVERLAP_MAX_PROGRAMS_PER_SM = 16


def get_config(kind: str, block: int, D: int, row_blocks: int | None = None,
               options: KernelOptions | None = None, group: int = 1) -> dict:
    """Launch config of one kernel kind ("fwd", "dq", "dkdv"); ``row_blocks`` (the most KV blocks any query
    row keeps) picks the short-row config; ``options.tiles`` overrides it (see :class:`KernelOptions`);
    ``group`` (query heads per KV head) above 1 takes its ``GQA_HEAD_OUTER`` where it has one."""
    short = row_blocks is not None and row_blocks * block < SHORT_ROW_TOKENS
    cfg = dict(DEFAULT_CONFIG[kind + "_short" if short else kind])
    over = options.tile_overrides(block, D) if options is not None else {}
    cfg.update(over.get(kind, {}))
    if short:
        cfg.update(over.get(kind + "_short", {}))
    for key in ("BM", "BN"):
        cfg[key] = min(cfg[key], block)
    if group > 1:
        cfg["HEAD_OUTER"] = cfg.get("GQA_HEAD_OUTER", cfg["HEAD_OUTER"])
    return cfg


def grid(cfg: dict, heads: int, rows: int) -> tuple[int, int]:
    """The launch grid: (heads, rows), or (rows, heads) with HEAD_OUTER (see tiles.program_tile)."""
    return (rows, heads) if cfg["HEAD_OUTER"] else (heads, rows)


def pipeline_stages(cfg: dict, tma: bool) -> int:
    """Pipeline stages of a launch: the config's, or its FALLBACK_STAGES where it asks for TMA that cannot run."""
    return cfg["num_stages"] if tma or not cfg.get("TMA") else cfg.get("FALLBACK_STAGES", cfg["num_stages"])


def compile_options(cfg: dict, tma: bool) -> dict:
    """Triton's compile options of a launch: warps, pipeline stages (:func:`pipeline_stages`) and, where the
    config caps them, registers per thread (``maxnreg``: more programs resident per SM), with TMA tiles only:
    pointer tiles keep their addresses in registers and spill under the cap."""
    opts = dict(num_warps=cfg["num_warps"], num_stages=pipeline_stages(cfg, tma))
    if cfg.get("maxnreg") and tma:
        opts["maxnreg"] = cfg["maxnreg"]
    return opts


def precision(dtype) -> str:
    """tl.dot's input precision: exact for fp32 inputs (the interpreter tests compare at 2e-5)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def empty(shape, like: torch.Tensor, options: KernelOptions, dtype=None) -> torch.Tensor:
    """An output buffer on ``like``'s device: uninitialised, or NaN with ``options.poison_outputs``."""
    dtype = dtype or like.dtype
    if options.poison_outputs:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


def record(options: KernelOptions, kind: str, compiled) -> None:
    """Hand a launch's compiled kernel to the diagnostics sink, where one is given."""
    if options.compiled is not None:
        options.compiled[kind] = compiled


def kept_pairs(q, k, sel) -> int:
    """Kept (query, key) token pairs over all query heads, counted in whole blocks; where only the device
    knows the kept entries, k2q_idx's length bounds them (the sort-built lists are padded to the widest row)."""
    B = sel.layout.block_size
    kept = sel.kept_entries if sel.kept_entries is not None else sel.k2q_idx.numel()
    return kept * B * B * (q.shape[1] // k.shape[1])


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """Hopper or later (cached: the launchers ask on every call)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_view(x: torch.Tensor) -> bool:
    """Whether ``x [T, H, D]`` has a ``[T, H*D]`` view a descriptor can take: unit D stride, heads D apart,
    16-byte aligned base and token stride."""
    return (x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.data_ptr() % 16 == 0
            and x.stride(0) * x.element_size() % 16 == 0)


def tma_able(cfg: dict, *xs) -> bool:
    """Whether a launch of ``cfg`` over the ``[T, H, D]`` tensors ``xs`` can take TMA tiles: the config asks
    for them, and Hopper or later with 16-bit inputs and D 64 or 128 (the sizes ``benchmarks.attention
    --check`` validates on the GPU), or the interpreter, on tensors with a ``[T, H*D]`` view."""
    x0 = xs[0]
    able = cfg.get("TMA") and (_interpret() or (x0.is_cuda and x0.element_size() == 2 and x0.shape[2] in (64, 128)
                                                and _has_tma(x0.device)))
    return bool(able) and all(_tma_view(x) for x in xs)


def use_tma(cfg: dict, pairs: int, *xs) -> bool:
    """TMA tiles where they can run (:func:`tma_able`) and the launch keeps at least TMA_MIN_PAIRS token
    ``pairs``."""
    return pairs >= TMA_MIN_PAIRS and tma_able(cfg, *xs)


def descriptors(cfg: dict, rows: int, pairs: int, *xs):
    """Tensor descriptors of each ``[T, H, D]`` tensor's ``[T, H*D]`` view with ``[rows, D]`` boxes where the
    launch takes TMA tiles (:func:`use_tma`), otherwise Nones (pointer tiles)."""
    return tensor_descriptors(rows, *xs) if use_tma(cfg, pairs, *xs) else (None,) * len(xs)


def tensor_descriptors(rows: int, *xs):
    """Tensor descriptors of each ``[T, H, D]`` tensor's ``[T, H*D]`` view with ``[rows, D]`` boxes."""
    if not _interpret():
        _bind_context(xs[0].device)
    return tuple(TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], [rows, x.shape[2]])
                 for x in xs)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def tile_variants(kind: str, block: int, D: int, options: KernelOptions, *xs,
                  group: int = 1) -> list[tuple[dict, bool]]:
    """Every (config, TMA) a launch of ``kind`` over the tensors ``xs`` (its TMA operands) can take for some
    batch: the configs of both row classes, each with TMA tiles where they can run and with pointer tiles."""
    configs = []
    for rows in (0, None):  # a short row, and no row count (the long-row config)
        cfg = get_config(kind, block, D, rows, options, group)
        if cfg not in configs:
            configs.append(cfg)
    return [(cfg, tma) for cfg in configs for tma in ((False, True) if tma_able(cfg, *xs) else (False,))]


def row_class_launches(kind: str, sel, D: int, options: KernelOptions,
                       group: int = 1) -> list[tuple[str, dict, torch.Tensor]]:
    """The launches of one kernel over a selection, as (name, config, block ends): where the host knows the
    widest row (``sel.row_blocks``), one, with its row class's config (named ``kind``). Otherwise one per row
    class (``kind + "_short"`` and ``kind``), each with ``sel.row_class_end``'s block ends, which are zeros
    (every program of that launch returns at once) unless the device's widest row is of its class; or a
    single launch where both classes share one config. Programs past a block's end do nothing, so the
    kernels need no flag of their own, and no launch waits for the host to learn the widest row."""
    B = sel.block_size
    if sel.row_blocks is not None:
        return [(kind, get_config(kind, B, D, sel.row_blocks, options, group), sel.layout.block_end)]
    short, long_ = get_config(kind, B, D, 0, options, group), get_config(kind, B, D, None, options, group)
    if short == long_:
        return [(kind, long_, sel.layout.block_end)]
    return [(kind + "_short", short, sel.row_class_end[0]), (kind, long_, sel.row_class_end[1])]


def cached_variants(kernel) -> int:
    """Compiled variants of one JIT kernel in this process (Triton's in-memory cache, over devices; one
    loaded from Triton's disk cache counts too); 0 under the interpreter, which compiles nothing."""
    caches = getattr(kernel, "device_caches", None)
    return 0 if caches is None else sum(len(cache[0]) for cache in caches.values())


def launch(kernel, grid, args: tuple, kwargs: dict, siblings=tuple):
    """``kernel[grid](*args, **kwargs)``. Where that launch compiled a variant (the first launch of these
    argument types in this process), also compile, without launching, the variants that a later batch of the
    same shapes may take instead: ``siblings()`` gives them as (kernel, args, kwargs). A training run then
    compiles all of them in its first step rather than in whichever later step first needs one (seconds
    each)."""
    before = cached_variants(kernel)
    compiled = kernel[grid](*args, **kwargs)
    if cached_variants(kernel) > before:
        for sib_kernel, sib_args, sib_kwargs in siblings():
            try:
                load(sib_kernel.warmup(*sib_args, grid=grid, **sib_kwargs))
            except (CompilationError, OutOfResources, PTXASError):
                pass  # a variant Triton cannot build here fails where a batch launches it, as without this
    return compiled


def load(variant) -> None:
    """Make a variant compiled by ``warmup`` launchable now. Its first launch would otherwise build its launcher
    (a C module Triton compiles with the host's compiler: a second or more where Triton's disk cache lacks it,
    measured on an H100 as a 0.8-1.5 s stall, with no compilation, in the first step to take such a variant)
    and load its binary. Triton does both in ``CompiledKernel._init_handles``, which has no public name; the
    interpreter's warm-up returns no compiled kernel."""
    init = getattr(variant, "_init_handles", None)
    if init is not None:
        init()


_THREAD = threading.local()


def _bind_context(device: torch.device):
    """Make the device's primary CUDA context current on this thread. Triton encodes a launch's TMA
    descriptors before its launcher binds a context, which fails ("invalid device context") on a thread whose
    first CUDA work that launch is, e.g. autograd's device thread when this kernel's backward runs first in it
    (Triton 3.6 on an H200). Any CUDA runtime call binds it; a stream query is cheap and never waits."""
    if getattr(_THREAD, "bound", None) != device:
        torch.cuda.current_stream(device).query()
        _THREAD.bound = device


def overlap_pays(programs: int, sms: int) -> bool:
    """Whether the overlapped backward pays: ``programs`` dK/dV programs on ``sms`` SMs."""
    return programs <= OVERLAP_MAX_PROGRAMS_PER_SM * sms


def dkdv_programs(q, k, sel, options: KernelOptions) -> int:
    """Programs of the dK/dV launch: one per (KV head, KV tile)."""
    B = sel.layout.block_size
    return k.shape[1] * sel.layout.num_blocks * (B // get_config("dkdv", B, q.shape[-1], sel.row_blocks,
                                                                 options)["BN"])
