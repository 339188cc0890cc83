"""Data parallelism through torch's own wrappers: ``DistributedDataParallel`` or FSDP2's ``fully_shard``
(``runner.data_parallel``), over the replicas of one pipeline stage.

Gradients accumulate locally over a step's micro-batches and are reduced once, in the step's last
backward, whose bucketed (DDP) or per-layer (FSDP) reductions start while the rest of that backward still
runs. Every forward runs under DDP's ``no_sync``; because 1F1B leaves several forwards in flight, DDP's
reducer is armed just before the last backward (``reducer.prepare_for_backward``, as the stages of
``torch.distributed.pipelining`` do it) rather than by the last forward. FSDP is told per backward
whether to reduce (``set_requires_gradient_sync``).

Both wrappers average over the replicas; the caller scales its loss by their number, so that the step's
gradient is the sum over every scored token divided by the global count, as the single-process run has it.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from sparsebalance.model import TinyLlama
from sparsebalance.runner.dist import Comm

DATA_PARALLEL = ("ddp", "fsdp")
FULL = StateDictOptions(full_state_dict=True)


class Replicated:
    """One stage's module under DDP or FSDP over ``comm.replicas``."""

    def __init__(self, model: TinyLlama, kind: str, comm: Comm) -> None:
        if kind not in DATA_PARALLEL:
            raise ValueError(f"unknown data parallelism {kind!r}; choose one of {', '.join(DATA_PARALLEL)}")
        self.model, self.kind, self.comm = model, kind, comm
        self.replicas = comm.replicas.size()
        if kind == "ddp":
            # No device_ids: DDP would move every tensor argument to the GPU, cu_seqlens and budgets too,
            # which the attention reads on the host.
            self.module = DistributedDataParallel(model, process_group=comm.replicas.get_group())
        else:
            for block in model.blocks.values():
                fully_shard(block, mesh=comm.replicas)
            self.module = fully_shard(model, mesh=comm.replicas)
        # The tied LM head of a pipelined model: a copy on the last stage of the first stage's embedding.
        self.tied = None
        if comm.ends is not None and model.shape.tie_embeddings:
            self.tied = model.embed.weight if model.stage.first else model.lm_head.weight

    def __call__(self, *args):
        if self.kind == "ddp":
            with self.module.no_sync():
                return self.module(*args)
        return self.module(*args)

    def parameters(self):
        return self.module.parameters()

    def backward(self, tensors, grads, last: bool) -> None:
        """Backward of one micro-batch; the step's ``last`` one reduces the accumulated gradients."""
        if self.kind == "ddp":
            if last:
                self.module.reducer.prepare_for_backward([])
            context = contextlib.nullcontext() if last else self.module.no_sync()
        else:
            self.module.set_requires_gradient_sync(last)
            context = contextlib.nullcontext()
        with context:
            torch.autograd.backward(tensors, grads)

    def sum_tied(self) -> None:
        """After the step's backwards (and the sends of their input gradients, which the other end of the
        tie may be waiting for): both copies of a tied embedding get the sum of the embedding's and the LM
        head's gradients, each shard with its counterpart (both stages shard the matrix alike over replicas of
        equal size)."""
        if self.tied is not None:
            grad = self.tied.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.comm.ends)

    # ------------------------------------------------------------------ checkpoints
    def state(self, optimizer) -> tuple[dict, dict]:
        """This stage's weights and optimiser state, whole tensors on the CPU keyed by parameter name
        (a collective over the replicas under FSDP)."""
        model_sd, optim_sd = get_state_dict(self.module, optimizer, options=FULL)
        return _to_cpu(model_sd), _to_cpu(optim_sd)

    def load(self, optimizer, model_sd: dict, optim_sd: dict) -> None:
        """Take this stage's share of a whole model's state (``state`` of every stage, merged)."""
        names = set(self.model.state_dict())
        own = set(dict(self.model.named_parameters()))
        mine = {k: v for k, v in model_sd.items() if k in names}
        groups = [{**g, "params": [n for n in g["params"] if n in own]} for g in optim_sd["param_groups"]]
        state = {k: v for k, v in optim_sd["state"].items() if k in own}
        tuples = [[k for k, v in g.items() if isinstance(v, tuple)] for g in optimizer.param_groups]
        set_state_dict(self.module, optimizer, model_state_dict=mine,
                       optim_state_dict={"state": state, "param_groups": groups}, options=FULL)
        # set_state_dict hands back lists where the optimiser keeps tuples (AdamW's betas): restored, the
        # resumed optimiser's param groups are the uninterrupted run's, field for field
        for group, keys in zip(optimizer.param_groups, tuples, strict=True):
            group.update({k: tuple(group[k]) for k in keys})


def merge_states(states: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """The whole model's state from every stage's (one per stage, in stage order)."""
    model_sd, optim_state, names = {}, {}, []
    for stage_model, stage_optim in states:
        model_sd.update(stage_model)
        optim_state.update(stage_optim["state"])
        names += [n for g in stage_optim["param_groups"] for n in g["params"] if n not in names]
    group = {k: v for k, v in states[0][1]["param_groups"][0].items() if k != "params"}
    return model_sd, {"state": optim_state, "param_groups": [{**group, "params": names}]}


def _to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    return tree
