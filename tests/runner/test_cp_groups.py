"""Dynamic CP in the runner (runner/cp_groups.py): four gloo processes on the CPU read one dynamic Plan, take their
CP groups from the groups made once at start-up, and run each unit's CP attention on its ring; every shard's
output equals one process's attention over the unit's documents."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance.kernels.sparse_attention import sparse_attention
from sparsebalance.runner.cp import Shards, make_cp_attention
from sparsebalance.runner.cp_groups import CPGroups
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.plan import Assignment, Plan

pytestmark = pytest.mark.slow

BLOCK, HQ, HKV, D = 16, 4, 2, 16
LAYOUT = Layout(dp=1, cp=4, micro_batches=2, gpus=4, cp_mode="dynamic")
# micro-batch 0: ranks 0-1 as CP 2 (two documents), rank 2 and rank 3 alone; micro-batch 1: all four as CP 4
PLAN = Plan.of(0, 1, 2, [Assignment(0, 61, 0, 0, cp_ranks=(0, 1)), Assignment(1, 37, 0, 0, cp_ranks=(0, 1)),
                         Assignment(2, 45, 0, 0, cp_ranks=(2,)), Assignment(3, 29, 0, 0, cp_ranks=(3,)),
                         Assignment(4, 83, 0, 1, cp_ranks=(0, 1, 2, 3))])


def inputs(lengths):
    gen = torch.Generator().manual_seed(sum(lengths))
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
    return q, k, v, torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)


def worker(rank: int, store: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    try:
        groups = CPGroups(LAYOUT, rank)
        seen = []
        for mb, ring, rows in groups.units(PLAN):
            lengths = PLAN.lengths[rows].tolist()
            q, k, v, cu = inputs(lengths)
            shards = Shards.build(cu, ring.size, ring.rank)
            mine = shards.mine
            budgets = (torch.ones(len(lengths)), None)
            o, _, _ = make_cp_attention(BLOCK, ring)(q[mine], k[mine], v[mine], shards, budgets)
            seen.append((mb, ring.ranks, lengths, mine, o))
        out[rank] = seen
    finally:
        dist.destroy_process_group()


def test_each_unit_runs_on_its_plans_cp_group_and_matches_one_process(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(str(tmp_path / "store"), out), nprocs=4, join=True)
        runs = dict(out)
    groups = {rank: [(mb, ranks) for mb, ranks, *_ in runs[rank]] for rank in range(4)}
    assert groups == {0: [(0, (0, 1)), (1, (0, 1, 2, 3))], 1: [(0, (0, 1)), (1, (0, 1, 2, 3))],
                      2: [(0, (2,)), (1, (0, 1, 2, 3))], 3: [(0, (3,)), (1, (0, 1, 2, 3))]}
    for rank in range(4):
        for mb, _ranks, lengths, mine, o in runs[rank]:
            q, k, v, cu = inputs(lengths)
            want = sparse_attention(q, k, v, cu, p=torch.ones(len(lengths)), block_size=BLOCK, backend="naive")
            torch.testing.assert_close(o, want[mine], rtol=0, atol=2e-6, msg=f"rank {rank}, micro-batch {mb}")


def test_a_group_the_plan_cannot_name_is_refused():
    groups = CPGroups.__new__(CPGroups)
    groups.layout, groups.rank, groups.rings = LAYOUT, 2, {}
    with pytest.raises(ValueError, match="domain ranks 1..2 are not a CP group of rank 2"):
        groups.ring(1, 2)
