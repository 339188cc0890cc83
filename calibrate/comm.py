"""All-reduce and send/recv bandwidth over message sizes, one process per GPU (NCCL; gloo on the CPU for tests).

Collectives must be called the same number of times on every rank, so this does not use do_bench (whose
repetition count follows each rank's own estimate): a fixed number of warm-up and timed iterations, each
timed on the host between device synchronisations, median kept.
"""
from __future__ import annotations

import json
import socket
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = tuple(1 << s for s in (20, 22, 24, 26, 28))  # bytes: 1 MiB .. 256 MiB
WARMUP = 3
ITERS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(op, device: torch.device) -> float:
    """One call in ms, the ranks lined up before it so that no rank's wait for the others is counted."""
    dist.barrier()
    if device.type != "cuda":
        t = time.perf_counter()
        op()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    op()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _median_ms(op, device: torch.device) -> float:
    for _ in range(WARMUP):
        _timed(op, device)
    return float(np.median([_timed(op, device) for _ in range(ITERS)]))


def _worker(rank: int, world: int, backend: str, port: int, sizes: tuple[int, ...], out: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results: dict[str, list[dict]] = {"allreduce": [], "p2p": []}
    for size in sizes:
        x = torch.randn(size // 4, device=device)  # fp32: 4 bytes an element
        ms = _median_ms(partial(dist.all_reduce, x), device)
        busbw = 2 * (world - 1) / world * size / (ms * 1e6)  # GB/s, the ring algorithm's bus bandwidth
        results["allreduce"].append({"bytes": size, "median_ms": ms, "busbw_gbps": busbw})

        def pair(x=x):  # rank 0 -> rank 1; the other ranks only join the barriers
            if rank == 0:
                dist.send(x, dst=1)
            elif rank == 1:
                dist.recv(x, src=0)

        ms = _median_ms(pair, device)
        results["p2p"].append({"bytes": size, "median_ms": ms, "gbps": size / (ms * 1e6)})
    if rank == 1:  # the receiver's clock includes the whole transfer
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def measure_comm(world: int, backend: str = "nccl", sizes: tuple[int, ...] = SIZES) -> dict:
    """Bandwidth over ``sizes`` with ``world`` processes, plus the large-message figures the profile keeps."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "comm.json")
        mp.spawn(_worker, args=(world, backend, _free_port(), sizes, out), nprocs=world, join=True)
        results = json.loads(Path(out).read_text())
    results["world"] = world
    results["backend"] = backend
    results["allreduce_busbw_gbps"] = max(r["busbw_gbps"] for r in results["allreduce"])
    results["p2p_gbps"] = max(r["gbps"] for r in results["p2p"])
    return results
