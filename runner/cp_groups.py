"""Process groups for dynamic CP: the runner's side of a Plan's CP groups (``Plan.cp_first``/``cp_size``).

A dynamic plan puts each sequence on an aligned power-of-two block of its stage's dp x cp domain
(sim.cp_groups). ``CPGroups`` creates a process group for every such block of every stage once, at start-up
(torch.distributed needs every rank to take part in creating every group, in one order), and keeps the rings
of the blocks that hold this rank; a micro-batch then takes its unit's ring by the plan's (first, size), so
ranks of different CP sizes run side by side with the same placement the simulator priced.
"""
from __future__ import annotations

from datetime import timedelta

import numpy as np
import torch.distributed as dist

from sparsebalance.runner.cp import Ring
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.cp_groups import plan_units
from sparsebalance.sim.plan import Plan


class CPGroups:
    """Every aligned block of 1, 2, 4, ... ``layout.cp`` ranks of every stage's domain, as a ring per block
    that holds ``rank`` (a global rank: ``domain rank + domain x stage``)."""

    def __init__(self, layout: Layout, rank: int, timeout: timedelta | None = None) -> None:
        self.layout, self.rank = layout, rank
        self.rings: dict[tuple[int, int], Ring] = {}
        options = {} if timeout is None else {"timeout": timeout}
        for stage in range(layout.pp):
            base, size = stage * layout.domain, 1
            while size <= layout.cp:
                for first in range(0, layout.domain, size):
                    ranks = tuple(range(base + first, base + first + size))
                    group = dist.new_group(list(ranks), **options)
                    if rank in ranks:
                        self.rings[(first, size)] = Ring(group, ranks, rank - ranks[0])
                size *= 2

    @property
    def domain_rank(self) -> int:
        return self.rank % self.layout.domain

    def ring(self, first: int, size: int) -> Ring:
        """The ring of the CP group of domain ranks ``first .. first + size - 1`` on this rank's stage."""
        ring = self.rings.get((first, size))
        if ring is None:
            raise ValueError(f"domain ranks {first}..{first + size - 1} are not a CP group of rank {self.rank} "
                             f"(domain rank {self.domain_rank}); allowed: an aligned power-of-two block holding it, "
                             f"at most layout.cp={self.layout.cp} ranks")
        return ring

    def units(self, plan: Plan) -> list[tuple[int, Ring, np.ndarray]]:
        """(micro-batch, ring, plan rows) of each unit this rank runs, in execution order."""
        units = plan_units(plan, self.layout)
        mine = []
        for u, (mb, first, size) in enumerate(zip(units.micro_batch.tolist(), units.first.tolist(),
                                                  units.size.tolist(), strict=True)):
            if first <= self.domain_rank < first + size:
                mine.append((mb, self.ring(first, size), np.flatnonzero(units.row_unit == u)))
        return mine
