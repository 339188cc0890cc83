"""torch.distributed plumbing: world checks, timeouts, a monitored barrier, gradient all-reduce.

A rank that dies or hangs must end the job with a clear error rather than a silent hang: every
collective runs under the configured timeout, and each step begins with a gloo ``monitored_barrier``
(on a side group, also when the training backend is NCCL) that names the ranks that did not arrive.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


# NVLink multicast (NVLS) is kept off on every launch: the lent multi-GPU machines must not use it, and the
# gradient all-reduce does not need it. A user's explicit setting wins.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class RankFailure(RuntimeError):
    """Another rank died or hung; raised on the ranks that are still alive."""


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> World:
        """torchrun's variables; a plain ``python -m runner.train`` is a world of one."""
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )


def check_world(world: World, dp: int, cp: int, pp: int) -> None:
    if world.size != dp * cp * pp:
        raise ValueError(
            f"world size {world.size} does not match the layout dp*cp*pp = {dp}*{cp}*{pp} = {dp * cp * pp}"
        )
    if cp != 1 or pp != 1:
        raise ValueError(f"the runner implements data parallelism only (got cp={cp}, pp={pp}; need 1 and 1)")


class Comm:
    """The process group of one run, with timing of the two things the Results record:
    the wait at the step barrier (idle) and the gradient all-reduce (comm)."""

    def __init__(self, world: World, device: torch.device, timeout_s: float) -> None:
        self.world, self.device = world, device
        self.timeout = timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            for key, value in NO_MULTICAST_ENV.items():
                os.environ.setdefault(key, value)
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                rank=world.rank, world_size=world.size, timeout=self.timeout,
                device_id=device if device.type == "cuda" else None,
            )
        # monitored_barrier exists only for gloo; NCCL runs keep a gloo side group for it.
        self.monitor = dist.group.WORLD if device.type == "cpu" else dist.new_group(backend="gloo", timeout=self.timeout)

    def barrier(self, what: str) -> float:
        """Wait for every rank, naming the missing ones after the timeout; returns the wait in ms."""
        self.sync()
        t0 = time.perf_counter()
        try:
            dist.monitored_barrier(group=self.monitor, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as err:
            raise RankFailure(
                f"rank {self.world.rank}: not every rank reached {what} within "
                f"{self.timeout.total_seconds():g} s (a rank died or hung): {_first_line(err)}"
            ) from err
        return (time.perf_counter() - t0) * 1e3

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> float:
        """Sum gradients over ranks in one flat buffer (the loss is already normalised by the
        global number of scored tokens); returns the time in ms."""
        grads = [p.grad for p in params]
        self.sync()
        t0 = time.perf_counter()
        if self.world.size > 1:
            flat = _flatten_dense_tensors(grads)
            try:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            except RuntimeError as err:
                raise RankFailure(
                    f"rank {self.world.rank}: gradient all-reduce failed or timed out after "
                    f"{self.timeout.total_seconds():g} s (a rank died or hung): {_first_line(err)}"
                ) from err
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        self.sync()
        return (time.perf_counter() - t0) * 1e3

    def gather(self, obj):
        """Every rank's ``obj`` on every rank (small Python objects: records, RNG states)."""
        out = [None] * self.world.size
        dist.all_gather_object(out, obj, group=self.monitor)
        return out

    def broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.monitor)
        return box[0]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if dist.is_initialized():
            # No rank tears its connections down while another may still be in its last collective: a rank
            # of a 2-rank gloo run once aborted at exit (std::terminate, SIGABRT) after its last step in CI.
            self.barrier("the end of the run")
            dist.destroy_process_group()


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
