"""What a row keeps under a budget: the rules of the torch selection (:mod:`.selection`) over a chunk of rows'
routing probabilities, which the runner's context-parallel ring (``runner/cp.py``) applies to its own rows.

A row is a (KV head, query block) of a document; its candidates are the document's ``n`` causal blocks.

* top-p (``p``): the fewest blocks, in descending probability, whose mass reaches p (every block at p = 1);
* kept fraction (``kept_fraction``): ``round(kf * n)`` blocks (at least one), the diagonal first, then the
  most probable others;
* top-k (``top_k``): ``min(k, n)`` blocks, the diagonal first, then the most probable others; with a
  coverage floor (``p`` beside ``top_k``) also the row's top-p blocks: the union, which is the longer of
  the two prefixes of the diagonal-first descending order.

The caller adds the diagonal and masks the padding. Budgets are per document, float32 on the rows' device; a
top-k budget holds its counts negated, as the fused selection kernel reads them (:mod:`.select_kernels`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["RowRule", "keeps_every_block", "row_rule"]

MODES = ("p", "kept_fraction", "top_k")


@dataclass(frozen=True)
class RowRule:
    """A budget as the rows read it: ``mode`` (one of MODES), ``budget`` float32 ``[n]`` (p, the kept fraction,
    or the top-k count negated) and, for top-k, an optional top-p ``floor`` float32 ``[n]``."""

    mode: str
    budget: torch.Tensor
    floor: torch.Tensor | None = None

    def at(self, index) -> RowRule:
        """The rule of the documents ``index`` (an index tensor or a slice) of this one's."""
        return RowRule(self.mode, self.budget[index], None if self.floor is None else self.floor[index])

    def keep(self, prob, r, j, isdiag, validh) -> torch.Tensor:
        """bool like ``prob [nd, Hkv, R, W]``: the blocks that rows ``r`` ``[R]`` (row indices in their
        documents; columns ``j`` ``[W]``) of this rule's ``nd`` documents keep, before the caller adds the
        diagonal (``isdiag``) and masks with ``validh`` (the causal candidates)."""
        if self.mode == "p":
            return _keep_topp(prob, r, self.budget)
        if self.mode == "kept_fraction":
            return _keep_topk(prob, r, j, self.budget, isdiag, validh)
        kk = torch.minimum(-self.budget[:, None], (r + 1).to(torch.float32)[None, :]).to(torch.int64)
        keep = _keep_first(prob, j, kk, isdiag, validh)
        return keep if self.floor is None else keep | _keep_topp(prob, r, self.floor)


def row_rule(n: int, device, p=None, kept_fraction=None, top_k=None) -> RowRule:
    """The rule of a budget given as the public functions take it (float / int or ``[n]`` tensor; neither
    means p = 1), for ``n`` documents on ``device``; tensors are copied without blocking (no sync)."""
    if top_k is not None:
        floor = None if p is None else _per_doc(p, n, "p", device)
        return RowRule("top_k", _per_doc_count(top_k, n, device), floor)
    if kept_fraction is not None:
        return RowRule("kept_fraction", _per_doc(kept_fraction, n, "kept_fraction", device))
    return RowRule("p", _per_doc(1.0 if p is None else p, n, "p", device))


def keeps_every_block(doc_nblocks, p=None, kept_fraction=None, top_k=None) -> bool:
    """Whether the budget keeps every causal block of every document (of ``doc_nblocks`` blocks each): p or
    kept fraction 1 everywhere, top-k with k at least every document's blocks or a floor of 1. Floats are
    read as they are; a budget tensor on a device costs a device->host copy."""
    if top_k is not None:
        nb = torch.tensor(doc_nblocks, dtype=torch.float32)
        rows = _host(top_k) >= nb
        return bool((rows if p is None else rows | (_host(p) >= 1.0)).all())
    value = p if kept_fraction is None else kept_fraction
    if value is None or not isinstance(value, torch.Tensor):
        return value is None or float(value) >= 1.0
    return bool((_host(value) >= 1.0).all())


def _host(value) -> torch.Tensor:
    return torch.as_tensor(value).detach().to("cpu", torch.float32).reshape(-1)


def _per_doc(value, n: int, name: str, device) -> torch.Tensor:
    """Budget as a float32 [n] device tensor. Range checks of tensors are done (once, on the host) by the
    public functions' validate_inputs; floats are checked here without touching the device."""
    if isinstance(value, torch.Tensor):
        # non-blocking: a host budget is staged at once, and a blocking copy would sync the stream
        t = value.detach().to(device=device, dtype=torch.float32, non_blocking=True).reshape(-1)
        if t.numel() == 1:
            t = t.expand(n)
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} entries, expected one per sequence ({n})")
        return t.contiguous()
    v = float(value)
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return _uniform_budget(v, n, torch.device(device))


def _per_doc_count(value, n: int, device) -> torch.Tensor:
    """Top-k counts as a float32 [n] device tensor, negated (the fused kernel's encoding of a count)."""
    if isinstance(value, torch.Tensor):
        # negated where the budget lives (the host, for a runner), then staged without blocking
        t = (-value.detach().reshape(-1).to(torch.float32)).to(device=device, non_blocking=True)
        if t.numel() == 1:
            t = t.expand(n)
        if t.numel() != n:
            raise ValueError(f"top_k has {t.numel()} entries, expected one per sequence ({n})")
        return t.contiguous()
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"top_k must be a whole number of blocks >= 1, got {value!r}")
    return _uniform_budget(-float(value), n, torch.device(device))


@functools.lru_cache(maxsize=16)
def _uniform_budget(v: float, n: int, device: torch.device) -> torch.Tensor:
    # cached: read-only downstream, and a fill launch per call is host time the selection is bound by
    return torch.full((n,), v, dtype=torch.float32, device=device)


def _keep_topp(prob, r, bud):
    """Top-p: per row, the fewest blocks in descending probability order whose mass reaches the document's
    ``bud`` (every causal block where it is 1); ``r`` are the chunk's row indices (causal bound)."""
    vals, order = torch.sort(prob, dim=-1, descending=True, stable=True)
    excl = torch.cumsum(vals, -1) - vals
    keep_sorted = excl < bud[:, None, None, None]
    keep_sorted = keep_sorted | (bud >= 1.0)[:, None, None, None]
    keep_sorted = keep_sorted & (order <= r[None, None, :, None])
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def _keep_topk(prob, r, j, bud, isdiag, validh):
    """Top-k by kept fraction: per row of n = r + 1 causal blocks, the diagonal and the highest-probability
    others, ``round(bud * n)`` in all (at least one)."""
    ncaus = (r + 1).to(torch.float32)
    kk = torch.floor(bud[:, None] * ncaus[None, :] + 0.5).clamp(min=1)
    kk = torch.minimum(kk, ncaus[None, :]).to(torch.int64)  # [nd, R]
    return _keep_first(prob, j, kk, isdiag, validh)


def _keep_first(prob, j, kk, isdiag, validh):
    """The first ``kk [nd, R]`` blocks of each row in the diagonal-first descending order."""
    key = torch.where(isdiag, 2.0, prob).masked_fill(~validh, -1.0)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    keep_sorted = (j[None, None, None, :] < kk[:, None, :, None]).expand_as(key)
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
