"""``sequential``: arrival order, cut into equal contiguous chunks (what a plain data loader does)."""
from __future__ import annotations

import numpy as np

from sparsebalance.policies.base import PartitionPolicy

from sparsebalance.sim.policy import register_batching


def contiguous(n: int, k: int) -> list[list[int]]:
    """Indices 0..n-1 in k contiguous chunks whose sizes differ by at most one (larger chunks last).

    Plain integer arithmetic: this runs for every rank of every step and np.array_split is ~10x slower.
    """
    bounds = [i * n // k for i in range(k + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]


@register_batching("sequential")
class Sequential(PartitionPolicy):
    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        return contiguous(costs.size, k)
