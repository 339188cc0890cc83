"""Plan.partitions: the sequence ids per (rank, micro-batch) in execution order, as verl-style trainers take them;
ldm_partition takes a plain list as verl's get_seqlen_balanced_partitions does."""
import numpy as np

from sparsebalance.policies.karmarkar_karp import ldm_partition
from sparsebalance.sim.setup import build_planner

LENGTHS = [4096, 512, 30000, 1200, 8000, 700, 16000, 2048, 900, 3000, 5000, 12000, 640, 20000, 1500, 7000]


def test_partitions_hold_every_length_index_once_on_its_rank_and_micro_batch():
    plan = build_planner("verl", ["layout.micro_batches=2", "workload.global_batch=16"]).plan(LENGTHS, 0)
    parts = plan.partitions()
    assert len(parts) == plan.dp and all(len(rank) == plan.micro_batches for rank in parts)
    assert sorted(i for rank in parts for mb in rank for i in mb) == list(range(len(LENGTHS)))
    for rank, micro_batches in enumerate(parts):
        for mb, ids in enumerate(micro_batches):
            rows = (plan.dp_ranks == rank) & (plan.micro_batch_ids == mb)
            assert ids == plan.seq_ids[rows].tolist()  # plan order: execution order inside a micro-batch


def test_ldm_partition_takes_a_list_as_verls_balancer_does():
    parts = ldm_partition(LENGTHS, 4, True)
    assert parts == ldm_partition(np.array(LENGTHS, dtype=np.float64), 4, True)
    assert sorted(i for part in parts for i in part) == list(range(len(LENGTHS)))
    assert {len(part) for part in parts} == {4}
