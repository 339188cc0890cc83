"""The work of one layout's GPUs timed on the one local device, for ``runner.replay``: clocks, the model cut into
pipeline stages, and one step of a Plan run micro-batch by micro-batch.

The stages are the runner's own (``sparsebalance.model.make_model`` with each stage's ``StageSpan``: the same
layers, the same weights from the seed, a tied LM head's copy on a last stage that is not the first). Each
stage's forward and backward is one span of a clock (CUDA events; the host clock on the CPU). Every layer keeps
the block selection of its forward; where the cost model charges activation checkpointing (``cost.recompute``),
every layer's backward recomputes its forward with those blocks, without selecting them again, as the cost
model charges it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sparsebalance.kernels.sparse_attention import sparse_attention
from sparsebalance.model import make_model
from sparsebalance.runner.attention import BACKENDS, budget_keywords
from sparsebalance.runner.data import MicroBatch
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.shapes import ModelShape, StageSpan

# (policy label, step, dp_rank, micro_batch, stage, 'F' | 'B'): one timed pass of one stage
Span = tuple[str, int, int, int, int, str]


# ----------------------------------------------------------------------------- clocks
class Clock(Protocol):
    def span(self, key: Span) -> contextlib.AbstractContextManager: ...

    def read(self) -> dict[Span, float]:
        """Milliseconds of every span since the last read, once the device has finished them."""


class CudaClock:
    """CUDA events around each span (device time, no host sync inside a step), read after one synchronise."""

    name = "CUDA events"

    def __init__(self) -> None:
        self._spans: list = []

    @contextlib.contextmanager
    def span(self, key: Span) -> Iterator[None]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._spans.append((key, start, end))

    def read(self) -> dict[Span, float]:
        torch.cuda.synchronize()
        times = {key: start.elapsed_time(end) for key, start, end in self._spans}
        self._spans = []
        return times


class HostClock:
    """``time.perf_counter`` around each span: the CPU runs the work synchronously."""

    name = "host clock"

    def __init__(self) -> None:
        self._times: dict[Span, float] = {}

    @contextlib.contextmanager
    def span(self, key: Span) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self._times[key] = (time.perf_counter() - start) * 1e3

    def read(self) -> dict[Span, float]:
        times, self._times = self._times, {}
        return times


class Untimed:
    """The warm-up runs' clock."""

    def span(self, key: Span) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def read(self) -> dict[Span, float]:
        return {}


def make_clock(device: torch.device) -> Clock:
    return CudaClock() if device.type == "cuda" else HostClock()


def clock_name(clock: Clock) -> str:
    return getattr(clock, "name", type(clock).__name__)


# ----------------------------------------------------------------------------- execution
class KeptSelection:
    """One layer's attention (what runner.attention gives the model), keeping the block selection of its first
    call: the recomputation in the backward (activation checkpointing) attends to the same blocks without
    selecting them again, as the cost model charges it."""

    def __init__(self, backend: str, block_size: int) -> None:
        self.backend, self.block_size = BACKENDS[backend], block_size
        self.selection = None

    def __call__(self, q, k, v, docs, budgets):
        if self.selection is None:
            o, self.selection = sparse_attention(q, k, v, docs, **budget_keywords(budgets),
                                                 block_size=self.block_size, return_selection=True,
                                                 backend=self.backend)
        else:
            o = sparse_attention(q, k, v, docs, selection=self.selection, backend=self.backend)
        return o, self.selection.kept_fraction, self.selection.coverage


class StagedModel:
    """The runner's model cut into ``pp`` pipeline stages (``make_model`` of each ``StageSpan``), run one after
    another on ``device``: the first stage embeds, the last projects the answer positions and takes the loss."""

    def __init__(self, shape: ModelShape, pp: int, seed: int, device: torch.device, backend: str, block_size: int,
                 recompute: bool) -> None:
        self.shape = shape
        # bf16 on the GPU, as calibrated and as runner.train runs it; fp32 on the CPU (the reference kernel)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.stages = [make_model(shape, seed, StageSpan(s, pp)).to(device=device, dtype=dtype) for s in range(pp)]
        self.backend, self.block_size, self.recompute = backend, block_size, recompute
        for param in self.parameters():
            param.grad = torch.zeros_like(param)  # accumulated into from the first backward on, as in training

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Every stage's parameters, named as in the whole model (a tied LM head's copy as ``lm_head.weight``)."""
        for stage in self.stages:
            yield from stage.named_parameters()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (param for _, param in self.named_parameters())

    def zero_grad(self) -> None:
        for param in self.parameters():
            param.grad.zero_()

    def run(self, batch: MicroBatch, clock: Clock, key: tuple[str, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward of every stage in order, then backward in reverse, each stage's pass one span of ``clock``
        (``(*key, stage, 'F' | 'B')``); the kernel's kept fraction and coverage per sequence, mean over layers."""
        inputs, outputs = [], []
        kept = coverage = 0.0
        x = None
        for stage, model in enumerate(self.stages):
            with clock.span((*key, stage, "F")):
                x_in = None if stage == 0 else x.detach().requires_grad_()
                out = model(batch.tokens if stage == 0 else x_in, batch.cu_seqlens, batch.budgets,
                            batch.target_positions, None, run_layer=self._layer)
                x = out.hidden if out.logits is None else F.cross_entropy(out.logits, batch.targets, reduction="sum")
            inputs.append(x_in)
            outputs.append(x)
            kept, coverage = kept + out.kept_fraction, coverage + out.coverage
        grad = None
        for stage in reversed(range(len(self.stages))):
            with clock.span((*key, stage, "B")):
                outputs[stage].backward(grad)
            grad = inputs[stage].grad if stage else None
            inputs[stage] = outputs[stage] = None  # this stage's activations go
        return kept / len(self.stages), coverage / len(self.stages)

    def _layer(self, block, x, rotary, docs, budgets):
        """One layer with its own kept selection, its forward recomputed in its backward where checkpointing."""
        attention = KeptSelection(self.backend, self.block_size)
        if self.recompute:
            return checkpoint(block, x, rotary, docs, budgets, attention, use_reentrant=False)
        return block(x, rotary, docs, budgets, attention)


@dataclass(frozen=True)
class Measured:
    """One step of one policy as it ran: busy ms per [dp, m, pp] and the kernel's stats per sequence."""

    fwd_ms: np.ndarray
    bwd_ms: np.ndarray
    kept: dict[int, float]  # seq_id -> kept fraction, mean over layers
    coverage: dict[int, float]


def replay_step(staged: StagedModel, name: str, plan: Plan, pp: int, clock: Clock, warmup: int,
                packer) -> Measured:
    """Every (rank, micro-batch) of the Plan, one after another; empty micro-batches take no time."""
    fwd, bwd = np.zeros((plan.dp, plan.micro_batches, pp)), np.zeros((plan.dp, plan.micro_batches, pp))
    stats = []
    staged.zero_grad()
    for rank in range(plan.dp):
        for mb in range(plan.micro_batches):
            assignments = plan.micro_batch(rank, mb)
            if not assignments:
                continue
            batch = packer(assignments)  # off the clock, as a prefetching loader does it
            for _ in range(warmup):
                staged.run(batch, Untimed(), (name, plan.step, rank, mb))
            stats.append((assignments, *staged.run(batch, clock, (name, plan.step, rank, mb))))
    for (_, _, rank, mb, stage, phase), ms in clock.read().items():
        (fwd if phase == "F" else bwd)[rank, mb, stage] = ms
    kept, coverage = {}, {}
    for assignments, kf, cov in stats:
        for a, k, c in zip(assignments, kf.cpu().tolist(), cov.cpu().tolist(), strict=True):
            kept[a.seq_id], coverage[a.seq_id] = k, c
    return Measured(fwd, bwd, kept, coverage)
