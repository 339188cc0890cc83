"""Tensor parallelism with sequence parallelism (runner/tensor_parallel.py) in spawned gloo worlds on the CPU: tp2
and tp4 (2 and 4 ranks, dp1), and cp2 x tp2 (4 ranks: TP inside each CP rank, with runner/cp_kernel.py's CP
attention over the ranks of the same TP index, TP innermost as sim.cluster places them). Every rank plans the
steps through the simulator's planner and trains them on its share of every layer (and under CP its zigzag
shard of every sequence); the Plans must be the simulator's byte for byte, and the losses, the first step's
gradients and the kernel's per-sequence statistics those of one process. Under CP the harness sums each
rank's loss and gradients over its CP group, the reduction runner.train leaves to DDP/FSDP."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from omegaconf import OmegaConf
from sparsebalance.model import make_model
from sparsebalance.runner.attention import make_attention
from sparsebalance.runner.config import register
from sparsebalance.runner.cp import Ring, shard_micro_batch
from sparsebalance.runner.cp_kernel import make_cp_kernel_attention
from sparsebalance.runner.data import n_answers, pack
from sparsebalance.runner.task import TaskConfig
from sparsebalance.runner.tensor_parallel import (
    TensorParallelLayers,
    parallelize,
    unfused,
)
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.run import simulate
from sparsebalance.sim.setup import make_planner, prepare
from sparsebalance.sim.workload import requests, truth_of
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.slow  # two spawned worlds and their one-process references

# A tiny model whose heads, KV heads and FFN split over 4 ranks; 2 steps of 4 sequences in 2 micro-batches.
TINY = ["cost=roofline", "cost.block_size=32", "layout.micro_batches=2", "model.hidden=64", "model.layers=2",
        "model.heads=4", "model.kv_heads=4", "model.head_dim=16", "model.ffn=64", "model.vocab=128",
        "model.max_context=512", "workload.global_batch=4", "workload.min_len=64", "workload.max_len=512",
        "workload.median=160", "seed=5", "policy=baseline", "steps=2", "runner.task.n_keys=16",
        "runner.task.n_values=16", "runner.task.max_pairs=4"]
LR = 1e-2
WORLDS = {"tp2": (2, 1), "tp4": (4, 1), "cp2xtp2": (2, 2)}  # name: (tp, cp)


def config(tp: int, cp: int = 1):
    register()
    overrides = [*TINY, f"cluster.gpus_per_node={tp * cp}", "layout.dp=1", f"layout.tp={tp}", f"layout.cp={cp}",
                 f"runner.lr={LR}"]
    return OmegaConf.to_object(compose_config(overrides, config_name="runner"))


def train(cfg, run_layer_of=None, ring: Ring | None = None) -> dict:
    """The run's steps on one model (``run_layer_of(model)``: its layers' runner, None: whole layers; ``ring``:
    this rank's CP group, None: no CP): each step's plan, loss, per-sequence kept fraction and coverage, and the
    first step's gradients."""
    setup = prepare(cfg)
    planner = make_planner(cfg, setup)
    task = TaskConfig(**OmegaConf.to_container(OmegaConf.structured(cfg.runner.task)))
    model = make_model(cfg.model, cfg.seed)
    run_layer = run_layer_of(model) if run_layer_of else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=cfg.runner.weight_decay)
    attend = make_attention("kernel", cfg.cost.block_size)
    out = {"plans": [], "losses": [], "stats": {}}
    for step in range(cfg.steps):
        batch = setup.workload.batch(step)
        truth = truth_of(batch)
        plan = planner.plan(requests(batch), step)
        n, total = n_answers(plan.assignments, task, truth), 0.0
        for mb in range(plan.micro_batches):
            assigned = plan.micro_batch(0, mb)
            b = pack(assigned, truth, task, cfg.model.vocab, cfg.seed, torch.device("cpu"))
            docs = b.cu_seqlens
            if ring is not None:
                b = shard_micro_batch(b, ring.size, ring.rank)
                docs = b.shards
            fwd = model(b.tokens, docs, (b.p, b.kept_fraction), b.target_positions, attend, run_layer)
            loss = F.cross_entropy(fwd.logits, b.targets, reduction="sum")
            (loss / n).backward()
            total += float(cp_sum(loss.detach(), ring))
            for a, kept, cov in zip(assigned, fwd.kept_fraction.tolist(), fwd.coverage.tolist(), strict=True):
                out["stats"][a.seq_id] = (kept, cov)
        for p in model.parameters():
            cp_sum(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, ring)
        out["plans"].append(plan.to_json())
        out["losses"].append(total / n)
        if step == 0:
            out["grads"] = {name: whole(name, p.grad, model) for name, p in model.named_parameters()}
            out["split"] = sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor))
        optimizer.step()
        optimizer.zero_grad()
    return out


def cp_sum(tensor: torch.Tensor, ring: Ring | None) -> torch.Tensor:
    """``tensor`` summed in place over the CP group (each CP rank scores the answers among its tokens)."""
    if ring is not None:
        dist.all_reduce(tensor, group=ring.group)
    return tensor


def whole(name: str, grad, model) -> torch.Tensor:
    """A gradient as the whole tensor in the model's own row order."""
    if not isinstance(grad, DTensor):
        return grad.clone()
    return unfused(name, grad.full_tensor(), model.shape, model.blocks[next(iter(model.blocks))].tp)


def _worker(rank: int, tp: int, cp: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=tp * cp)
    try:
        mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))  # rank = tp_rank + tp * cp_rank
        cfg = config(tp, cp)
        ring = None
        if cp > 1:
            cp_rank, tp_rank = mesh.get_coordinate()
            ring = Ring(mesh["cp"].get_group(), tuple(tp_rank + tp * c for c in range(cp)), cp_rank)
        attend = (make_attention("kernel", cfg.cost.block_size) if ring is None
                  else make_cp_kernel_attention(cfg.cost.block_size, ring, "auto"))
        result = train(cfg, lambda model: TensorParallelLayers(parallelize(model, mesh["tp"]), mesh["tp"], attend),
                       ring)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request, once) -> tuple[tuple[int, int], list[dict]]:
    tp, cp = WORLDS[request.param]
    where = once(f"tensor-parallel-{request.param}",
                 lambda out: mp.spawn(_worker, args=(tp, cp, str(out)), nprocs=tp * cp, join=True))
    return (tp, cp), [torch.load(where / f"rank{r}.pt", weights_only=False) for r in range(tp * cp)]


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The same steps on one whole model in this process, planned for a TP layout (every layout here plans
    alike: the baseline policy's Plans depend on dp and the micro-batches only)."""
    return train(config(2))


def test_plans_are_the_simulators(world):
    layout, ranks = world
    simulated = simulate(config(*layout)).results.plans
    for result in ranks:
        assert result["plans"] == simulated
    assert Plan.from_json(simulated[0]).dp == 1


def test_losses_gradients_and_selection_are_one_process(world, one_process):
    _, ranks = world
    layers = [f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn_norm", "mlp_norm", "w13", "w2", "wo", "wqkv")]
    for result in ranks:
        assert result["split"] == layers and one_process["split"] == []  # DTensors: every layer's, only theirs
        assert result["losses"] == pytest.approx(one_process["losses"], rel=1e-5)
        for name, grad in one_process["grads"].items():
            got = result["grads"][name]
            assert torch.allclose(got, grad, rtol=0, atol=1e-5 * float(grad.abs().max())), name
        for seq, (kept, cov) in one_process["stats"].items():
            assert result["stats"][seq] == pytest.approx((kept, cov), rel=1e-6)
