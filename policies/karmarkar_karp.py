"""``karmarkar_karp``: the largest differencing method (Karmarkar & Karp 1982) for k-way partitioning.

Every item starts as a k-tuple of partial parts; repeatedly the two tuples with the largest spread
(max - min load) are merged, pairing the heavier parts of one with the lighter parts of the other,
so large differences cancel early. ``equal_count`` starts from tuples that already hold one item per
part (the balanced variant used by length-balanced batching), so every part ends with the same number
of sequences (padding with zero-cost placeholders when k does not divide n).

LDM is better than greedy LPT on average but not on every instance (e.g. costs
[1, 1, 1, 103, 47, 55, 247, 249, 343, 485, 295, 340] into 3 parts: LDM 739, LPT 737), so the
free-count variant also runs LPT (O(n log k), cheap next to LDM) and keeps the lower makespan:
this policy is then never worse than ``lpt``.

Equal-count LDM can still be far from the optimum on long-tailed costs (a few heavy items that the
fixed count forces together), so ``refine`` follows it with a local search (``refined``): the heaviest
part swaps one item with any other part, or hands one item to another part (free count, or a part one
item larger than the other under equal counts), whichever lowers the larger of the two loads most, until
no such exchange lowers the makespan. On few items (a rank's micro-batches), where single items are
coarse, an exchange may move a bundle of up to two items each way (``refined_small``, pure Python: on
a handful of items numpy's call overhead dominates). A local search can stop in a local optimum (9
long-tailed items in 3 equal parts: 70.27 against the optimum 68.93), so on up to ``EXACT_ITEMS`` items a
branch and bound (``exact_partition``) then searches every assignment from the local search's makespan
down, within ``EXACT_NODES`` nodes; the result is never worse than the local search's.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from sparsebalance.policies.base import PartitionParams, PartitionPolicy

from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.policy import register_batching
from sparsebalance.policies.lpt import lpt_partition

MAX_EXCHANGES_PER_ITEM = 4  # bounds the local search; every exchange strictly lowers the heaviest load
# Many items: stop within this share above the even spread, a lower bound of the optimum (on many items
# the search gets there, one near-heaviest part per exchange, and the last exchanges buy almost nothing).
CLOSE_ENOUGH = 1e-3
LIGHT_PARTS = 16  # many parts: the heaviest exchanges with the lightest of them only
MAX_SWEEPS = 32  # paired sweeps before the heaviest part's exchanges (each sweep strictly lowers a pair)
BUNDLE_ITEMS = 32  # up to this many items exchanges may also take two items from a part at once
EXACT_ITEMS = 12  # up to this many items the branch and bound runs after the local search
EXACT_NODES = 5_000  # its bound on search nodes (a few ms in Python); past it the best assignment found stays


def _initial_tuples(costs: np.ndarray, k: int, equal_count: bool) -> list[tuple[list[float], list[list[int]]]]:
    order = np.argsort(-costs, kind="stable").tolist()
    costs = costs.tolist()  # Python floats: this runs once per rank and step, numpy scalars are slow here
    if not equal_count:
        return [([costs[i]] + [0.0] * (k - 1), [[i]] + [[] for _ in range(k - 1)]) for i in order]
    pad = -len(order) % k  # zero-cost placeholders (empty members) complete the last tuple
    loads = [costs[i] for i in order] + [0.0] * pad
    members = [[i] for i in order] + [[] for _ in range(pad)]
    # Consecutive chunks of descending costs, so every tuple is sorted heaviest first.
    return [(loads[start : start + k], members[start : start + k]) for start in range(0, len(loads), k)]


def ldm_partition(costs, k: int, equal_count: bool) -> list[list[int]]:
    """Public: ``costs`` (a list or array, e.g. sequence lengths or workloads) into ``k`` parts, as sorted index
    lists, by the largest differencing method; ``equal_count``: every part the same number of items (the last
    ones padded). The shape of verl's ``get_seqlen_balanced_partitions(seqlen_list, k_partitions, equal_size)``,
    which ``benchmarks.plan_overhead`` times it as. Within a tuple loads stay sorted heaviest first."""
    tuples = _initial_tuples(np.asarray(costs, dtype=np.float64), k, equal_count)
    if len(tuples) == 1:  # common inside a rank (micro-batches of one sequence): nothing to merge
        return [sorted(part) for part in tuples[0][1]]
    heap = []
    for n, (loads, members) in enumerate(tuples):
        heap.append((loads[-1] - loads[0], n, loads, members))  # key: minus the spread
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, loads_a, members_a = heapq.heappop(heap)
        _, _, loads_b, members_b = heapq.heappop(heap)
        sums = [x + y for x, y in zip(loads_a, reversed(loads_b), strict=True)]
        members_b = members_b[::-1]  # paired as the loads: the heavier parts of a with the lighter parts of b
        # Heaviest first; reverse=True keeps equal loads in pairing order, as a stable sort on -load does.
        order = sorted(range(k), key=sums.__getitem__, reverse=True)
        loads = [sums[i] for i in order]
        heapq.heappush(heap, (loads[-1] - loads[0], counter, loads, [members_a[i] + members_b[i] for i in order]))
        counter += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(part) for part in heap[0][3]]


@register_batching("karmarkar_karp")
class KarmarkarKarp(PartitionPolicy):
    @dataclass(frozen=True)
    class Params(PartitionParams):
        equal_count: bool = True  # every rank / micro-batch gets the same number of sequences
        refine: bool = False  # local search after LDM (swaps, and moves when the count is free)

    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        return kk_partition(costs, k, self.params.equal_count, self.params.refine)

    def rank_partition(self, costs: np.ndarray, k: int, layout: Layout) -> list[list[int]]:
        # With pp = 1 a rank's time is the sum of its micro-batches however they are cut: no refinement.
        return kk_partition(costs, k, self.params.equal_count, self.params.refine and layout.pp > 1)


def makespan(costs: np.ndarray, parts: list[list[int]]) -> float:
    return max((float(costs[p].sum()) for p in parts), default=0.0)


def kk_partition(costs: np.ndarray, k: int, equal_count: bool, refine: bool = False) -> list[list[int]]:
    parts = ldm_partition(costs, k, equal_count)
    if not equal_count:  # LPT ignores the count constraint, so it is an alternative only without it
        lpt = lpt_partition(costs, k)
        parts = parts if makespan(costs, parts) <= makespan(costs, lpt) else lpt
    return refined_partition(costs, parts, equal_count) if refine else parts


def refined_partition(costs: np.ndarray, parts: list[list[int]], equal_count: bool) -> list[list[int]]:
    """The local search that suits the input's size (see the module docstring)."""
    if costs.size <= EXACT_ITEMS:
        values = costs.tolist()
        return exact_partition(values, refined_small(values, parts, equal_count), equal_count)
    if costs.size <= BUNDLE_ITEMS:
        return refined_small(costs.tolist(), parts, equal_count)
    return refined(costs, parts, equal_count)


def refined(costs: np.ndarray, parts: list[list[int]], equal_count: bool) -> list[list[int]]:
    """Local search from ``parts``: exchanges between the heaviest part and the ``LIGHT_PARTS`` lightest.

    Each step takes the exchange (one item of the heaviest part for one item of another part, or one item
    of the heaviest part moved to another: with a free count, or under ``equal_count`` to a part with fewer
    items) that minimises the larger of the two new loads, if that is below the heaviest load; so the
    sorted load vector falls lexicographically and the search ends (at the latest within ``CLOSE_ENOUGH``
    of the even spread). Execution order inside a part is by index.
    """
    k, n = len(parts), costs.size
    if k < 2 or n < 2:
        return parts
    part_of = np.empty(n, dtype=np.int64)
    for j, members in enumerate(parts):
        part_of[members] = j
    loads = paired_sweeps(costs, part_of, k, equal_count)
    good_enough = loads.sum() / k * (1 + CLOSE_ENOUGH)
    for _ in range(MAX_EXCHANGES_PER_ITEM * n):
        heavy = int(np.argmax(loads))
        top = loads[heavy]
        if top <= good_enough:
            break
        partners = np.zeros(k, dtype=bool)  # the lightest parts: where an exchange has room
        lighter = np.argsort(loads, kind="stable")[: LIGHT_PARTS + 1]
        partners[lighter[lighter != heavy][:LIGHT_PARTS]] = True
        mine, rest = np.flatnonzero(part_of == heavy), np.flatnonzero(partners[part_of])
        gain, best, move = 0.0, None, None
        if rest.size:
            delta = costs[mine][:, None] - costs[rest][None, :]  # load the heavy part sheds in a swap
            swap = np.maximum(top - delta, loads[part_of[rest]][None, :] + delta)
            best, gain = np.unravel_index(np.argmin(swap), swap.shape), top - swap.min()
        counts = np.bincount(part_of, minlength=k)
        open_parts = partners & (counts < counts[heavy] if equal_count else True)  # counts stay within one
        if open_parts.any():
            sizes = costs[mine][:, None]
            moved = np.maximum(top - sizes, loads[None, :] + sizes)
            moved[:, ~open_parts] = np.inf
            if top - moved.min() > gain:
                move = np.unravel_index(np.argmin(moved), moved.shape)
                gain = top - moved.min()
        if gain <= top * 1e-12:
            break
        if move is not None:
            item, target = int(mine[move[0]]), int(move[1])
            loads[heavy] -= costs[item]
            loads[target] += costs[item]
            part_of[item] = target
        else:
            item, other = int(mine[best[0]]), int(rest[best[1]])
            target = int(part_of[other])
            shift = costs[item] - costs[other]
            loads[heavy] -= shift
            loads[target] += shift
            part_of[item], part_of[other] = target, heavy
    return [np.flatnonzero(part_of == j).tolist() for j in range(k)]



def paired_sweeps(costs: np.ndarray, part_of: np.ndarray, k: int, equal_count: bool) -> np.ndarray:
    """Sweeps that pair the parts heaviest with lightest, second heaviest with second lightest and so on,
    and make in every pair at once its best single swap (or, free count, move from the heavier part) if
    that lowers the pair's larger load; until a sweep changes nothing. Cheap on many parts (one numpy
    pass per sweep), it leaves the exchanges with the heaviest part little to do. Updates ``part_of`` in
    place; returns the loads."""
    loads = np.bincount(part_of, weights=costs, minlength=k)
    for _ in range(MAX_SWEEPS):
        order = np.argsort(loads, kind="stable")
        heavy, light = order[::-1][: k // 2], order[: k // 2]
        members = padded_members(part_of, k)
        pad_heavy = np.where(members[heavy] >= 0, costs[members[heavy]], -np.inf)  # padding gives nothing
        pad_light = np.where(members[light] >= 0, costs[members[light]], np.inf if equal_count else 0.0)
        delta = pad_heavy[:, :, None] - pad_light[:, None, :]  # [pairs, slot of heavy, slot of light]
        worse = np.maximum(loads[heavy][:, None, None] - delta, loads[light][:, None, None] + delta)
        flat = worse.reshape(len(heavy), -1)
        pick = np.argmin(flat, axis=1)
        better = flat[np.arange(len(heavy)), pick] < loads[heavy] * (1 - 1e-12)
        if not better.any():
            break
        out, back = np.unravel_index(pick[better], worse.shape[1:])
        given, taken = members[heavy[better], out], members[light[better], back]
        part_of[given] = light[better]
        part_of[taken[taken >= 0]] = heavy[better][taken >= 0]
        loads = np.bincount(part_of, weights=costs, minlength=k)
    return loads


def padded_members(part_of: np.ndarray, k: int) -> np.ndarray:
    """[k, largest part + 1] item indices per part, -1 padded (one free slot at least: room for a move)."""
    order = np.argsort(part_of, kind="stable")
    counts = np.bincount(part_of, minlength=k)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    slot = np.arange(part_of.size) - np.repeat(starts, counts)
    members = np.full((k, counts.max() + 1), -1, dtype=np.int64)
    members[part_of[order], slot] = order
    return members


def refined_small(costs: list[float], parts: list[list[int]], equal_count: bool) -> list[list[int]]:
    """``refined`` with bundles: a part gives up to two items and takes up to two from another part
    (counts kept within one of each other under ``equal_count``). The heaviest part's best exchange
    first; when it has none, the best exchange that lowers the heavier load of any other pair of parts
    (the sum of squared loads falls, so this ends too), which can open a way for the heaviest."""
    parts = [list(p) for p in parts]
    k, n = len(parts), len(costs)
    if k < 2 or n < 2:
        return parts
    low, high = n // k, -(-n // k)
    loads = [sum(costs[i] for i in p) for p in parts]

    def best_exchange(a: int, others) -> tuple[float, tuple] | None:
        """The exchange between part a and one of others that minimises the larger new load, if it is
        below both parts' current larger load."""
        give = bundles(parts[a], costs)
        found = None
        size_a = len(parts[a])
        for b in others:
            limit = max(loads[a], loads[b]) * (1 - 1e-12)
            if found is not None:
                limit = min(limit, found[0])
            take, size_b, load_a, load_b = bundles(parts[b], costs), len(parts[b]), loads[a], loads[b]
            for out, out_v in give:
                for back, back_v in take:
                    shift = len(out) - len(back)
                    if equal_count and not (low <= size_a - shift <= high and low <= size_b + shift <= high):
                        continue
                    worse = max(load_a - out_v + back_v, load_b + out_v - back_v)
                    if worse < limit and (out or back):
                        limit, found = worse, (worse, (a, b, out, back, out_v - back_v))
        return found

    even = sum(loads) / k * (1 + 1e-12)  # no makespan below the even spread: stop there
    for _ in range(MAX_EXCHANGES_PER_ITEM * n):
        heavy = max(range(k), key=loads.__getitem__)
        if loads[heavy] <= even:
            break
        found = best_exchange(heavy, [b for b in range(k) if b != heavy])
        for a in sorted(range(k), key=loads.__getitem__, reverse=True)[1:] if found is None else ():
            found = best_exchange(a, [b for b in range(k) if b != heavy and loads[b] < loads[a]])
            if found is not None:
                break
        if found is None:
            break
        a, b, out, back, shift_v = found[1]
        parts[a] = [i for i in parts[a] if i not in out] + list(back)
        parts[b] = [i for i in parts[b] if i not in back] + list(out)
        loads[a] -= shift_v
        loads[b] += shift_v
    return [sorted(p) for p in parts]


def bundles(members: list[int], costs: list[float]) -> list[tuple[tuple[int, ...], float]]:
    """Every set of at most two of the members (the empty one too) with its total cost."""
    out = [((), 0.0)] + [((i,), costs[i]) for i in members]
    return out + [((i, j), costs[i] + costs[j]) for a, i in enumerate(members) for j in members[a + 1:]]


def exact_partition(costs: list[float], parts: list[list[int]], equal_count: bool,
                    max_nodes: int = EXACT_NODES) -> list[list[int]]:
    """The least-makespan assignment, by depth-first branch and bound from ``parts`` (the incumbent).

    Items go heaviest first to each part in turn; a branch ends where a part's load would reach the
    incumbent's makespan, and parts of equal load and count are interchangeable, so only the first of them
    is tried. Under ``equal_count`` a part holds at most ceil(n / k) items and only n mod k parts (all,
    when k divides n) may reach that many. The search stops at the lower bound (the even spread or the
    heaviest item) or after ``max_nodes`` nodes, keeping the best assignment found."""
    k, n = len(parts), len(costs)
    best_parts = [sorted(p) for p in parts]
    best = max(sum(costs[i] for i in p) for p in parts) if parts else 0.0
    if k < 2 or n < 2:
        return best_parts
    order = sorted(range(n), key=lambda i: -costs[i])
    bound = max(sum(costs) / k, costs[order[0]]) * (1 + 1e-12)
    if best <= bound:
        return best_parts
    low, high = n // k, -(-n // k)
    full_limit = n - k * low if high > low else k  # parts that may hold `high` items
    loads, counts, owner = [0.0] * k, [0] * k, [0] * n
    nodes = 0

    def place(depth: int, full: int) -> bool:
        """Assign order[depth:]; True when the search must stop (lower bound reached or nodes spent)."""
        nonlocal best, best_parts, nodes
        if depth == n:
            makespan_now = max(loads)
            if makespan_now < best * (1 - 1e-12):
                best = makespan_now
                best_parts = [sorted(i for i in range(n) if owner[i] == j) for j in range(k)]
            return best <= bound
        nodes += 1
        if nodes > max_nodes:
            return True
        item = order[depth]
        tried = set()
        for j in sorted(range(k), key=loads.__getitem__):  # lightest first: good assignments early
            key = (loads[j], counts[j] if equal_count else 0)
            if key in tried or loads[j] + costs[item] >= best * (1 - 1e-12):
                continue
            if equal_count and (counts[j] == high or (counts[j] + 1 == high and high > low and full == full_limit)):
                continue
            tried.add(key)
            loads[j] += costs[item]
            counts[j] += 1
            owner[item] = j
            stop = place(depth + 1, full + (equal_count and counts[j] == high and high > low))
            loads[j] -= costs[item]
            counts[j] -= 1
            if stop:
                return True
        return False

    place(0, 0)
    return best_parts
