"""Context parallelism on the sparse-attention kernel: all-gathered keys and values, each rank's own rows.

``runner.cp`` shards the micro-batch (zigzag chunks) and holds the ring; this module is the attention that
``runner.attention=kernel`` (the default) and ``triton`` use with cp > 1. Per layer:

1. Gather, along the cp ring (``cp - 1`` hops of ``RingShift``): every rank's keys and values, with their
   gradients sent home in the backward, and, without gradients, every rank's queries. Each lands at its
   tokens' places in the packed micro-batch, so every rank holds the whole micro-batch's K/V and Q.
2. Select: ``select_blocks`` on the whole micro-batch, on every rank alike, so the selection is exactly what
   one process selects, and its kept fraction and coverage are the whole sequences'.
3. Attend: the kernel over the whole micro-batch, with this rank's queries in place (zeros elsewhere) and the
   selection cut by ``restrict_rows`` to the query blocks the rank holds tokens of: every other row keeps only
   its diagonal block, whose output is dropped. A rank's own rows thus attend exactly as in one process, and
   its kernel work is its rows' kept blocks plus one block per other row.

Backward: the kernel's backward gives dQ on the rank's tokens (the dropped rows' output gradient is zero, so
their one block adds nothing) and dK/dV over the whole micro-batch, which the ring hops carry back to the
ranks that own them, summing every rank's part. The price against the ring of pieces (``runner.cp``,
``runner.attention=naive``): each rank holds the whole micro-batch's Q, K and V per layer (as all-gather CP
does in Llama 3's training), and the kernel's work per rank follows the selection over the shards
(``sim/cp_shards.py``), not an exact 1/cp.
"""
from __future__ import annotations

import torch

from sparsebalance.kernels.sparse_attention import restrict_rows, select_blocks, sparse_attention
from sparsebalance.runner.attention import budget_keywords
from sparsebalance.runner.cp import Ring, RingShift, Shards

__all__ = ["make_cp_kernel_attention", "own_rows"]


def make_cp_kernel_attention(block_size: int, ring: Ring, backend: str):
    """``attend(q, k, v, shards, budgets) -> (o, kept [n], coverage [n])`` over this rank's tokens (``budgets``
    as ``runner.attention.budget_keywords`` takes them);
    ``backend`` is the kernel's (``auto``: Triton on CUDA tensors, the PyTorch reference on the CPU)."""

    def attend(q, k, v, shards: Shards, budgets):
        index = [i.to(q.device) for i in shards.index]
        kv = gather(torch.stack((k, v)), shards, ring, index, dim=1)
        queries = gather(q.detach(), shards, ring, index, dim=0)
        selection = select_blocks(queries, kv[0].detach(), shards.docs, **budget_keywords(budgets),
                                  block_size=block_size)
        mine = index[ring.rank]
        placed = q.new_zeros(queries.shape).index_copy(0, mine, q)
        o = sparse_attention(placed, kv[0], kv[1], shards.docs, selection=own_rows(selection, mine),
                             backend=backend)
        return o[mine], selection.kept_fraction, selection.coverage

    return attend


def own_rows(selection, mine: torch.Tensor):
    """``selection`` cut (``restrict_rows``) to the query blocks holding any of the packed tokens ``mine``."""
    rows = torch.zeros(selection.num_blocks, dtype=torch.bool, device=mine.device)
    rows[selection.layout.token_block[mine]] = True
    return restrict_rows(selection, rows)


def gather(x: torch.Tensor, shards: Shards, ring: Ring, index: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Every cp rank's ``x`` (this rank's tokens along ``dim``) at its tokens' places in the micro-batch; the
    backward returns each rank's part of the gradient to it along the same ring."""
    shape = list(x.shape)
    shape[dim] = shards.docs.total_tokens
    whole = x.new_zeros(shape).index_copy(dim, index[ring.rank], x)
    arriving = x
    for hop in range(1, ring.size):
        source = (ring.rank - hop) % ring.size
        shape[dim] = shards.tokens_of(source)
        arriving = RingShift.apply(arriving, ring, tuple(shape))
        whole = whole.index_copy(dim, index[source], arriving)
    return whole
