"""Before a run starts: whether its sequences fit the memory of the device it runs on.

The simulator's memory model (``sim.memory.MemoryModel``: weights, optimizer states, activations and the
kernel's block selection per stage) holds a run's Plans against ``cluster.hbm_gb``, the GPU the config
describes. The device the run gets can hold less: a GPU with less free memory (``torch.cuda.mem_get_info``),
or on the CPU the host's available RAM, shared by the ranks it runs (psutil). Where the attention runs the
PyTorch reference (``kernels/sparse_attention/naive.py``: on the CPU, or ``runner.attention=naive``), every
document's dense scores and mask ``[heads, L, L]`` are kept for the backward in every layer, which the kernel
never holds; those bytes are added with the coefficients below.

Every sequence of every step, alone in a micro-batch on its pipeline stage that needs the most (dense: the
most its selection can hold), must fit the device: no Plan can do better. The first that does not is one
``ConfigError`` line naming the step, the sequence, its length and the bytes. ``memory.overflow=allow`` skips
the check, as it does the simulator's. Every rank checks its own device before the process group exists, so
that all of them refuse alike and none makes a run dir.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.config import Overflow
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.memory import GB, MemoryModel
from sparsebalance.sim.workload import Workload

# The PyTorch reference attention's bytes per query head and (query, key) token pair of a document, in float32
# on the CPU: held per layer for the backward (the softmax output and the inverted mask, 5 bytes, and the
# allocator's share), and transient while the document's layer runs. Measured as the peak RSS of one
# micro-batch's forward and backward through sparsebalance.model.TinyLlama: 1-4 layers, 2-4 heads, documents of
# 512-8192 tokens, one to eight per micro-batch (held 6.0-6.5 bytes per layer, transient 6.4-8.9).
REFERENCE_HELD = 6.5
REFERENCE_TRANSIENT = 8.0


@dataclass(frozen=True)
class Device:
    """What one rank can use of the device it runs on."""

    name: str  # cpu, cuda:0
    available_bytes: float
    source: str  # where the figure comes from, for the error line


def device_capacity(device_type: str, local_rank: int, local_ranks: int) -> Device:
    """The bytes one rank can use: its GPU's free memory, or the host's available RAM over its ranks."""
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info(local_rank)
        return Device(f"cuda:{local_rank}", float(free), f"free of its {total / GB:.1f} GB")
    import psutil  # the gpu extra's; only a CPU run reads the host's RAM, so GPU machines need not have it

    available = float(psutil.virtual_memory().available)
    return Device("cpu", available / local_ranks,
                  f"{available / GB:.1f} GB of RAM available on this host for {local_ranks} rank(s)")


def runs_reference(attention: str, device_type: str) -> bool:
    """Whether the attention runs the PyTorch reference: ``naive`` anywhere, ``kernel`` on the CPU."""
    return attention == "naive" or (attention == "kernel" and device_type == "cpu")


def memory_model(cfg: DictConfig, layout: Layout, block_size: int) -> MemoryModel:
    """The memory model of the processes: the Plans' layout, or under ``runner.one_process`` one process with
    the whole model and whole sequences, running every replica's micro-batches (nothing sharded)."""
    memory = OmegaConf.to_object(cfg.memory)
    if cfg.runner.one_process:
        layout = Layout(dp=layout.dp, micro_batches=layout.micro_batches)
        memory = replace(memory, sharding="ddp")
    return MemoryModel(memory, OmegaConf.to_object(cfg.model), layout, cfg.cluster.hbm_gb, block_size)


def alone_bytes(memory: MemoryModel, lengths: np.ndarray, heads: int, reference: bool) -> np.ndarray:
    """[n] bytes of each sequence alone in a micro-batch, dense, on the stage that needs the most."""
    n = lengths.size
    held, transient = memory.micro_batch_bytes(lengths, np.ones(n), np.arange(n), n)  # [n, pp]
    need = memory.static[None, :] + held + transient
    if reference:
        pairs = heads * lengths.astype(np.float64) ** 2 / memory.layout.cp
        need = need + ((REFERENCE_HELD * memory.layers + REFERENCE_TRANSIENT) * pairs)[:, None]
    return need.max(axis=1)


def check_fits(cfg: DictConfig, workload: Workload, layout: Layout, block_size: int, device: Device,
               device_type: str) -> None:
    """Every step's sequences against the device, before the run: one ConfigError line for the first step with
    one that does not fit, naming its sequence that needs the most."""
    if Overflow(cfg.memory.overflow) is Overflow.allow:
        return
    batches = [workload.batch(step) for step in range(cfg.steps)]
    sequences = [s for batch in batches for s in batch]
    step_of = np.repeat(np.arange(cfg.steps), [len(batch) for batch in batches])
    reference = runs_reference(cfg.runner.attention, device_type)
    need = alone_bytes(memory_model(cfg, layout, block_size), np.array([s.length for s in sequences]),
                       cfg.model.heads, reference)
    over = need > device.available_bytes
    if not over.any():
        return
    worst = int(np.argmax(np.where(step_of == step_of[np.argmax(over)], need, -np.inf)))
    seq = sequences[worst]
    why = " (the PyTorch reference attention keeps its [heads, L, L] scores in every layer)" if reference else ""
    raise ConfigError(
        f"step {step_of[worst]}: sequence {seq.id} ({seq.length} tokens) needs {need[worst] / GB:.2f} GB on "
        f"{device.name} alone in a micro-batch{why}, above the {device.available_bytes / GB:.2f} GB available there "
        f"({device.source}); allowed: shorter sequences (workload.max_len), a smaller model, or a device with more "
        "memory")
