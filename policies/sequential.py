"""``sequential``: arrival order, cut into equal contiguous chunks (what a plain data loader does)."""
from __future__ import annotations

import numpy as np

from policies.base import PartitionPolicy, register_batching


def contiguous(n: int, k: int) -> list[list[int]]:
    """Indices 0..n-1 in k contiguous chunks whose sizes differ by at most one."""
    return [chunk.tolist() for chunk in np.array_split(np.arange(n), k)]


@register_batching("sequential")
class Sequential(PartitionPolicy):
    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        return contiguous(costs.size, k)
