"""Tensor parallelism with sequence parallelism (runner/tensor_parallel.py) in spawned gloo worlds of 2 and 4
ranks on the CPU, each rank one TP rank of a dp1 x tp layout: every rank plans the steps through the simulator's
planner and trains them on its share of every layer; the Plans must be the simulator's byte for byte, and the
losses, the first step's gradients and the kernel's per-sequence statistics those of one process."""
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
WORLDS = (2, 4)


def config(tp: int):
    register()
    overrides = [*TINY, f"cluster.gpus_per_node={tp}", "layout.dp=1", f"layout.tp={tp}", f"runner.lr={LR}"]
    return OmegaConf.to_object(compose_config(overrides, config_name="runner"))


def train(cfg, run_layer_of=None) -> dict:
    """The run's steps on one model (``run_layer_of(model)``: its layers' runner, None: whole layers): each
    step's plan, loss, per-sequence kept fraction and coverage, and the first step's gradients."""
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
            fwd = model(b.tokens, b.cu_seqlens, (b.p, b.kept_fraction), b.target_positions, attend, run_layer)
            loss = F.cross_entropy(fwd.logits, b.targets, reduction="sum")
            (loss / n).backward()
            total += float(loss.detach())
            for a, kept, cov in zip(assigned, fwd.kept_fraction.tolist(), fwd.coverage.tolist()):
                out["stats"][a.seq_id] = (kept, cov)
        out["plans"].append(plan.to_json())
        out["losses"].append(total / n)
        if step == 0:
            out["grads"] = {name: whole(name, p.grad, model) for name, p in model.named_parameters()}
            out["split"] = sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor))
        optimizer.step()
        optimizer.zero_grad()
    return out


def whole(name: str, grad, model) -> torch.Tensor:
    """A gradient as the whole tensor in the model's own row order."""
    if not isinstance(grad, DTensor):
        return grad.clone()
    return unfused(name, grad.full_tensor(), model.shape, model.blocks[next(iter(model.blocks))].tp)


def _worker(rank: int, tp: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        cfg = config(tp)
        attend = make_attention("kernel", cfg.cost.block_size)
        result = train(cfg, lambda model: TensorParallelLayers(parallelize(model, mesh), mesh, attend))
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLDS, ids=[f"tp{tp}" for tp in WORLDS])
def world(request, once) -> tuple[int, list[dict]]:
    tp = request.param
    where = once(f"tensor-parallel-{tp}", lambda out: mp.spawn(_worker, args=(tp, str(out)), nprocs=tp, join=True))
    return tp, [torch.load(where / f"rank{r}.pt", weights_only=False) for r in range(tp)]


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The same steps on one whole model in this process, planned for the tp layout (tp = 2 and 4 plan alike)."""
    return train(config(2))


def test_plans_are_the_simulators(world):
    tp, ranks = world
    simulated = simulate(config(tp)).results.plans
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
