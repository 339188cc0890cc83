"""Pipeline-aware micro-batching (``pipeline_order: fit``): sequences moved between micro-batches, and
swapped between DP ranks, while the 1F1B time falls.

Balanced micro-batches are not what a 1F1B pipeline wants: the first micro-batch's forward and the last
one's backward cross every stage alone (warm-up and cool-down), so a rank whose first and last
micro-batches are light finishes sooner than one with equal micro-batches of the same total. Starting
from a packed and ordered plan, a local search therefore works on the rank times themselves, priced with
the CostModel (its per-micro-batch overheads included) at the policy's expected kept fractions and timed
with the engine's 1F1B schedule (``sim.pipeline.pipeline_ms``):

1. within every rank at once: the best single move of a sequence to another micro-batch, or swap of two
   sequences of different micro-batches, while it shortens that rank's time (a rank keeps its
   sequences; micro-batch sizes vary, as verl's dynamic batches do);
2. between ranks: the best swap of a sequence of the slowest rank with one of another rank (each takes
   the other's micro-batch slot) that brings both below the slowest rank's time; then step 1 again on
   the two ranks. Per-rank sequence counts are kept.

Every accepted step strictly shortens a rank (step 1) or the slowest rank (step 2), so the search ends;
``MAX_ROUNDS`` bounds it.
"""
from __future__ import annotations

from itertools import combinations

import numpy as np

from sparsebalance.sim.pipeline import pipeline_ms
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.plan import Plan

MAX_ROUNDS = 64  # of each of the two steps
TOLERANCE = 1e-9  # relative: an improvement smaller than this is none


class RankTimer:
    """1F1B times of candidate micro-batch assignments of some ranks' sequences."""

    def __init__(self, lengths: np.ndarray, kept: np.ndarray, layout: Layout, cost: CostModel) -> None:
        self.lengths, self.kept, self.layout, self.cost = lengths, kept, layout, cost

    def times(self, members: list[np.ndarray], slots: list[np.ndarray]) -> np.ndarray:
        """members[c]: sequence indices of candidate c (one rank's worth), slots[c]: their micro-batches."""
        m = self.layout.micro_batches
        idx = np.concatenate(members)
        group = np.concatenate([c * m + s for c, s in enumerate(slots)])
        costs = self.cost.micro_batch_costs(self.lengths[idx], self.kept[idx], group, len(members) * m, self.layout)
        shape = (len(members), m)
        p2p = self.cost.hand_off_ms(costs.tokens, self.layout).reshape(shape)
        return pipeline_ms(costs.fwd_ms.reshape(shape), costs.bwd_ms.reshape(shape), p2p, self.layout.pp)


def within_rank_candidates(slots: np.ndarray, m: int) -> list[np.ndarray]:
    """The rank's assignment itself first, then every single move and every swap across micro-batches."""
    out = [slots]
    for i, j in np.ndindex(slots.size, m):
        if slots[i] != j:
            moved = slots.copy()
            moved[i] = j
            out.append(moved)
    for i, k in combinations(range(slots.size), 2):
        if slots[i] != slots[k]:
            swapped = slots.copy()
            swapped[i], swapped[k] = slots[k], slots[i]
            out.append(swapped)
    return out


def improve_ranks(timer: RankTimer, rank: np.ndarray, mb: np.ndarray, ranks: list[int]) -> None:
    """Step 1 on the given ranks, all at once, in place on ``mb``."""
    m = timer.layout.micro_batches
    active = [r for r in ranks if (rank == r).sum() > 1]
    for _ in range(MAX_ROUNDS):
        if not active:
            return
        blocks = []
        for r in active:
            members = np.flatnonzero(rank == r)
            blocks.append((members, within_rank_candidates(mb[members], m)))
        times = timer.times([members for members, cands in blocks for _ in cands],
                            [c for _, cands in blocks for c in cands])
        still, start = [], 0
        for r, (members, cands) in zip(active, blocks, strict=True):
            block = times[start : start + len(cands)]
            start += len(cands)
            best = int(np.argmin(block))
            if block[best] < block[0] * (1 - TOLERANCE):
                mb[members] = cands[best]
                still.append(r)
        active = still


def rank_times(timer: RankTimer, rank: np.ndarray, mb: np.ndarray, dp: int) -> np.ndarray:
    members = [np.flatnonzero(rank == r) for r in range(dp)]
    return timer.times(members, [mb[idx] for idx in members])


def swap_between_ranks(timer: RankTimer, rank: np.ndarray, mb: np.ndarray, dp: int) -> None:
    """Step 2 until the slowest rank cannot be shortened by one swap, in place on ``rank`` and ``mb``."""
    for _ in range(MAX_ROUNDS):
        times = rank_times(timer, rank, mb, dp)
        slow = int(np.argmax(times))
        mine, others = np.flatnonzero(rank == slow), np.flatnonzero(rank != slow)
        if not mine.size or not others.size:
            return
        pairs = [(i, k) for i in mine for k in others]
        members, slots = [], []
        for i, k in pairs:  # the slow rank with k instead of i, then k's rank with i instead of k
            for r, out, into in ((slow, i, k), (int(rank[k]), k, i)):
                idx = np.flatnonzero(rank == r)
                members.append(np.where(idx == out, into, idx))
                slots.append(mb[idx])
        after = timer.times(members, slots).reshape(len(pairs), 2).max(axis=1)
        best = int(np.argmin(after))
        if after[best] >= times[slow] * (1 - TOLERANCE):
            return
        i, k = pairs[best]
        other = int(rank[k])
        rank[i], rank[k] = other, slow
        mb[i], mb[k] = mb[k], mb[i]
        improve_ranks(timer, rank, mb, [slow, other])


def fitted(plan: Plan, layout: Layout, cost: CostModel, kept: np.ndarray) -> Plan:
    """The plan after steps 1 and 2; ``kept``: each assignment's expected kept fraction (plan order)."""
    rank, mb = plan.dp_ranks.copy(), plan.micro_batch_ids.copy()
    timer = RankTimer(plan.lengths, np.asarray(kept, dtype=np.float64), layout, cost)
    improve_ranks(timer, rank, mb, list(range(layout.dp)))
    if layout.dp > 1:
        swap_between_ranks(timer, rank, mb, layout.dp)
    return plan.placed(rank, mb)
