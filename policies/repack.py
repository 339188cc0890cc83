"""``repack``: the built-in batching policies' memory repair (``fit_memory``), a placement heuristic that moves
sequences between micro-batches, and ranks, until every GPU's peak fits its HBM (sim.memory prices the peaks)."""
from __future__ import annotations

import numpy as np

from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.memory import MemoryModel, PlanRows, plan_rows
from sparsebalance.sim.plan import Plan

MAX_TARGET_RANKS = 8  # a cross-rank move tries the ranks with the lowest peaks only


def repack(plan: Plan, memory: MemoryModel, cost: CostModel) -> Plan:
    """Move sequences off the most overfull rank until every rank fits or no move helps.

    A rank's overflow is the sum, over its micro-batches and stages, of the bytes above the available ones.
    Each move takes one sequence of the worst rank to another micro-batch, the one that lowers the two
    ranks' overflow most (ties: the lower peak, then the first candidate in (longest sequence, rank,
    micro-batch) order, so repairs are deterministic): first inside the rank, which leaves the DP split and
    so the balance of the ranks' work untouched, and only when no such move helps to another rank (the
    MAX_TARGET_RANKS with the lowest peaks). Every move lowers the total overflow, so the search ends."""
    rows = plan_rows(plan, cost)
    rank, mb = rows.rank.copy(), rows.micro_batch.copy()
    state = [_rank_state(memory, rows, np.flatnonzero(rank == r), mb) for r in range(memory.layout.dp)]
    for _ in range(4 * len(plan)):
        worst = max(range(len(state)), key=lambda r: state[r][0])
        if state[worst][0] <= 0:
            break
        move = _best_move(memory, rows, rank, mb, state, worst, inside=True) or \
            _best_move(memory, rows, rank, mb, state, worst, inside=False)
        if move is None:
            break
        i, target, j, new_worst, new_target = move
        rank[i], mb[i] = target, j
        state[worst], state[target] = new_worst, new_target
    return plan.placed(rank, mb)


def _rank_state(memory: MemoryModel, rows: PlanRows, members: np.ndarray, mb: np.ndarray) -> tuple[float, float]:
    """(overflow bytes, peak bytes) of one rank holding the sequences ``members`` at micro-batches ``mb``."""
    m, pp = memory.layout.micro_batches, memory.layout.pp
    held, transient = memory.micro_batch_bytes(rows.length[members], rows.kept[members], mb[members], m,
                                               rows.topk[members])
    nbytes = memory.stage_bytes(held.reshape(1, m, pp), transient.reshape(1, m, pp))
    return float(np.maximum(nbytes - memory.available_bytes, 0.0).sum()), float(nbytes.max())


def _best_move(memory, rows, rank, mb, state, worst: int, inside: bool):
    """(sequence, target rank, target micro-batch, new worst-rank state, new target state) or None."""
    mine = np.flatnonzero(rank == worst)
    by_peak = sorted((r for r in range(len(state)) if r != worst), key=lambda r: state[r][1])
    best, best_key = None, None
    for i in mine[np.argsort(-rows.length[mine], kind="stable")].tolist():
        for target in [worst] if inside else by_peak[:MAX_TARGET_RANKS]:
            now = (state[worst][0] + (state[target][0] if target != worst else 0.0),
                   max(state[worst][1], state[target][1]))
            for j in range(memory.layout.micro_batches):
                if target == worst and j == mb[i]:
                    continue
                trial = mb.copy()
                trial[i] = j
                if inside:
                    new_worst = new_target = _rank_state(memory, rows, mine, trial)
                    key = new_worst
                else:
                    new_worst = _rank_state(memory, rows, mine[mine != i], trial)
                    new_target = _rank_state(memory, rows, np.append(np.flatnonzero(rank == target), i), trial)
                    key = (new_worst[0] + new_target[0], max(new_worst[1], new_target[1]))
                if key < now and (best_key is None or key < best_key):
                    best, best_key = (i, target, j, new_worst, new_target), key
    return best
