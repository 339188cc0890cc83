"""Context parallelism: zigzag shards of a micro-batch's sequences over the cp ranks of one replica, and the
attention over them, which equals the whole micro-batch's block-sparse attention.

Sharding (``Shards``): every sequence of the micro-batch is cut into ``2 cp`` chunks of equal token counts,
chunk ``j`` of a sequence of length ``L`` being its tokens ``[floor(j L / 2cp), floor((j + 1) L / 2cp))``; CP
rank ``c`` holds chunks ``c`` and ``2cp - 1 - c`` of every sequence, so each rank gets an early and a late
chunk and the causal work is balanced, as ``sim.cost`` prices it (1/cp of each feature per rank). Nothing is
padded: chunks differ by at most one token, and a rank's tokens are laid out sequence after sequence, its
two chunks of a sequence one after the other. Chunks are not block-aligned; the block layout stays the
whole sequence's (blocks from the sequence's start, the last one partial), so a block may be split between
two ranks. Every sequence must hold at least ``2 cp`` tokens (``runner.train`` refuses shorter workloads).

Attention (``make_cp_attention``), per layer:

1. Selection, without gradients: each rank sums its tokens' queries and keys per block of the whole
   micro-batch; one all-reduce over the cp group gives every rank the pooled query and key of every block
   (``[2, blocks, kv heads, head dim]`` floats, small next to a K/V shard). Each rank scores the rows of the
   query blocks it holds tokens of, with the kernel's own rule (``kernels.sparse_attention.row_rule``: top-p, kept
   fraction or top-k, with its floor, over softmax-normalised block scores, the diagonal always kept), so it
   attends under the sequence's selection. The rank holding a block's first token counts its row in the
   per-sequence kept fraction and coverage, and a second all-reduce sums those: the stats are the whole
   sequence's, as a cp = 1 run records them. A micro-batch whose budgets are all dense keeps every causal
   block without scoring (as the kernel).
2. Ring: the rank's K and V (one stacked tensor) travel ``cp - 1`` hops around the cp group (``isend`` to the
   next rank, ``irecv`` from the previous one). For each arriving shard the rank computes the attention
   piece of its own queries over that shard's keys, restricted to the same sequence, the selected blocks and
   causality by global position, returning the piece's output and log-sum-exp (``attention_piece``).
3. Merge: the pieces' outputs weighted by ``exp(lse_piece - logsumexp(lse_pieces))``.

Backward: every hop is a ``RingShift``, an autograd Function whose backward sends the gradient of the shard
it received back to the rank it came from; the pieces and the merge are plain differentiable torch. So
autograd carries each shard's dK/dV back around the same ring, ``cp - 1`` hops, adding every rank's share on
the way. The hops of one layer form one chain, and each layer's backward needs the next one's to finish, so
every rank runs its backward hops in the same order. The price of leaving the backward to autograd: each
layer holds every arriving shard (the whole sequence's K/V) and each piece's probabilities until its
backward, where a hand-written ring backward would hold only its own shard and recompute.

The pieces run in PyTorch (float32 math, as ``kernels.sparse_attention.naive``) on the CPU and the GPU: this
ring is the reference (``runner.attention=naive``). The runner's default CP attention is the kernel over
all-gathered keys and values (``runner.cp_kernel``), which needs no piece the kernel cannot compute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from sparsebalance.kernels.sparse_attention import VarlenBatch, keeps_every_block, row_rule
from sparsebalance.runner.attention import budget_keywords

__all__ = ["Ring", "Shards", "attention_piece", "make_cp_attention", "merge_pieces", "shard_bounds"]


# ---------------------------------------------------------------------- sharding
def shard_bounds(length: int, cp: int) -> np.ndarray:
    """``[2cp + 1]`` token offsets of a sequence's zigzag chunks (equal counts, remainders spread)."""
    return (np.arange(2 * cp + 1, dtype=np.int64) * length) // (2 * cp)


@dataclass(frozen=True, eq=False)
class Shards:
    """Which tokens of a packed micro-batch every CP rank holds; ``rank`` is this one."""

    docs: VarlenBatch  # the whole micro-batch's sequences
    cp: int
    rank: int
    index: tuple[torch.Tensor, ...]  # per rank: int64 indices into the packed stream, sequence-major
    offsets: tuple[tuple[int, ...], ...]  # per rank: where each sequence's tokens start locally [n+1]
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cu_seqlens, cp: int, rank: int) -> "Shards":
        docs = cu_seqlens if isinstance(cu_seqlens, VarlenBatch) else VarlenBatch.from_cu_seqlens(cu_seqlens)
        cu = docs.offsets
        index, offsets = [], []
        for r in range(cp):
            parts, local = [], [0]
            for start, end in zip(cu, cu[1:], strict=False):
                cuts = start + shard_bounds(end - start, cp)
                for j in (r, 2 * cp - 1 - r):
                    parts.append(np.arange(cuts[j], cuts[j + 1], dtype=np.int64))
                local.append(local[-1] + len(parts[-2]) + len(parts[-1]))
            index.append(torch.from_numpy(np.concatenate(parts)))
            offsets.append(tuple(local))
        return cls(docs, cp, rank, tuple(index), tuple(offsets))

    @property
    def mine(self) -> torch.Tensor:
        return self.index[self.rank]

    @property
    def num_docs(self) -> int:
        return self.docs.num_docs

    def tokens_of(self, rank: int) -> int:
        return int(self.index[rank].numel())

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """Each token's position inside its own sequence (RoPE uses the global position)."""
        rank = self.rank if rank is None else rank
        starts = torch.tensor(self.docs.offsets[:-1], dtype=torch.int64)
        counts = torch.diff(torch.tensor(self.offsets[rank], dtype=torch.int64))
        return self.index[rank] - torch.repeat_interleave(starts, counts)

    def local_index(self) -> torch.Tensor:
        """``[T]`` int64: each packed token's index among this rank's tokens, -1 where another rank holds it."""
        out = torch.full((self.docs.total_tokens,), -1, dtype=torch.int64)
        out[self.mine] = torch.arange(self.mine.numel())
        return out

    def geometry(self, block_size: int, device) -> "Geometry":
        """Per-rank positions and blocks for the attention, built once per micro-batch for every layer."""
        key = (int(block_size), str(torch.device(device)))
        geo = self._cache.get(key)
        if geo is None:
            geo = self._cache[key] = Geometry.build(self, block_size, torch.device(device))
        return geo


@dataclass(frozen=True)
class Geometry:
    """What the pieces need of every rank's tokens: per rank and sequence, positions in the sequence and the
    block inside the sequence (device tensors); this rank's query blocks per sequence."""

    layout: object  # kernels.sparse_attention.BlockLayout of the whole micro-batch
    positions: tuple[tuple[torch.Tensor, ...], ...]  # [rank][doc] int64 [t]
    blocks: tuple[tuple[torch.Tensor, ...], ...]  # [rank][doc] int64 [t], block index inside the sequence
    rows: tuple[torch.Tensor, ...]  # [doc] sorted blocks (inside the sequence) this rank holds tokens of
    row_of: tuple[torch.Tensor, ...]  # [doc] int64 [t]: each of this rank's tokens' index into rows[doc]
    owned: tuple[torch.Tensor, ...]  # [doc] bool [len(rows)]: the rank holds the block's first token

    @classmethod
    def build(cls, shards: Shards, block_size: int, device: torch.device) -> "Geometry":
        lay = shards.docs.layout(block_size, device)
        positions, blocks = [], []
        for r in range(shards.cp):
            pos, off = shards.positions(r), shards.offsets[r]
            # blocks start at each sequence's first token: a token's block inside its sequence is position // B
            positions.append(tuple(pos[a:b].to(device) for a, b in zip(off, off[1:], strict=False)))
            blocks.append(tuple((pos[a:b] // block_size).to(device) for a, b in zip(off, off[1:], strict=False)))
        rows, row_of, owned = [], [], []
        for d in range(shards.num_docs):
            mine = blocks[shards.rank][d]
            uniq = torch.unique(mine)  # sorted
            rows.append(uniq)
            row_of.append(torch.searchsorted(uniq, mine))
            owned.append(torch.isin(uniq, mine[positions[shards.rank][d] % block_size == 0]))
        return cls(lay, tuple(positions), tuple(blocks), tuple(rows), tuple(row_of), tuple(owned))


def shard_micro_batch(batch, cp: int, rank: int):
    """This CP rank's part of a packed ``runner.data.MicroBatch``: its tokens, the scored answers among them
    (indices into its own stream), and the ``Shards`` that the model and the attention read."""
    from sparsebalance.runner.data import MicroBatch

    shards = Shards.build(batch.cu_seqlens, cp, rank)
    device = batch.tokens.device
    local = shards.local_index()[batch.target_positions.cpu()]
    held = local >= 0
    return MicroBatch(
        tokens=batch.tokens[shards.mine.to(device)],
        cu_seqlens=batch.cu_seqlens,
        target_positions=local[held].to(device),
        targets=batch.targets[held.to(device)],
        p=batch.p,
        kept_fraction=batch.kept_fraction,
        shards=shards,
        top_k=batch.top_k,
    )


# ---------------------------------------------------------------------- the ring
@dataclass(frozen=True)
class Ring:
    """The cp group of one replica's stage: its process group and the global ranks in cp order."""

    group: object
    ranks: tuple[int, ...]
    rank: int  # this rank's cp index

    @property
    def size(self) -> int:
        return len(self.ranks)

    def exchange(self, tensor: torch.Tensor, shape, to: int, source: int) -> torch.Tensor:
        """Send ``tensor`` to cp rank ``to`` while receiving a tensor of ``shape`` from cp rank ``source``."""
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), self.ranks[to], self.group),
               dist.P2POp(dist.irecv, out, self.ranks[source], self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return out

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size


class RingShift(torch.autograd.Function):
    """One hop: the tensor goes to the next rank, the previous rank's (of ``shape``) comes in; the backward
    sends the gradient of what came in back to the previous rank and receives the gradient of what went out
    from the next one."""

    @staticmethod
    def forward(ctx, tensor, ring: Ring, shape):
        ctx.ring, ctx.shape = ring, tensor.shape
        return ring.exchange(tensor.detach(), shape, ring.next, ring.prev)

    @staticmethod
    def backward(ctx, grad):
        ring = ctx.ring
        return ring.exchange(grad, ctx.shape, ring.prev, ring.next), None, None


# ---------------------------------------------------------------------- pieces
def attention_piece(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries ``q [tq, Hq, D]`` over keys/values ``k, v [tk, Hkv, D]`` where ``mask [Hkv, tq, tk]``
    allows it: float32 output ``[tq, Hq, D]``, normalised over the piece's keys, and its log-sum-exp ``[tq, Hq]``.
    A query with no allowed key gets output 0 and log-sum-exp -inf, and no NaN in either direction."""
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    if tq == 0 or k.shape[0] == 0:
        return q.new_zeros(tq, hq, d, dtype=torch.float32), q.new_full((tq, hq), -math.inf, dtype=torch.float32)
    qd = q.float().transpose(0, 1)
    kd = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vd = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    allowed = mask.repeat_interleave(group, dim=0)
    scores = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    top = scores.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, 0.0)
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    some = total > 0
    total = torch.where(some, total, 1.0)
    out = (weights @ vd) / total
    lse = torch.where(some, top + torch.log(total), -math.inf)
    return out.transpose(0, 1), lse.squeeze(-1).transpose(0, 1)


def merge_pieces(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """The attention over the union of the pieces' keys: each piece weighted by its share of the softmax
    mass, ``exp(lse_i - logsumexp_j lse_j)`` (every query attends at least to itself, so the total is finite)."""
    lse = torch.stack(lses)
    total = torch.logsumexp(lse, dim=0)
    share = torch.exp(lse - total)
    return sum(s[..., None] * o for s, o in zip(share, outs, strict=True))


# ---------------------------------------------------------------------- selection
@dataclass(frozen=True)
class RowSelection:
    """This rank's rows of the sequences' block selection: per sequence a ``[Hkv, rows, blocks]`` mask over
    its blocks (None: dense, every causal block), and the whole sequences' kept fraction and coverage."""

    masks: tuple
    kept_fraction: torch.Tensor
    coverage: torch.Tensor


@torch.no_grad()
def select_rows(q, k, shards: Shards, geo: Geometry, budgets, ring: Ring, scale: float) -> RowSelection:
    """The kernel's selection rule over pooled blocks of the whole micro-batch, for this rank's query blocks;
    ``budgets`` as ``runner.attention.budget_keywords`` takes them."""
    lay, n, hkv = geo.layout, shards.num_docs, k.shape[1]
    budgets = budget_keywords(budgets)
    if keeps_every_block(lay.doc_nblocks, **budgets):
        ones = torch.ones(n, dtype=torch.float32, device=q.device)
        return RowSelection((None,) * n, ones, ones)
    qbar, kbar = _pooled(q, k, shards, lay, ring)
    rule = row_rule(n, q.device, **budgets)
    stats = torch.zeros(2, n, dtype=torch.float32, device=q.device)  # kept blocks, kept mass of owned rows
    masks = []
    for d in range(n):
        first, nb = lay.doc_first_block[d], lay.doc_nblocks[d]
        rows = geo.rows[d]
        cols = torch.arange(nb, device=q.device)
        scores = qbar[first + rows].transpose(0, 1) @ kbar[first:first + nb].permute(1, 2, 0) * scale
        valid = cols[None, :] <= rows[:, None]  # [R, nb]
        prob = torch.softmax(scores.masked_fill(~valid, -math.inf), dim=-1)[None]  # [1, Hkv, R, nb]
        diag = (cols[None, :] == rows[:, None])[None, None]
        validh = valid[None, None].expand_as(prob)
        keep = rule.at(slice(d, d + 1)).keep(prob, rows, cols, diag, validh)
        keep = (keep | diag) & validh
        owned = geo.owned[d]
        stats[0, d] = keep[0][:, owned].sum()
        stats[1, d] = (prob * keep)[0][:, owned].sum()
        masks.append(keep[0])
    dist.all_reduce(stats, group=ring.group)
    return RowSelection(tuple(masks), stats[0] / (lay.doc_causal_t * hkv), stats[1] / (lay.doc_nblocks_t * hkv))


def _pooled(q, k, shards: Shards, lay, ring: Ring):
    """Mean query (over the KV group's heads too) and key of every block ``[NB, Hkv, D]``: this rank's partial
    sums, then one all-reduce over the cp group (a block split between two ranks gets both parts)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    blocks = lay.token_block[shards.mine.to(lay.token_block.device)]
    sums = torch.zeros(2, lay.num_blocks, hkv, d, dtype=torch.float32, device=q.device)
    sums[0].index_add_(0, blocks, q.detach().view(t, hkv, hq // hkv, d).float().sum(2))
    sums[1].index_add_(0, blocks, k.detach().float())
    dist.all_reduce(sums, group=ring.group)
    count = (lay.block_end - lay.block_start).to(torch.float32)
    return sums[0] / (count * (hq // hkv))[:, None, None], sums[1] / count[:, None, None]


# ---------------------------------------------------------------------- the attention
def make_cp_attention(block_size: int, ring: Ring):
    """``attend(q, k, v, shards, budgets) -> (o, kept [n], coverage [n])`` over this rank's tokens
    (``sparsebalance.model.AttentionFn``), ``shards`` the micro-batch's ``Shards``."""

    def attend(q, k, v, shards: Shards, budgets):
        scale = 1.0 / math.sqrt(q.shape[-1])
        geo = shards.geometry(block_size, q.device)
        selection = select_rows(q, k, shards, geo, budgets, ring, scale)
        kv = torch.stack((k, v))
        outs, lses = [], []
        for hop in range(ring.size):
            source = (ring.rank - hop) % ring.size
            if hop:
                kv = RingShift.apply(kv, ring, (2, shards.tokens_of(source), *k.shape[1:]))
            o, lse = _pieces(q, kv, shards, geo, selection, source, scale)
            outs.append(o)
            lses.append(lse)
        return merge_pieces(outs, lses).to(q.dtype), selection.kept_fraction, selection.coverage

    return attend


def _pieces(q, kv, shards: Shards, geo: Geometry, selection: RowSelection, source: int, scale: float):
    """This rank's queries over the shard of cp rank ``source``, sequence by sequence: output and lse."""
    me = shards.rank
    mine, theirs = shards.offsets[me], shards.offsets[source]
    outs, lses = [], []
    for d in range(shards.num_docs):
        qd = q[mine[d]:mine[d + 1]]
        kd, vd = kv[:, theirs[d]:theirs[d + 1]]
        mask = geo.positions[source][d][None, :] <= geo.positions[me][d][:, None]  # causal, [tq, tk]
        rows = selection.masks[d]
        if rows is not None:
            mask = rows[:, geo.row_of[d]][:, :, geo.blocks[source][d]] & mask
        else:
            mask = mask.expand(kd.shape[1], -1, -1)
        o, lse = attention_piece(qd, kd, vd, mask, scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
