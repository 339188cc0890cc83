"""Checkpoint and resume: model, optimiser, data position (the next step), every rank's RNG state,
and the Results rows so far, so that a resumed run writes one continuous loss curve.

Data needs no iterator state: the batch of step ``s`` is a pure function of (seed, s)."""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from sim.config import ConfigError


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: Path, *, model, optimizer, next_step: int, rng_states: list[dict], history: dict,
         config: dict) -> None:
    """Write atomically (temp file, then rename) so a crash mid-save never leaves a torn checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "next_step": next_step,
            "rng": rng_states,
            "history": history,
            "config": config,
        },
        tmp,
    )
    os.replace(tmp, path)


def load(path: Path, world_size: int, config: dict) -> dict:
    """The checkpoint, if this run can continue it; otherwise one ConfigError line."""
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if len(ckpt["rng"]) != world_size:
        raise ConfigError(f"checkpoint {path} was written by {len(ckpt['rng'])} ranks, this run has {world_size}")
    changed = sorted(k for k in config if k != "steps" and ckpt["config"].get(k) != config[k])
    if changed:
        raise ConfigError(f"checkpoint {path} was written with a different config: {', '.join(changed)} differ")
    return ckpt
