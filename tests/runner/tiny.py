"""The tiny model on one rank that the runner's checkpoint and bad-input tests start from; the baseline policy
plans without learned state."""
from sparsebalance.runner.dist import World

ONE_RANK = World(rank=0, size=1, local_rank=0)
TINY_ONE_RANK = [
    "cost=roofline", "cost.block_size=32", "cluster.gpus_per_node=1", "layout.micro_batches=2",
    "model.hidden=32", "model.layers=1", "model.heads=2", "model.kv_heads=1", "model.head_dim=16",
    "model.ffn=64", "model.vocab=128", "model.max_context=512", "workload.global_batch=4",
    "workload.min_len=64", "workload.max_len=512", "workload.median=128", "seed=5", "policy=baseline",
    "runner.task.n_keys=16", "runner.task.n_values=16", "runner.task.max_pairs=4",
]
