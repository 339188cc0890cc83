"""Every launch keeps NVLink multicast off unless the user set the variables explicitly."""
import os
import socket

import torch

from sparsebalance.runner.dist import NO_MULTICAST_ENV, Comm, World
from sparsebalance.sim.cluster import Layout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_turns_nvlink_multicast_off_but_keeps_explicit_settings(monkeypatch):
    for key in NO_MULTICAST_ENV:
        # setenv first so that monkeypatch also removes what Comm sets, after the test
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "explicit")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    comm = Comm(World(rank=0, size=1, local_rank=0), torch.device("cpu"), timeout_s=30, layout=Layout(dp=1))
    try:
        assert os.environ["NCCL_NVLS_ENABLE"] == "explicit"
        assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
    finally:
        comm.close()
