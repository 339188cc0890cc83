"""torch.distributed plumbing: world checks, the layout's process groups, timeouts and failure reports.

Ranks follow the simulator's placement (``sim.cluster``: ``rank = cp_rank + cp * (dp_rank + dp * stage)``),
which is a row-major ``DeviceMesh`` of shape (pp, dp, cp). A stage's gradients are reduced over its
replicas: the mesh's ``dp`` dimension, and with context parallelism its dp x cp ranks, since every CP rank
of a replica holds the stage's whole weights and computes a part of their gradient (the data-parallel
dimension with cp folded into it, as torchtitan reduces them). The cp ranks of one replica's stage form
the ring of runner/cp.py. Activations pass between neighbouring stages of one replica, CP rank to the same
CP rank.

A rank that dies or hangs must end the job with a clear error rather than a silent hang: every collective
and transfer runs under the configured timeout, and a step whose communication fails asks a gloo
``monitored_barrier`` (on a side group, also when the training backend is NCCL) which ranks are missing.
Nothing waits on other ranks in a healthy step beyond the gradient reduction itself.
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.utils.distributed import get_free_port

from sparsebalance.runner.cp import Ring
from sparsebalance.sim.cluster import Layout

# NVLink multicast (NVLS) is kept off on every launch: the lent multi-GPU machines must not use it, and the
# gradient all-reduce does not need it. A user's explicit setting wins.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# The diagnosis after a failed step waits longer than one timeout: a healthy rank may itself be waiting out a
# timeout on the failed collective before it arrives.
DIAGNOSIS_TIMEOUTS = 2
GLOO_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


class RankFailure(RuntimeError):
    """Another rank died or hung; raised on the ranks that are still alive."""


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int = 1  # the ranks on this host, which share its memory

    @classmethod
    def from_env(cls) -> World:
        """torchrun's variables; a plain ``python -m runner.train`` is a world of one."""
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            local_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        )


def check_world(world: World, dp: int, cp: int, pp: int) -> None:
    if world.size != dp * cp * pp:
        raise ValueError(
            f"world size {world.size} does not match the layout dp*cp*pp = {dp}*{cp}*{pp} = {dp * cp * pp}"
        )


class Comm:
    """The process groups of one run and this rank's place in the layout."""

    def __init__(self, world: World, device: torch.device, timeout_s: float, layout: Layout) -> None:
        self.world, self.device, self.layout = world, device, layout
        self.timeout = timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            # A plain ``python -m runner.train`` (a world of one) takes a free port, so that several of them run
            # side by side; torchrun sets the port of a larger world.
            os.environ.setdefault("MASTER_PORT", str(get_free_port()) if world.size == 1 else "29500")
            for key, value in NO_MULTICAST_ENV.items():
                os.environ.setdefault(key, value)
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                rank=world.rank, world_size=world.size, timeout=self.timeout,
                device_id=device if device.type == "cuda" else None,
            )
        # monitored_barrier exists only for gloo; a group of its own still answers after the training
        # group's connections closed on a timeout.
        self.monitor = dist.new_group(backend="gloo", timeout=self.timeout)
        self.mesh = init_device_mesh(device.type, (layout.pp, layout.dp, layout.cp), mesh_dim_names=("pp", "dp", "cp"))
        self.stage, self.dp_rank, self.cp_rank = self.mesh.get_coordinate()
        stride = layout.dp * layout.cp
        self.replicas = self.mesh["dp"] if layout.cp == 1 else self._replica_mesh(stride)
        self.ring = self._ring() if layout.cp > 1 else None
        self.prev = world.rank - stride if self.stage > 0 else None
        self.next = world.rank + stride if self.stage < layout.pp - 1 else None
        self.ends = self._ends_group(stride)

    @property
    def first_replica(self) -> bool:
        """Whether this rank is its stage's first holder of the weights (the one whose state is saved)."""
        return self.dp_rank == 0 and self.cp_rank == 0

    def _replica_mesh(self, stride: int) -> DeviceMesh:
        """The dp x cp ranks of this rank's stage (contiguous under the placement), a 1-D mesh for DDP and
        FSDP. Its group is made here with the run's timeout, which the mesh's own groups do not carry."""
        mine = None
        for stage in range(self.layout.pp):
            ranks = list(range(stage * stride, (stage + 1) * stride))
            group = dist.new_group(ranks, timeout=self.timeout)
            if self.world.rank in ranks:
                mine = group
        return DeviceMesh.from_group(mine, self.device.type, mesh_dim_names=("dp_cp",))

    def _ring(self) -> Ring:
        """The cp ranks of this rank's replica and stage, in cp order, with the run's timeout."""
        cp, mine = self.layout.cp, None
        for first in range(0, self.world.size, cp):
            ranks = list(range(first, first + cp))
            group = dist.new_group(ranks, timeout=self.timeout)
            if self.world.rank in ranks:
                mine = Ring(group, tuple(ranks), self.world.rank - first)
        return mine

    def _ends_group(self, stride: int):
        """The first and the last stage of this rank's replica (the two holders of a tied embedding), or None.
        Every rank takes part in creating every group."""
        if self.layout.pp == 1:
            return None
        mine = None
        for offset in range(stride):
            ranks = [offset, offset + stride * (self.layout.pp - 1)]
            group = dist.new_group(ranks, timeout=self.timeout)
            if self.world.rank in ranks:
                mine = group
        return mine

    @contextlib.contextmanager
    def guard(self, what: str):
        """Communication of ``what``: when it fails (a timeout, a closed connection), a RankFailure that names
        the ranks missing at a monitored barrier; when every rank reaches that barrier, the error was this
        rank's own and propagates unchanged."""
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, RankFailure) or not dist.is_initialized() or self.world.size == 1:
                raise
            missing = self._missing_ranks()
            if missing is None:
                raise
            raise RankFailure(
                f"rank {self.world.rank}: {what} failed or timed out after {self.timeout.total_seconds():g} s "
                f"(a rank died or hung): {_first_line(err)}; {missing}"
            ) from err

    def _missing_ranks(self) -> str | None:
        try:
            dist.monitored_barrier(group=self.monitor, timeout=DIAGNOSIS_TIMEOUTS * self.timeout, wait_all_ranks=True)
        except RuntimeError as err:
            return _first_line(err)
        return None

    def barrier(self, what: str) -> None:
        """Wait for every rank, naming the missing ones after the timeout."""
        self.sync()
        try:
            dist.monitored_barrier(group=self.monitor, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as err:
            raise RankFailure(
                f"rank {self.world.rank}: not every rank reached {what} within "
                f"{self.timeout.total_seconds():g} s (a rank died or hung): {_first_line(err)}"
            ) from err

    def gather(self, obj):
        """Every rank's ``obj`` on every rank (small Python objects: records, RNG states)."""
        out = [None] * self.world.size
        dist.all_gather_object(out, obj, group=self.monitor)
        return out

    def gather_to_first(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0 only (larger objects: a stage's weights and optimiser state)."""
        out = [None] * self.world.size if self.world.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.monitor)
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
    """The message's first line, without the source location gloo puts before it."""
    text = str(err).strip()
    return GLOO_LOCATION.sub("", text.splitlines()[0]) if text else type(err).__name__
