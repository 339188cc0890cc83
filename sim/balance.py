"""Sequence balancing that needs numpy only: the largest differencing method (Karmarkar & Karp 1982) for k-way
partitioning, verl's workload estimate and its micro-batch order. The batching policies build on these
(policies/karmarkar_karp.py, policies/verl.py), and so does the library's front door (``sparsebalance.partition``),
which must import without the simulator's configuration stack.

LDM: every item starts as a k-tuple of partial parts; repeatedly the two tuples with the largest spread (max - min
load) are merged, pairing the heavier parts of one with the lighter parts of the other, so large differences cancel
early. ``equal_count`` starts from tuples that already hold one item per part, so every part ends with the same
number of items (padding with zero-cost placeholders when k does not divide n).
"""
from __future__ import annotations

import heapq

import numpy as np

LINEAR_WEIGHT = 24576  # verl's calculate_workload: 24576 * seqlen + seqlen ** 2


def verl_workload(lengths: np.ndarray) -> np.ndarray:
    """verl's workload estimate of each sequence: dense-block FLOPs ``12 h^2 L + 2 h L^2`` over ``2 h`` at
    h = 4096, whatever the model."""
    lengths = lengths.astype(np.float64)
    return LINEAR_WEIGHT * lengths + lengths**2


def verl_order(loads) -> list[int]:
    """Micro-batches heaviest first, then every other one reversed followed by the rest: the lightest at
    both ends of the pipeline and the heaviest in the middle, where the steady state hides it (verl)."""
    by_load = sorted(range(len(loads)), key=lambda j: (loads[j], j), reverse=True)
    return by_load[::2][::-1] + by_load[1::2]


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
    """Public, in the shape of verl's ``get_seqlen_balanced_partitions(seqlen_list, k_partitions, equal_size)``:
    ``costs`` (a list or array: sequence lengths, or workloads such as :func:`verl_workload`) into ``k`` parts,
    returned as ``k`` index lists, each sorted. ``equal_count``: every part holds the same number of items. Where
    verl asserts, this pads: with fewer items than parts some come back empty, and with a count ``k`` does not
    divide the last parts hold one item fewer. ``benchmarks.plan_overhead`` and ``benchmarks.front_door`` time
    the planners against it as verl's balancer. Within a tuple loads stay sorted heaviest first."""
    if k == 1:  # nothing to balance (a rank's share as one micro-batch)
        return [list(range(len(costs)))]
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
