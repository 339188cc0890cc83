"""One stage's share of a training step: the Plan's micro-batches in 1F1B order over ``send``/``recv``.

The order is the simulator's (``sim.pipeline.one_f_one_b``: warm-up forwards, one forward one backward,
cool-down backwards); with one stage it is plain gradient accumulation. A stage receives its input
activations from the previous stage of its replica and the gradients of its output from the next one;
sends are asynchronous (``isend``) and waited for at the end of the step, receives block, and the time
blocked is the micro-batch's idle time, as the engine's waits on a neighbour.

Why not ``torch.distributed.pipelining`` (``PipelineStage`` with ``Schedule1F1B``): its schedules split one
batch tensor into equal chunks along a dimension, and a stage infers the shapes of the tensors it receives
once, from the first micro-batch, and receives every later micro-batch into buffers of those shapes. The
Plan's micro-batches are packed sequences of different total lengths (and carry per-sequence boundaries
and budgets besides the tensors), so every micro-batch has its own shape. No shapes travel here either:
every rank holds the same Plan (its digest is checked every step), so a receiver knows the token count of
each micro-batch and allocates ``[tokens, hidden]`` itself.

Each operation (a micro-batch's forward or backward) starts by resetting the CUDA allocator's peak and ends by
reading it, so that a micro-batch's peak is the most this stage held while it ran (``MemoryProbe``).

Empty micro-batches (a replica the Plan gives fewer micro-batches than the layout has) run as one token
with zero loss weight, so that every replica executes the same forwards, backwards and collectives
(FSDP gathers weights in each); the Results record them as empty.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sparsebalance.runner.data import MicroBatch
from sparsebalance.runner.dist import Comm
from sparsebalance.runner.parallel import Replicated
from sparsebalance.sim.pipeline import one_f_one_b


class Clock:
    """Marks on one step's timeline: CUDA events on the GPU (no host sync inside the step), the host clock on
    the CPU. Read after the step is synchronised, in ms since ``start`` and as wall-clock ms, which ranks on
    one host share (the straggler wait compares ranks' marks)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        self.wall0 = time.time() * 1e3
        self.origin = self.mark()

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, mark) -> float:
        return self.origin.elapsed_time(mark) if self.cuda else (mark - self.origin) * 1e3

    def wall(self, mark) -> float:
        return self.wall0 + self.ms(mark)


class MemoryProbe:
    """The most bytes the CUDA caching allocator held over an interval: ``reset`` before it, ``peak`` after.
    Both read and reset host-side counters, so no device sync; on the CPU, which has no such counter,
    ``peak`` is None."""

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None

    def reset(self) -> None:
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return None if self.device is None else torch.cuda.max_memory_allocated(self.device)


def most(*peaks: int | None) -> int | None:
    """The largest of some peaks; None where none was measured (the CPU)."""
    known = [p for p in peaks if p is not None]
    return max(known) if known else None


@dataclass
class Work:
    """A micro-batch of this replica and the weight of its summed loss (0 for an empty one)."""

    batch: MicroBatch
    weight: float
    empty: bool = False


@dataclass
class Outcome:
    """What one stage did in one step, as marks of its clock (read them after the step is synchronised)."""

    ops: list = field(default_factory=list)  # (micro_batch, mark before receiving, after, after computing)
    outputs: dict = field(default_factory=dict)  # micro_batch -> (loss_sum | None, correct | None, kept, coverage)
    compute_end: object = None  # when the last backward's compute ended (its gradient reduction may go on)
    backward_end: object = None  # when the gradients were reduced (and tied copies summed)
    # micro_batch -> the most bytes allocated during its forward or its backward on this stage (None: CPU)
    peaks: dict = field(default_factory=dict)
    tail_peak: int | None = None  # the same over the tied sum and the sends' waits after the last backward


class StageDriver:
    def __init__(self, model: Replicated, comm: Comm, attention, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.comm, self.attention = model, comm, attention
        self.dtype, self.device = dtype, device
        self.memory = MemoryProbe(device)
        self.span = model.model.stage
        self._compute_end = None
        # The first layer's input gradient is the stage's last compute (stage 0: the embedding's lookup
        # gradient, a scatter, follows); the reduction of the last gradient buckets comes after it.
        first_block = next(iter(model.model.blocks.values()))
        first_block.register_full_backward_hook(self._stamp)

    def _stamp(self, *_) -> None:
        self._compute_end = self.clock.mark()

    def step(self, work: list[Work], clock: Clock) -> Outcome:
        self.clock, out = clock, Outcome()
        ops = one_f_one_b(self.span.index, self.span.count, len(work))
        pending, stash = [], {}
        for n, (forward, mb) in enumerate(ops):
            self.memory.reset()
            before = clock.mark()
            if forward:
                received = self._forward(work[mb], mb, stash, pending, out)
            else:
                received = self._backward(mb, stash, pending, last=n == len(ops) - 1)
            out.ops.append((mb, before, received, clock.mark()))
            out.peaks[mb] = most(out.peaks.get(mb), self.memory.peak())
        self.memory.reset()
        self.model.sum_tied()
        out.compute_end, out.backward_end = self._compute_end, clock.mark()
        for handle, _ in pending:
            handle.wait()
        out.tail_peak = self.memory.peak()
        return out

    def _forward(self, item: Work, mb: int, stash: dict, pending: list, out: Outcome):
        b = item.batch
        if self.span.first:
            inputs = b.tokens
        else:
            inputs = torch.empty(b.n_tokens, self.model.model.shape.hidden, dtype=self.dtype, device=self.device)
            dist.recv(inputs, self.comm.prev)
            inputs.requires_grad_()
        received = self.clock.mark()
        result = self.model(inputs, b.docs, b.budgets, b.target_positions, self.attention)
        stats = (result.kept_fraction.detach(), result.coverage.detach())
        if self.span.last:
            loss_sum = F.cross_entropy(result.logits, b.targets, reduction="sum")
            stash[mb] = (inputs, loss_sum * item.weight)
            correct = (result.logits.argmax(-1) == b.targets).sum()
            head = (loss_sum.detach(), correct)
        else:
            hidden = result.hidden
            self._send(hidden.detach(), self.comm.next, pending)
            stash[mb] = (inputs, hidden)
            head = (None, None)
        if not item.empty:
            out.outputs[mb] = (*head, *stats)
        return received

    def _backward(self, mb: int, stash: dict, pending: list, last: bool):
        inputs, outputs = stash.pop(mb)
        grad = None
        if not self.span.last:
            grad = torch.empty_like(outputs)
            dist.recv(grad, self.comm.next)
        received = self.clock.mark()
        self.model.backward(outputs, grad, last)
        if not self.span.first:
            self._send(inputs.grad, self.comm.prev, pending)
        return received

    @staticmethod
    def _send(tensor: torch.Tensor, dst: int, pending: list) -> None:
        pending.append((dist.isend(tensor, dst), tensor))  # the tensor lives until the send completes
