"""``--fair``: the fair comparison on one packed micro-batch, MHA and GQA 32:4.

Flex's blocks are global, ours per document: on documents that do not start at a block boundary, Flex's
token-level document mask (create_block_mask) makes blocks straddle documents and computes them all, which
is most of our lead on packed batches. Flex's best constructions are measured beside it: documents aligned to
the block size with Flex handed exactly our kept blocks (BlockMask.from_kv_blocks, enable_gqa), and the
unaligned documents each padded to a whole number of blocks (what a Flex user does, a few % more tokens).
The dense kernels a user runs instead (``kernels.backends``: cuDNN, FlashAttention-4 and -3 where installed) are
timed at sparsity 0 on the unaligned batch: their work does not depend on the sparsity. FlashAttention-4's
block-sparse form (``fa4_sparse``) runs our kept blocks of the unaligned batch, as a trainer would run it: the
documents padded to whole blocks inside the backend.

With ``--profile`` (a cost profile that prices other backends) every sparsity also times ``hybrid``: ours or the
backend that the profile prices fastest for this batch at ours' kept fractions (``backend`` names it): the
choice ``cost.attention_backend=hybrid`` makes in the simulator and the runner (sim.backends.choose). The dense
kernels then run in every sparsity's turns too, so that hybrid is held against them timed beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np
import torch

from sparsebalance.kernels.backends import load, load_all
from sparsebalance.kernels.backends.flash_sparse import padded_documents, selection_block_mask
from sparsebalance.sim.backends import OURS
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.core import ConfigError
from sparsebalance.kernels.sparse_attention import VarlenBatch, select_blocks
from .common import (B, D, compiled_flex, csv_emitter, cu_from_lens, flex_pair, heads_first, interleaved_ms,
                     kept_fwd_flops, log, long_tail_lengths, make_qkv, sparse_pair, timed_row, weighted_kept_fraction)
from .masks import flex_block_mask_packed


FAIR_HEADS = {"mha": (16, 16), "gqa": (32, 4)}
FAIR_SPARSITIES = {"mha": (0.0, 0.75, 0.9, 0.95), "gqa": (0.0, 0.5, 0.9)}
FAIR_FIELDS = ["case", "heads", "T", "ndocs", "padded_T", "sparsity", "kept_fraction", "impl", "fwd_ms", "fwdbwd_ms",
               "fwd_tflops", "fwdbwd_tflops", "error", "backend"]
# (peer, ours) rows of each construction: ours on the batch the construction starts from
# each dense backend's rows (kernels.backends name -> impl)
DENSE_IMPLS = {"cudnn": "cudnn_per_document_dense", "fa4": "fa4_varlen_dense", "fa3": "fa3_varlen_dense"}
# each sparse peer's rows (kernels.backends name -> impl): ours' selection of the unaligned batch, on its kernels
SPARSE_IMPLS = {"fa4_sparse": "fa4_sparse"}
FAIR_PAIRS = (("flex_token_mask", "triton_sparse"), ("flex_padded", "triton_sparse"),
              ("flex_exact", "triton_sparse_aligned"), ("flex_flash_exact", "triton_sparse_aligned"),
              *((impl, "triton_sparse") for impl in (*DENSE_IMPLS.values(), *SPARSE_IMPLS.values())))
FAIR_IMPLS = ("triton_sparse", "triton_sparse_aligned", *(peer for peer, _ in FAIR_PAIRS))


def fair_lengths(total: int = 65536, seed: int = 0) -> tuple[list[int], list[int]]:
    """(aligned, unaligned) document lengths of one packed batch: the long-tail lengths rounded up to whole
    blocks and trimmed, largest first, to ``total`` tokens; and the same documents each shorter by 0..B-1
    tokens (at least one left), so that padding them back to whole blocks gives the aligned batch."""
    aligned = [-(-n // B) * B for n in long_tail_lengths(total, seed)]
    while sum(aligned) > total:
        aligned[aligned.index(max(aligned))] -= B
    g = torch.Generator().manual_seed(seed + 1)
    cut = torch.randint(0, B, (len(aligned),), generator=g).tolist()
    return aligned, [n - min(c, n - 1) for n, c in zip(aligned, cut, strict=True)]


def padded_tensors(pos: torch.Tensor, T_pad: int, q, k, v, do):
    """[1, H, T_pad, D] copies of q, k, v, dO with each real token at its padded position, zeros between."""
    out = []
    for x in (q, k, v, do):
        p = torch.zeros(T_pad, *x.shape[1:], device=x.device, dtype=x.dtype)
        p[pos] = x.detach()
        out.append(p)
    return heads_first(*out)


def hybrid_costs(profile: str) -> dict:
    """Per head configuration, the cost model that prices the fair batch's attention under
    ``cost.attention_backend=hybrid``: ``profile``'s terms at that configuration's heads and head dim (the model's
    other sizes do not enter attention). One ConfigError line for a profile that prices no dense backend, one
    that this benchmark does not time, or another block size than the batch's."""
    from omegaconf import OmegaConf

    from sparsebalance.sim.config import compose_config
    from sparsebalance.sim.cost import make_cost

    costs = {}
    for heads, (hq, hkv) in FAIR_HEADS.items():
        cfg = OmegaConf.to_object(compose_config([f"cost.profile={profile}", "cost.attention_backend=hybrid",
                                                  f"model.heads={hq}", f"model.kv_heads={hkv}", f"model.head_dim={D}",
                                                  f"model.hidden={hq * D}"]))
        try:
            costs[heads] = make_cost(cfg.cost, cfg.model, Cluster.from_config(cfg.cluster), recompute=False)
        except ConfigError as exc:
            raise ConfigError(f"--profile {profile}: {exc}") from None
    cost = costs[next(iter(FAIR_HEADS))]
    timed = {**DENSE_IMPLS, **SPARSE_IMPLS}
    untimed = [name for name in (*cost.dense_backends(), *cost.sparse_backends()) if name not in timed]
    if untimed:
        raise ConfigError(f"--profile {profile}: it prices the backend {untimed[0]}, which this benchmark does "
                          f"not time; allowed: a profile whose backends are among {', '.join(timed)}")
    if cost.block_size != B:
        raise ConfigError(f"--profile {profile}: its block size is {cost.block_size}, the fair batch's {B}; "
                          f"allowed: a profile of block size {B}")
    return costs


def hybrid_choice(cost, lens, kept) -> str:
    """The backend ``cost`` runs one micro-batch of the documents ``lens`` on, at ours' kept fractions ``kept``
    (one per document): ours or a peer's name (dense or sparse)."""
    lengths = np.asarray(lens, dtype=np.int64)
    costs = cost.micro_batch_costs(lengths, np.asarray(kept, dtype=np.float64), np.zeros(lengths.size, dtype=np.int64),
                                   1, Layout(dp=1))
    return str(costs.backend[0])


def backend_fns(backend, q, k, v, do, lens, selection=None):
    """(fwd, fwd+bwd) of a loaded backend (kernels.backends) on the documents ``lens``, a sparse one over
    ``selection`` (ours, of the same documents), its documents built once as the runner hands them over. The
    dense kernels' launches cost host time that do_bench counts wherever the GPU runs short of it (cuDNN: a call
    per document)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    docs = backend.documents(lens, q.device)
    extra = {"selection": selection} if backend.sparse else {}

    def fwd():
        return backend.attention(*leaves, docs, **extra)

    return fwd, lambda: torch.autograd.grad(fwd(), leaves, do)


def peer_fns(peers: dict, name: str, un: tuple, selection):
    """(fwd, fwd+bwd) of the backend ``name`` on the unaligned batch ``un`` (a sparse peer over ``selection``):
    the one loaded once for the run (``peers``: fa4_sparse compiles FlexAttention once), else loaded here, so
    that one that cannot run raises its one-line BackendAbsent."""
    return backend_fns(peers[name] if name in peers else load(name), *un[:4], un[5], selection)


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
        base[name] = dict(case="packed64k", heads=f"{Hq}:{Hkv}", T=sum(lens), ndocs=len(lens), sparsity=sp,
                          kept_fraction=weighted_kept_fraction(sel, lens))
        flops[name] = kept_fwd_flops(sel, Hq)
        fns[name] = sparse_pair(q, k, v, do, cu, sel, args.options)
        batch[key + "_sel"] = sel
    un = batch["unaligned"]
    wanted = set(args.fair_impls)
    if heads == "mha" and "flex_token_mask" in wanted:  # the --bench grid's construction (MHA only)
        fns["flex_token_mask"] = sticky.fns(f"flex_token_mask_{sp}", lambda: flex_pair(
            flex, batch["un_heads"], flex_block_mask_packed(batch["unaligned_sel"], Hq, sum(un[5]), B), G))
    if "flex_padded" in wanted:
        fns["flex_padded"] = sticky.fns(f"flex_padded_{sp}", lambda: flex_pair(
            flex, batch["padded"], selection_block_mask(batch["unaligned_sel"], Hq, batch["padded_end"]), G))
    if wanted & {"flex_exact", "flex_flash_exact"}:
        exact = selection_block_mask(batch["aligned_sel"], Hq, batch["aligned_end"])
    if "flex_exact" in wanted:
        fns["flex_exact"] = flex_pair(flex, batch["al_heads"], exact, G)
    if "flex_flash_exact" in wanted:
        fns["flex_flash_exact"] = sticky.fns("flash", lambda: probed(flex_pair(flex, batch["al_heads"], exact, G,
                                                                                    {"BACKEND": "FLASH"})))
    for name, impl in DENSE_IMPLS.items():
        # their work does not depend on the sparsity; with hybrid they run in every point's turns, so that hybrid
        # is held against them timed beside it, not in another point's turns
        if (sp == 0.0 or args.hybrid is not None) and impl in wanted:
            fns[impl] = sticky.fns(f"{impl}_{heads}", lambda name=name: probed(peer_fns(args.peers, name, un, None)))
    sel = batch["unaligned_sel"]
    for name, impl in SPARSE_IMPLS.items():
        if impl in wanted:
            fns[impl] = sticky.fns(f"{impl}_{heads}", lambda name=name: probed(peer_fns(args.peers, name, un, sel)))
    if args.hybrid is not None:
        choice = hybrid_choice(args.hybrid[heads], un[5], sel.kept_fraction.cpu().numpy())
        base["hybrid"] = dict(base["triton_sparse"], backend=choice)
        fns["hybrid"] = fns["triton_sparse"] if choice == OURS else sticky.fns(
            f"{choice}_{heads}", lambda: probed(peer_fns(args.peers, choice, un, sel)))
    for impl, timed in interleaved_ms({n: f for n, f in fns.items() if not isinstance(f, Exception)},
                                      args.rounds).items():
        ours = "triton_sparse_aligned" if impl in ("flex_exact", "flex_flash_exact", "triton_sparse_aligned") \
            else "triton_sparse"
        row = dict(base.get(impl, base[ours]), impl=impl, padded_T=batch["padded_T"] if impl == "flex_padded" else "")
        emit(dict(row, error=repr(timed)[:300]) if isinstance(timed, Exception) else timed_row(row, *timed,
                                                                                              flops[ours]))
    for impl, err in fns.items():
        if isinstance(err, Exception):
            emit(dict(base.get(impl, base["triton_sparse"]), impl=impl, error=f"absent: {err!r:.300}"))


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
    padded = padded_documents(unaligned, B, q.device)
    batch.update(padded=padded_tensors(padded.positions, padded.padded_tokens, q, k, v, do), padded_end=padded.kv_end,
                 padded_T=padded.padded_tokens, aligned_end=padded_documents(aligned, B, q.device).kv_end,
                 un_heads=heads_first(q, k, v, do), al_heads=heads_first(*batch["aligned"][:4]))
    return batch


def fair_sparsities(args, heads: str) -> tuple[float, ...]:
    """--fair-sparsities where given (0 first, where the dense backends are timed), else FAIR_SPARSITIES."""
    if args.fair_sparsities is None:
        return FAIR_SPARSITIES[heads]
    return (0.0, *sorted(set(args.fair_sparsities) - {0.0}))


def run_fair(args):
    """The fair grid (see FAIR_HEADS): every head configuration's sparsities, into ``args.csv``. Our kernels
    compile only what they launch here (no precompile: GPU time of the call, not of a training run)."""
    import triton

    flex = compiled_flex(args.flex_mode)
    sticky = Sticky()
    peers, absent = load_all([*DENSE_IMPLS, *SPARSE_IMPLS])
    args = argparse.Namespace(**{**vars(args), "options": dataclasses.replace(args.options, precompile=False),
                                 "peers": peers})
    t_start = time.time()
    with open(args.csv, "w", newline="") as out:
        emit = csv_emitter(out, FAIR_FIELDS)
        log("META", json.dumps(dict(torch=torch.__version__, triton=triton.__version__,
                                    gpu=torch.cuda.get_device_name(), rounds=args.rounds, flex_mode=args.flex_mode,
                                    profile=args.profile,
                                    backends={name: b.version() for name, b in peers.items()}, absent=absent)))
        for heads in args.fair_heads:
            batch = fair_batch(heads)
            for sp in fair_sparsities(args, heads):
                if time.time() - t_start > args.deadline_s:
                    emit(dict(case="packed64k", heads="{}:{}".format(*FAIR_HEADS[heads]), sparsity=sp, impl="all",
                              error="skipped: --deadline-s reached"))
                    continue
                fair_point(args, emit, flex, sticky, heads, sp, batch)
            del batch
            torch.cuda.empty_cache()
