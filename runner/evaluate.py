"""``python -m runner.evaluate <run dir | checkpoint.pt> [--lengths 512,2048] [--p 1.0,0.9] [--sequences N]
[--seed S]``: held-out accuracy of a checkpoint the runner wrote, under each top-p attention budget.

The model is rebuilt from the checkpoint's own config (shape, task, block size) and its weights, then runs
forward without gradients over ``--sequences`` new sequences per length, made by the task's generator from
``--seed``, which must differ from the training seed: every sequence's content is a function of (seed,
sequence id), so another seed gives sequences training never saw. Sensitivities are drawn from the training
workload's Beta distribution. Every sequence is run under every ``--p`` (one budget for all of them; ``p=1``
is dense).

Written into the run dir (or ``--out``), both at once after every forward has run:
* ``eval.csv``: per (length, p, sequence): items (pairs or chains), answers, correct answers, accuracy,
  and the kernel's kept fraction and coverage for the sequence, averaged over the layers;
* ``eval_summary.csv``, also printed: per (length, p), with the steps trained: accuracy over all answers with its 95%
  Wilson interval (scipy; answers counted as independent trials), mean kept fraction and coverage, ``chance``
  (one over the number of values) and ``item_chance``, what answering with the value of a random one of
  the sequence's own items scores (one over its items, a little more where values repeat): a model
  above ``chance`` but not above ``item_chance`` has learnt which tokens answer, not the lookup.

Same checkpoint and options give the same files on the same device.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from scipy.stats import binomtest

from sparsebalance.model import TinyLlama, make_model
from sparsebalance.runner import checkpoint
from sparsebalance.runner.attention import BACKENDS, make_attention
from sparsebalance.runner.data import pack
from sparsebalance.runner.device import DEVICES, check_attention, device_type
from sparsebalance.runner.sensitivity import training_block_size
from sparsebalance.runner.task import TaskConfig
from sparsebalance.sim.config import ModelConfig, validate
from sparsebalance.sim.core import (ArgumentParser, ConfigError, atomic_path, check_writable, number_list,
                                    one_line_errors)
from sparsebalance.sim.plan import Assignment, Budget
from sparsebalance.sim.results import FLOAT_FORMAT
from sparsebalance.sim.workload import Sequence, truth_of

# Held out by default; refused only when it is the checkpoint's own training seed (then pass --seed).
HELD_OUT_SEED = 1_000_003
CONFIDENCE = 0.95


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m runner.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a runner run dir (its checkpoint.pt) or a checkpoint file")
    parser.add_argument("--lengths", type=number_list(int), help="sequence lengths (default: the training "
                        "workload's max_len)")
    parser.add_argument("--p", type=number_list(float), default=[1.0, 0.95, 0.9, 0.8],
                        help="top-p coverage budgets in (0, 1]")
    parser.add_argument("--sequences", type=int, default=64, help="held-out sequences per length")
    parser.add_argument("--seed", type=int, default=HELD_OUT_SEED, help="data seed; not the training seed")
    parser.add_argument("--batch-tokens", type=int, default=32768, help="tokens per forward (at least one sequence)")
    parser.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICES)}")
    parser.add_argument("--attention", default="kernel", help=f"one of {', '.join(BACKENDS)}")
    parser.add_argument("--out", type=Path, help="directory for eval.csv and eval_summary.csv (default: the run dir)")
    args = parser.parse_args(argv)
    for name in ("sequences", "batch_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: allowed: >= 1")
    if args.seed < 0:  # numpy's generators take only non-negative seeds
        raise ConfigError(f"--seed {args.seed}: allowed: a whole number >= 0 other than the training seed")
    bad_p = [p for p in args.p if not 0.0 < p <= 1.0]  # NaN fails the comparison too
    if bad_p:
        raise ConfigError(f"--p {bad_p[0]}: allowed: budgets in (0, 1]")
    args.device = torch.device(device_type(args.device, "--device"))
    check_attention(args.attention, args.device.type, "--attention")
    return args


# ---------------------------------------------------------------------- the checkpoint
def checkpoint_path(source: Path) -> Path:
    path = source / "checkpoint.pt" if source.is_dir() else source
    if not path.is_file():
        raise ConfigError(f"{source}: no checkpoint there; allowed: a run dir written with "
                          "runner.checkpoint_every > 0, or its checkpoint.pt")
    return path


@dataclass(frozen=True)
class Trained:
    """What evaluation reads of a checkpoint: its weights and the parts of its config that made them."""

    weights: dict
    steps: int
    model: ModelConfig
    task: TaskConfig
    seed: int
    block_size: int
    sensitivity: tuple[float, float]  # the training workload's Beta(a, b)
    max_len: int


def load(path: Path) -> Trained:
    """The checkpoint, its model and task config checked as training checks them."""
    try:
        ckpt = checkpoint.read(path)
        checkpoint.check_structure(ckpt)
        config = ckpt["config"]
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), config["model"]))
        task = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TaskConfig), config["runner.task"]))
        validate(model, "model.")
        validate(task, "runner.task.")
        workload = config["workload"]
        return Trained(weights=ckpt["model"], steps=ckpt["next_step"], model=model, task=task,
                       seed=int(config["seed"]), block_size=training_block_size(config),
                       sensitivity=(float(workload["sensitivity_a"]), float(workload["sensitivity_b"])),
                       max_len=int(workload["max_len"]))
    except checkpoint.Invalid as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except (KeyError, TypeError, ValueError, OmegaConfBaseException) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path}: its config is not a runner's ({reason})") from None


def build_model(trained: Trained, path: Path, device: torch.device) -> TinyLlama:
    with torch.device("meta"):
        model = make_model(trained.model, trained.seed)
    try:
        model.load_state_dict(trained.weights, strict=True, assign=True)
    except RuntimeError as exc:
        raise ConfigError(f"{path}: its weights do not fit its model config ({' '.join(str(exc).split())})") from None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as trained (runner/loop.py)
    return model.to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------------- held-out data
def held_out(lengths: list[int], count: int, seed: int, beta: tuple[float, float]) -> list[Sequence]:
    """``count`` sequences per length; ids unique across lengths, sensitivities from the workload's Beta."""
    sensitivity = np.random.default_rng(seed).beta(*beta, size=(len(lengths), count))
    return [Sequence(i * count + j, length, float(sensitivity[i, j]))
            for i, length in enumerate(lengths) for j in range(count)]


def check_lengths(lengths: list[int], model_cfg: ModelConfig, task: TaskConfig) -> None:
    shortest = task.min_length(1.0)
    for length in lengths:
        if not shortest <= length <= model_cfg.max_context:
            raise ConfigError(f"--lengths {length}: allowed: lengths in [{shortest}, {model_cfg.max_context}] (the "
                              f"{task.name} task's most sensitive sequence, the model's max context)")


# ---------------------------------------------------------------------- the forwards
@torch.no_grad()
def evaluate(model: TinyLlama, task: TaskConfig, sequences: list[Sequence], ps: list[float], seed: int,
             block_size: int, backend: str, batch_tokens: int, device: torch.device) -> pd.DataFrame:
    attention = make_attention(backend, block_size)
    truth = truth_of(sequences)  # the data generator builds each sequence from its sensitivity
    rows = []
    for p in ps:
        budget = Budget(p=p)
        for batch in batches(sequences, batch_tokens):
            assignments = tuple(Assignment(s.id, s.length, 0, 0, budget) for s in batch)
            packed = pack(assignments, truth, task, model.shape.vocab, seed, device)
            out = model(packed.tokens, packed.cu_seqlens, (packed.p, None), packed.target_positions, attention)
            right = (out.logits.argmax(-1) == packed.targets).cpu().numpy()
            answers = [task.queries(s.sensitivity) for s in batch]
            per_seq = np.split(right, np.cumsum(answers)[:-1])
            for s, n, r, kept, cov in zip(batch, answers, per_seq, out.kept_fraction.cpu().tolist(),
                                          out.coverage.cpu().tolist(), strict=True):
                rows.append({"length": s.length, "p": p, "seq_id": s.id, "sensitivity": s.sensitivity,
                             "items": task.n_pairs(s.sensitivity), "answers": n, "correct": int(r.sum()),
                             "accuracy": float(r.mean()),
                             "kept_fraction": kept, "coverage": cov})
    return pd.DataFrame(rows)


def batches(sequences: list[Sequence], batch_tokens: int):
    """Consecutive runs of sequences of at most ``batch_tokens`` tokens, at least one sequence each."""
    batch, tokens = [], 0
    for a in sequences:
        if batch and tokens + a.length > batch_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(a)
        tokens += a.length
    if batch:
        yield batch


def summarise(per_sequence: pd.DataFrame, task: TaskConfig) -> pd.DataFrame:
    def one(group: pd.DataFrame) -> pd.Series:
        correct, answers = int(group["correct"].sum()), int(group["answers"].sum())
        ci = binomtest(correct, answers).proportion_ci(CONFIDENCE, method="wilson")
        return pd.Series({"sequences": len(group), "answers": answers, "accuracy": correct / answers,
                          "ci_low": ci.low, "ci_high": ci.high, "kept_fraction": group["kept_fraction"].mean(),
                          "coverage": group["coverage"].mean(), "chance": 1.0 / task.n_values,
                          "item_chance": float((group["answers"] / group["items"]).sum() / answers)})

    table = per_sequence.groupby(["length", "p"], sort=False)[list(per_sequence.columns)].apply(one)
    return table.reset_index().astype({"sequences": int, "answers": int})


def write_csv(frame: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, float_format=FLOAT_FORMAT)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = checkpoint_path(args.source)
    out_dir = args.out or path.parent
    if not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: no such directory")
    check_writable(out_dir, "--out", directory=True)
    trained = load(path)
    task = trained.task
    if args.seed == trained.seed:
        raise ConfigError(f"--seed {args.seed}: the checkpoint trained on that seed; allowed: any other")
    lengths = args.lengths or [trained.max_len]
    check_lengths(lengths, trained.model, task)
    device = args.device
    model = build_model(trained, path, device)
    sequences = held_out(lengths, args.sequences, args.seed, trained.sensitivity)
    per_sequence = evaluate(model, task, sequences, args.p, args.seed, trained.block_size, args.attention,
                            args.batch_tokens, device)
    summary = summarise(per_sequence, task)
    summary.insert(0, "steps", trained.steps)  # tables of several runs compare runs of equal steps
    write_csv(per_sequence, out_dir / "eval.csv")
    write_csv(summary, out_dir / "eval_summary.csv")
    print(f"{path}: {task.name} task, {trained.steps} steps trained, {args.sequences} held-out sequences "
          f"per length (seed {args.seed}), {CONFIDENCE:.0%} Wilson intervals")
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    return 0


if __name__ == "__main__":
    main()
