"""Pure-PyTorch reference (and CPU training fallback) for block-sparse varlen attention.

``sparse_attention_naive(q, k, v, cu_seqlens, selection)`` computes exactly what the Triton kernel computes
(same selection, causal within each document), one document at a time with a dense token mask, in float32,
and is differentiable through ordinary autograd. Memory is O(L^2) per document: use it for tests and for
CPU training of short documents (the public ``sparse_attention(..., backend="naive")`` routes here; it is the
default on CPU). ``dense_causal_varlen`` is plain causal attention per document through torch SDPA.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .selection import BlockSelection

__all__ = ["sparse_attention_naive", "dense_causal_varlen", "select_blocks_naive"]


def _expand_kv(x: torch.Tensor, G: int) -> torch.Tensor:
    return x if G == 1 else x.repeat_interleave(G, dim=1)


def sparse_attention_naive(q, k, v, cu_seqlens, selection: BlockSelection, softmax_scale=None,
                           out_dtype=None) -> torch.Tensor:
    """Reference block-sparse attention. Returns ``[T, Hq, D]`` in ``out_dtype`` (default q.dtype)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    lay = selection.layout
    B = lay.block_size
    H, NB, W = selection.q2k_idx.shape
    slot = torch.arange(W, device=q.device)
    idx = selection.q2k_idx.long().to(q.device)
    cnt = selection.q2k_cnt.to(q.device)
    outs = []
    for d in range(lay.num_docs):
        s, e = lay.doc_start[d], lay.doc_start[d + 1]
        f, nb = lay.doc_first_block[d], lay.doc_nblocks[d]
        L = e - s
        # block mask of this document [Hkv, nb, nb]
        bm = torch.zeros(Hkv, nb, nb + 1, dtype=torch.bool, device=q.device)
        sub_idx = idx[:, f:f + nb] - f
        valid = (slot[None, None, :] < cnt[:, f:f + nb, None]) & (sub_idx >= 0) & (sub_idx < nb)
        bm.scatter_(2, torch.where(valid, sub_idx, nb), True)
        bm = bm[:, :, :nb]
        tb = torch.arange(L, device=q.device) // B
        tm = bm[:, tb][:, :, tb]  # [Hkv, L, L]
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        tm = (tm & causal).repeat_interleave(G, dim=0)  # [Hq, L, L]
        qd = q[s:e].float().transpose(0, 1)
        kd = _expand_kv(k[s:e].float(), G).transpose(0, 1)
        vd = _expand_kv(v[s:e].float(), G).transpose(0, 1)
        sc = torch.matmul(qd, kd.transpose(-1, -2)) * scale
        sc = sc.masked_fill(~tm, float("-inf"))
        pr = torch.softmax(sc, dim=-1)
        outs.append(torch.matmul(pr, vd).transpose(0, 1))
    out = torch.cat(outs, 0)
    return out.to(out_dtype or q.dtype)


def dense_causal_varlen(q, k, v, cu_seqlens, softmax_scale=None) -> torch.Tensor:
    """Dense causal attention within each document (torch SDPA, float32 math)."""
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    cu = cu_seqlens.tolist()
    outs = []
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        qd = q[s:e].float().transpose(0, 1)[None]
        kd = _expand_kv(k[s:e].float(), G).transpose(0, 1)[None]
        vd = _expand_kv(v[s:e].float(), G).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=softmax_scale)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, 0).to(q.dtype)


def select_blocks_naive(q, k, cu_seqlens, p=None, kept_fraction=None, top_k=None, block_size=64):
    """Loop-per-row reference of the selection rule: ``{(h, g): set of kept global blocks}`` plus the
    per-row kept routing mass. ``top_k`` (int or ``[n]``) keeps min(k, n) blocks of a row of n causal blocks,
    the diagonal first, and with ``p`` also the row's top-p blocks. Slow; tests only."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    cu = cu_seqlens.tolist()
    n = len(cu) - 1
    B = block_size
    res, mass = {}, {}
    gbase = 0
    for d in range(n):
        s, e = cu[d], cu[d + 1]
        nb = (e - s + B - 1) // B
        pp = _doc_value(p, d)
        for h in range(Hkv):
            qb = [q[s + b * B:min(e, s + (b + 1) * B), h * G:(h + 1) * G].float().mean((0, 1)) for b in range(nb)]
            kb = [k[s + b * B:min(e, s + (b + 1) * B), h].float().mean(0) for b in range(nb)]
            for b in range(nb):
                sc = torch.stack([qb[b] @ kb[c] for c in range(b + 1)]) / math.sqrt(D)
                pr = torch.softmax(sc, 0)
                order = sorted(range(b + 1), key=lambda c: (-float(pr[c]), c))
                diag_first = [b] + [c for c in order if c != b]
                if top_k is not None:
                    keep = set(diag_first[:min(b + 1, int(_doc_value(top_k, d)))])
                    if pp is not None:
                        keep |= _top_p(order, pr, pp)
                elif kept_fraction is None:
                    keep = _top_p(order, pr, 1.0 if pp is None else pp)
                else:
                    kf = _doc_value(kept_fraction, d)
                    keep = set(diag_first[:min(b + 1, max(1, math.floor(kf * (b + 1) + 0.5)))])
                keep.add(b)
                res[(h, gbase + b)] = {gbase + c for c in keep}
                mass[(h, gbase + b)] = float(sum(pr[c] for c in keep))
        gbase += nb
    return res, mass


def _doc_value(value, d: int):
    """Document ``d``'s entry of a budget (a number, a one-entry or an ``[n]`` tensor, or None)."""
    if isinstance(value, torch.Tensor):
        return float(value.reshape(-1)[d if value.numel() > 1 else 0])
    return value


def _top_p(order: list[int], pr, p: float) -> set[int]:
    """The fewest blocks of ``order`` (descending probability) whose mass reaches ``p``; all of them at 1."""
    keep, acc = set(), 0.0
    for c in order:
        if acc >= p and p < 1.0:
            break
        keep.add(c)
        acc += float(pr[c])
    return keep
