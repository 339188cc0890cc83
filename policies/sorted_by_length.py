"""``sorted``: sort by cost (longest first), then contiguous chunks.

Groups similar sequences together (little padding inside a micro-batch) but piles the long ones on
the first ranks: the classic imbalance that load balancing fixes.
"""
from __future__ import annotations

import numpy as np

from sparsebalance.policies.base import PartitionPolicy

from sparsebalance.sim.policy import register_batching
from sparsebalance.policies.sequential import contiguous


@register_batching("sorted")
class Sorted(PartitionPolicy):
    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        order = np.argsort(-costs, kind="stable").tolist()
        return [[order[i] for i in chunk] for chunk in contiguous(costs.size, k)]
