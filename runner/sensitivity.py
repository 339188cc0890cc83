"""``python -m runner.sensitivity <checkpoint.pt | run dir> --lengths 512,...,32768 --p 0.5,...,0.99
[--kept 0.1,0.25,0.5] --sequences N --out raw.csv``: how much attention coverage a trained model keeps at each
budget, per sequence and layer, on held-out sequences of the task it was trained on.

The sequences are the checkpoint's task (``runner.task.make_example`` with its ``runner.task``, vocabulary and
seed), ``N`` per length, numbered from ``HELD_OUT`` on, beyond every id a training run draws, and given the
sensitivities the run's workload draws for their lengths (the task's generator takes one). Each sequence is
forwarded without gradients once per mode, its copies packed side by side, one per budget (varlen attention
keeps them apart, so each copy is the sequence alone at that budget, every layer at it, as training runs a
Plan's budget). The model gets the attention of runner/attention.py wrapped in a tap that records what the
kernel's selection reports at each call, i.e. per layer, so the model needs no change. One row per
(sequence, layer, budget) goes to the CSV (``sim.sensitivity.RAW_COLUMNS``): the run's facts are written beside it
first (``<stem>.meta.json``), then the CSV, rewritten after each length, shortest first, so that a run cut short
keeps the lengths it finished; ``python -m calibrate.sensitivity`` fits it.

On a GPU the kernel runs in bf16 as in training; on the CPU its PyTorch reference in fp32 (tests).
"""
from __future__ import annotations

import argparse
import datetime as dt
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf

from sparsebalance.kernels.sparse_attention import BLOCK_SIZES
from sparsebalance.model import TinyLlama, make_model
from sparsebalance.runner import checkpoint
from sparsebalance.runner.attention import BACKENDS, make_attention
from sparsebalance.runner.device import check_attention, device_type
from sparsebalance.runner.task import TaskConfig, make_example
from sparsebalance.sim.cluster import Cluster
from sparsebalance.sim.config import ClusterConfig, CostConfig, ModelConfig, WorkloadConfig
from sparsebalance.sim.core import (ConfigError, atomic_path, check_writable, one_line_errors, parse_numbers,
                                    write_json_atomic)
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.results import FLOAT_FORMAT
from sparsebalance.sim.sensitivity import MODES, RAW_COLUMNS, raw_meta_path
from sparsebalance.sim.workload import Workload

# Held-out sequence ids start here: a training run numbers its sequences step * global_batch + i, far below.
HELD_OUT = 1 << 40
# The checkpoint's config keys the measurement reads, with their types.
CONFIG_KEYS = {"seed": int, "model": dict, "workload": dict, "cost": dict, "cluster": dict, "runner.task": dict}
DEFAULT_MAX_TOKENS = 131072  # tokens per forward: the copies of a sequence are split over forwards beyond this


@dataclass(frozen=True)
class Trained:
    """A checkpoint's model with what it was trained on."""

    model: TinyLlama
    task: TaskConfig
    config: dict  # the checkpoint's config (runner.checkpoint: the keys a resumed run must agree on)
    steps: int  # optimiser steps trained
    block_size: int  # the kernel's block size in training (the run's cost model's)

    @property
    def seed(self) -> int:
        return int(self.config["seed"])

    @property
    def vocab(self) -> int:
        return int(self.config["model"]["vocab"])


def checkpoint_file(source: Path) -> Path:
    """A checkpoint file, or the one a run dir holds."""
    return source / "checkpoint.pt" if source.is_dir() else source


def load_trained(source: Path, device: torch.device, dtype: torch.dtype) -> Trained:
    path = checkpoint_file(source)
    try:
        ckpt = checkpoint.read(path)
        check_weights(ckpt)
    except checkpoint.Invalid as exc:
        raise ConfigError(f"checkpoint {path}: {exc}") from None
    cfg = ckpt["config"]
    model = make_model(OmegaConf.create(cfg["model"]), cfg["seed"])
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise ConfigError(f"checkpoint {path}: its weights do not fit its model config "
                          f"({str(exc).splitlines()[0]})") from None
    return Trained(model.to(device=device, dtype=dtype).eval(), TaskConfig(**cfg["runner.task"]), cfg,
                   ckpt["next_step"], training_block_size(cfg))


def check_weights(ckpt) -> None:
    """What the measurement reads, with the types it uses: the format and version, the weights, the steps trained
    and the config keys below. The training history is not read, so a checkpoint whose records an older runner
    wrote is measured all the same."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != checkpoint.FORMAT:
        raise checkpoint.Invalid(f"not a runner checkpoint; allowed: format {checkpoint.FORMAT!r}")
    if ckpt.get("version") != checkpoint.VERSION:
        raise checkpoint.Invalid(f"checkpoint version {ckpt.get('version')!r}; this runner reads version "
                                 f"{checkpoint.VERSION}")
    weights, cfg, steps = ckpt.get("model"), ckpt.get("config"), ckpt.get("next_step")
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise checkpoint.Invalid("model is not a dict of tensors")
    if type(steps) is not int or steps < 1:
        raise checkpoint.Invalid(f"next_step={steps!r}; allowed: a whole number >= 1")
    missing = [k for k in CONFIG_KEYS if not isinstance(cfg, dict) or not isinstance(cfg.get(k), CONFIG_KEYS[k])]
    if missing:
        raise checkpoint.Invalid(f"its config lacks {', '.join(missing)} (or has them of another type)")


def _structured(schema: type, values: dict):
    """A config dataclass from a checkpoint's plain dict (keys added to the schema since keep their defaults)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))


def training_block_size(cfg: dict) -> int:
    """The block size the run's attention used: its cost model's, as the trainer takes it."""
    cluster = Cluster.from_config(_structured(ClusterConfig, cfg["cluster"]))
    cost = make_cost(_structured(CostConfig, cfg["cost"]), _structured(ModelConfig, cfg["model"]), cluster,
                     recompute=False)
    return cost.block_size


# ---------------------------------------------------------------------- held-out sequences
@dataclass(frozen=True)
class HeldOut:
    seq_id: int
    length: int
    data_sensitivity: float  # what the task's generator is given


def held_out(trained: Trained, lengths: list[int], per_length: int) -> list[HeldOut]:
    """``per_length`` sequences of each length, with the sensitivities the run's workload draws for them."""
    cfg = trained.config
    workload = Workload(_structured(WorkloadConfig, cfg["workload"]), int(cfg["model"]["max_context"]), trained.seed)
    all_lengths = np.repeat(np.asarray(lengths, dtype=np.int64), per_length)
    sens = workload.sensitivities(all_lengths, np.random.default_rng([trained.seed, HELD_OUT]))
    return [HeldOut(HELD_OUT + i, int(n), float(s)) for i, (n, s) in enumerate(zip(all_lengths, sens, strict=True))]


def check_lengths(lengths: list[int], trained: Trained) -> None:
    context = int(trained.config["model"]["max_context"])
    shortest = trained.task.min_length(1.0)
    for n in lengths:
        if not shortest <= n <= context:
            raise ConfigError(f"--lengths: {n} is outside [{shortest}, {context}]; allowed: lengths that hold the "
                              f"{trained.task.name} task's records and fit the model's context")


# ---------------------------------------------------------------------- measuring
class LayerTap:
    """The model's attention, recording the kernel's per-sequence kept fraction and coverage at every call (the
    model calls it once per layer, in layer order)."""

    def __init__(self, attend) -> None:
        self.attend = attend
        self.calls: list[tuple[np.ndarray, np.ndarray]] = []

    def __call__(self, q, k, v, cu_seqlens, budgets):
        o, kept, coverage = self.attend(q, k, v, cu_seqlens, budgets)
        self.calls.append((kept.float().cpu().numpy(), coverage.float().cpu().numpy()))
        return o, kept, coverage


@torch.no_grad()
def forward_copies(trained: Trained, tokens: np.ndarray, mode: str, budgets: list[float], attend,
                   device: torch.device) -> list[tuple[np.ndarray, np.ndarray]]:
    """One forward of ``len(budgets)`` copies of a sequence, copy i at budget i; per layer (kept, coverage) [copies]."""
    n, length = len(budgets), tokens.size
    cu_seqlens = torch.arange(n + 1, dtype=torch.int32) * length
    budget = torch.tensor(budgets, dtype=torch.float32)
    tap = LayerTap(attend)
    trained.model(torch.as_tensor(np.tile(tokens, n), device=device), cu_seqlens,
                  (budget, None) if mode == "p" else (None, budget),
                  (cu_seqlens[1:] - 1).to(device=device, dtype=torch.long), tap)
    return tap.calls


def measure_sequence(trained: Trained, seq: HeldOut, modes: dict[str, list[float]], attend, device: torch.device,
                     max_tokens: int) -> list[dict]:
    """The rows of one sequence: every layer at every budget of every mode."""
    layers = [int(name) for name in trained.model.blocks]
    tokens = make_example(trained.task, trained.vocab, trained.seed, seq.seq_id, seq.length,
                          seq.data_sensitivity).tokens
    per_forward = max(1, max_tokens // seq.length)
    rows = []
    for mode, budgets in modes.items():
        for start in range(0, len(budgets), per_forward):
            chunk = budgets[start:start + per_forward]
            calls = forward_copies(trained, tokens, mode, chunk, attend, device)
            for layer, (kept, coverage) in zip(layers, calls, strict=True):
                rows.extend({**asdict(seq), "task": trained.task.name, "layer": layer, "mode": mode, "budget": b,
                             "kept_fraction": float(k), "coverage": float(c)}
                            for b, k, c in zip(chunk, kept, coverage, strict=True))
    return rows


def measure_all(trained: Trained, sequences: list[HeldOut], modes: dict[str, list[float]], attend,
                device: torch.device, max_tokens: int, out: Path) -> pd.DataFrame:
    """Every sequence's rows, shortest lengths first; the CSV is rewritten (atomically) after each length, so
    that a run cut short by a time limit keeps the lengths it finished."""
    rows: list[dict] = []
    for length in sorted({seq.length for seq in sequences}):
        started = time.monotonic()
        batch = [seq for seq in sequences if seq.length == length]
        for seq in batch:
            rows += measure_sequence(trained, seq, modes, attend, device, max_tokens)
        frame = pd.DataFrame(rows, columns=list(RAW_COLUMNS))
        with atomic_path(out) as tmp:
            frame.to_csv(tmp, index=False, float_format=FLOAT_FORMAT)
        print(f"length {length}: {len(batch)} sequences in {time.monotonic() - started:.1f} s", file=sys.stderr,
              flush=True)
    return frame


# ---------------------------------------------------------------------- command line
def _numbers(text: str, flag: str, kind: type, allowed: str, ok) -> list:
    try:
        return sorted(set(parse_numbers(text, kind, ok, allowed)))
    except ValueError as exc:
        raise ConfigError(f"{flag} {exc}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m runner.sensitivity", description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="a runner checkpoint.pt, or the run dir holding one")
    ap.add_argument("--lengths", required=True, help="comma-separated sequence lengths in tokens")
    ap.add_argument("--p", default="0.5,0.7,0.8,0.9,0.95,0.99", help="top-p coverage targets in (0, 1]")
    ap.add_argument("--kept", default="", help="fixed kept fractions in (0, 1) (default: none)")
    ap.add_argument("--sequences", type=int, default=8, help="held-out sequences per length")
    ap.add_argument("--out", type=Path, required=True, help="the raw CSV (its .meta.json goes beside it)")
    ap.add_argument("--device", default="auto", help="auto (cuda when available) | cuda | cpu")
    ap.add_argument("--attention", default="kernel", help=f"attention backend: {', '.join(BACKENDS)}")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens per forward at most")
    ap.add_argument("--block-size", type=int, default=None,
                    help=f"the kernel's block size to measure at, one of {', '.join(map(str, BLOCK_SIZES))} "
                         "(default: the one the run trained with)")
    args = ap.parse_args(argv)
    args.lengths = _numbers(args.lengths, "--lengths", int, "whole numbers of tokens >= 1", lambda n: n >= 1)
    args.p = _numbers(args.p, "--p", float, "coverage targets in (0, 1]", lambda p: 0 < p <= 1)
    args.kept = (_numbers(args.kept, "--kept", float, "kept fractions in (0, 1)", lambda k: 0 < k < 1)
                 if args.kept else [])
    for flag in ("sequences", "max_tokens"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: allowed: a whole number >= 1")
    args.device = torch.device(device_type(args.device, "--device"))
    check_attention(args.attention, args.device.type, "--attention")
    if args.block_size is not None and args.block_size not in BLOCK_SIZES:
        raise ConfigError(f"--block-size {args.block_size}: allowed: {', '.join(map(str, BLOCK_SIZES))}")
    return args


def run_facts(args: argparse.Namespace, trained: Trained, device: torch.device, command: str) -> dict:
    shape = trained.model.shape
    return {
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "checkpoint": str(checkpoint_file(args.source)),
        "trained_steps": trained.steps,
        "model": asdict(shape),
        "task": {trained.task.name: trained.config["runner.task"]},
        "seed": trained.seed,
        "block_size": trained.block_size,
        "lengths": args.lengths, "p": args.p, "kept": args.kept, "sequences_per_length": args.sequences,
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "attention": args.attention, "host": platform.node(), "torch": torch.__version__,
    }


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_writable(args.out, "--out")  # its .meta.json goes beside it
    device = args.device
    # The trainer's precisions: bf16 as the calibrated kernel runs on the GPU, fp32 in the CPU reference.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    trained = load_trained(args.source, device, dtype)
    if args.block_size is not None:
        # A model trained at one block size is measured at another: the sensitivity at the block that training
        # will use, e.g. a small model trained at block 32 measured at the production kernel's 128.
        trained = replace(trained, block_size=args.block_size)
    check_lengths(args.lengths, trained)
    modes = {mode: budgets for mode, budgets in zip(MODES, (args.p, args.kept), strict=True) if budgets}
    attend = make_attention(args.attention, trained.block_size)
    command = shlex.join(["python", "-m", "runner.sensitivity", *(sys.argv[1:] if argv is None else argv)])
    write_json_atomic(raw_meta_path(args.out), run_facts(args, trained, device, command))
    raw = measure_all(trained, held_out(trained, args.lengths, args.sequences), modes, attend, device,
                      args.max_tokens, args.out)
    summary = raw.groupby(["length", "mode", "budget"])[["kept_fraction", "coverage"]].mean()
    print(summary.to_string(float_format=lambda x: f"{x:.4f}"))
    print(f"wrote {len(raw)} rows ({len(raw.seq_id.unique())} sequences x {len(trained.model.blocks)} layers x "
          f"{sum(map(len, modes.values()))} budgets) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
