"""``lpt``: longest processing time first, each sequence to the currently least-loaded part."""
from __future__ import annotations

import heapq

import numpy as np

from sparsebalance.policies.base import PartitionPolicy

from sparsebalance.sim.policy import register_batching


def lpt_partition(costs: np.ndarray, k: int) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, part) for part in range(k)]  # (load, part): ties go to the lower part index
    for i in np.argsort(-costs, kind="stable").tolist():
        load, part = heap[0]
        parts[part].append(i)
        heapq.heapreplace(heap, (load + float(costs[i]), part))
    return parts


@register_batching("lpt")
class LPT(PartitionPolicy):
    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        return lpt_partition(costs, k)
