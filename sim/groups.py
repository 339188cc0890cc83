"""Micro-batch sums and maxima of per-sequence values, for one batch or for replicas of it.

A planner prices one placement of its sequences many times over: DST at every budget level and belief sample,
the planner's prediction at every sample. The replicas share the lengths and the micro-batch of each sequence
and differ only in the kept fractions, so what follows from the lengths alone is summed once and repeated per
replica. Every sum is the one ``np.bincount`` takes over the replicas laid end to end (each micro-batch adds
its sequences in the same order), so the figures are the same bits either way.
"""
from __future__ import annotations

from functools import cached_property

import numpy as np


class Groups:
    """Sequence ``i`` of replica ``r`` is in micro-batch ``r * n_groups + group[i]`` of ``replicas * n_groups``."""

    def __init__(self, group, n_groups: int, replicas: int = 1) -> None:
        self.group = np.asarray(group, dtype=np.int64).reshape(-1)
        self.n_groups = n_groups
        self.replicas = replicas

    @property
    def size(self) -> int:
        """Micro-batches over all replicas."""
        return self.replicas * self.n_groups

    @cached_property
    def flat(self) -> np.ndarray:
        """``[replicas * n]``: each sequence's micro-batch over all replicas, replica after replica."""
        offsets = np.arange(self.replicas, dtype=np.int64)[:, None] * self.n_groups
        return (offsets + self.group[None, :]).reshape(-1)

    def tile(self, per_group: np.ndarray) -> np.ndarray:
        """A figure of one replica's micro-batches (``[n_groups]``) repeated for every replica."""
        return per_group if self.replicas == 1 else np.tile(per_group, self.replicas)

    def spread(self, values) -> np.ndarray:
        """``[replicas * n]``: per-sequence values, one row per replica or one row for all, laid end to end."""
        values = np.asarray(values, dtype=np.float64)
        return np.broadcast_to(values, (self.replicas, self.group.size)).reshape(-1)

    def sum(self, values) -> np.ndarray:
        """Per micro-batch, the sum of ``values`` (``[n]``: alike in every replica, or ``[replicas, n]``)."""
        values = np.asarray(values, dtype=np.float64)
        if values.ndim == 1 or self.replicas == 1:
            return self.tile(np.bincount(self.group, weights=values.reshape(-1), minlength=self.n_groups))
        return np.bincount(self.flat, weights=values.reshape(-1), minlength=self.size)

    def max(self, values) -> np.ndarray:
        """Per micro-batch, the largest of ``values`` and 0 (as ``np.maximum.at`` into zeros)."""
        values = np.asarray(values, dtype=np.float64)
        if values.ndim == 1 and self.replicas > 1:
            return self.tile(Groups(self.group, self.n_groups).max(values))
        rows = values.reshape(-1, self.group.size)
        out = np.zeros((rows.shape[0], self.n_groups))
        if self.group.size:
            occupied, starts = self._runs
            ordered = rows if self._order is None else rows[:, self._order]
            out[:, occupied] = np.maximum(0.0, np.maximum.reduceat(ordered, starts, axis=1))
        return out.reshape(-1)

    @cached_property
    def _order(self) -> np.ndarray | None:
        """The sequences by micro-batch; None where they already are (a Plan lists them so)."""
        return None if (np.diff(self.group) >= 0).all() else np.argsort(self.group, kind="stable")

    @cached_property
    def _runs(self) -> tuple[np.ndarray, np.ndarray]:
        """The occupied micro-batches and where each one's sequences start in ``_order``."""
        counts = np.bincount(self.group, minlength=self.n_groups)
        occupied = np.flatnonzero(counts)
        return occupied, (np.cumsum(counts) - counts)[occupied]
