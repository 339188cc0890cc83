"""The device a runner command runs on, and whether its attention backend runs there: one check for every
command (``runner.train``'s ``runner.device`` and ``runner.attention``; the ``--device`` and ``--attention`` of
``runner.replay``, ``runner.evaluate`` and ``runner.sensitivity``). A bad value is one ``ConfigError`` line that
names the option it came from."""
from __future__ import annotations

import os

import torch

from sparsebalance.runner.attention import BACKENDS
from sparsebalance.sim.core import ConfigError

DEVICES = ("auto", "cuda", "cpu")


def device_type(name: str, option: str = "runner.device") -> str:
    """``name`` (one of DEVICES) as the device type this machine gives it: ``auto`` is cuda where a CUDA device
    is visible, else cpu."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in DEVICES:
        raise ConfigError(f"{option}={name!r} is unknown; allowed: {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option}=cuda but no CUDA device is visible; allowed here: auto, cpu")
    return name


def check_attention(backend: str, device: str, option: str = "runner.attention") -> None:
    """Whether the attention backend ``backend`` runs on a ``device`` (a device type): Triton on the CPU only
    under its interpreter."""
    if backend not in BACKENDS:
        raise ConfigError(f"{option}={backend!r} is unknown; allowed: {', '.join(BACKENDS)}")
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"{option}='triton' on the CPU runs only under TRITON_INTERPRET=1 (the Triton interpreter); "
            f"allowed on the CPU: {', '.join(b for b in BACKENDS if b != 'triton')}"
        )
