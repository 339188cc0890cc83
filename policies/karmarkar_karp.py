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
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from policies.base import PartitionPolicy, register_batching
from policies.lpt import lpt_partition


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


def ldm_partition(costs: np.ndarray, k: int, equal_count: bool) -> list[list[int]]:
    """Parts as index lists; within a tuple loads stay sorted heaviest first."""
    tuples = _initial_tuples(costs, k, equal_count)
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
        sums = [x + y for x, y in zip(loads_a, reversed(loads_b))]
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
    class Params:
        equal_count: bool = True  # every rank / micro-batch gets the same number of sequences

    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        return kk_partition(costs, k, self.params.equal_count)


def makespan(costs: np.ndarray, parts: list[list[int]]) -> float:
    return max((float(costs[p].sum()) for p in parts), default=0.0)


def kk_partition(costs: np.ndarray, k: int, equal_count: bool) -> list[list[int]]:
    ldm = ldm_partition(costs, k, equal_count)
    if equal_count:
        return ldm  # LPT ignores the count constraint, so it is no valid alternative here
    lpt = lpt_partition(costs, k)
    return ldm if makespan(costs, ldm) <= makespan(costs, lpt) else lpt
