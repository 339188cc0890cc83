"""Runs CP attentions the way a spawn of cp processes has them, once for every (case, implementation): each in a
gloo world of its own cp ranks (the file store in its own directory), without the start-up of new processes
(which import torch and the test module: more than the attention itself costs). Each rank saves its shard's
output, gradients and kernel statistics to ``<out>/<case>-<impl>/rank<r>.pt`` for the tests to compare with
one process."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from sparsebalance.runner.cp import Ring, Shards

# case -> (cp, inputs): inputs() gives (q, k, v, grad of o, cu_seqlens, the micro-batch's budgets)
Cases = Mapping[str, tuple[int, Callable[[], tuple]]]


def run_cp_cases(rank: int, out: str, cases: Cases, implementations: Mapping[str, Callable]) -> None:
    """Every case on the ranks below its cp, with every implementation (``make(ring) -> attend``)."""
    torch.set_num_threads(1)
    for case, (cp, inputs) in cases.items():
        if rank >= cp:
            continue
        for impl, make in implementations.items():
            where = Path(out) / f"{case}-{impl}"
            where.mkdir(exist_ok=True)
            dist.init_process_group("gloo", init_method=f"file://{where / 'store'}", rank=rank, world_size=cp)
            try:
                q, k, v, g, cu, budgets = inputs()
                shards = Shards.build(cu, cp, rank)
                mine = shards.mine
                ql, kl, vl = (x[mine].clone().requires_grad_() for x in (q, k, v))
                ring = Ring(dist.new_group(list(range(cp))), tuple(range(cp)), rank)
                o, kept, cov = make(ring)(ql, kl, vl, shards, budgets)
                o.backward(g[mine])
            except Exception as err:
                raise RuntimeError(f"{case} with the {impl} CP attention, cp rank {rank}") from err
            torch.save({"index": mine, "o": o.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad, "kept": kept,
                        "coverage": cov}, where / f"rank{rank}.pt")
            dist.destroy_process_group()
