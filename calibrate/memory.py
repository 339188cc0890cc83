"""Measure what the runner's layers hold on the GPU and fit sim.memory's per-token activation terms to it.

Measuring, on a CUDA machine (torch and Triton only: no Hydra, OmegaConf or simpy is imported)::

    python -m calibrate.memory --out DIR [--models qwen2.5-3b llama3-8b] [--time-budget-s 180]

builds ``sparsebalance.model.Block`` layers at each model's shape (bf16, the runner's attention path: the Triton
kernel), and for packed micro-batches of 4K..64K tokens, 1 and 2 layers, with and without activation
checkpointing (``torch.utils.checkpoint``, non-reentrant, per layer), dense and at a kept fraction of 0.3,
runs one forward and backward and records ``torch.cuda.memory_allocated`` after the forward and
``torch.cuda.max_memory_allocated`` over both, each relative to what was allocated before (weights, their
preallocated gradients, the input). Every row is appended to ``DIR/memory_raw.csv`` as it is measured; the
run's facts go to ``DIR/memory_raw.meta.json``. Each point packs its own lengths, so the kernel builds a
fresh block layout and selection inside it, as for every micro-batch in training.

Fitting, anywhere::

    python -m calibrate.memory --fit DIR/memory_raw.csv [--profile calibrate/profiles/h200_memory.json]

fits per model shape and storage mode (``full``, ``checkpointed``), by non-negative least squares,
``held = held_layer x layers x tokens + held_micro_batch x tokens`` and ``peak - held = transient x tokens +
transient_bytes``, after taking off the kernel's block selection as sim.memory counts it; the points at
HELDOUT_TOKENS tokens are left out of the fit and score it. It prints measured against predicted activation
peaks (first principles and fitted) and writes the profile that ``memory.profile`` names.

Both figures are activation bytes of one micro-batch on one stage: ``held`` is what the forward keeps for
the backward, the stage's input included and its output left out (the next stage holds it), and ``peak``
the most at any time during the forward and backward, with the incoming gradient.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sparsebalance.calibrate.store import append_rows
from sparsebalance.sim.core import check_writable, fail, one_line_errors, write_json_atomic
from sparsebalance.sim.gpu_kinds import default_kind
from sparsebalance.sim.shapes import ModelShape, load_shapes, model_names

# The default cluster's GPU kind's.
DEFAULT_PROFILE = Path(__file__).resolve().parent / "profiles" / f"{default_kind().gpu}_memory.json"
RAW_CSV = "memory_raw.csv"
TOKENS = (4096, 8192, 16384, 32768, 65536)
LAYERS = (1, 2)
KEPT_FRACTIONS = (1.0, 0.3)
HELDOUT_TOKENS = 16384
TIME_BUDGET_S = 180.0
COLUMNS = ("model", "hidden", "heads", "kv_heads", "head_dim", "ffn", "block_size", "layers", "checkpointing",
           "kept_fraction", "lengths", "tokens", "base_bytes", "held_bytes", "peak_bytes", "forward_peak_bytes")


@dataclass(frozen=True)
class Point:
    model: str
    tokens: int
    layers: int
    checkpointing: bool
    kept_fraction: float
    small: int  # the last document's length: this point's own, and so is the kernel's block layout

    @property
    def lengths(self) -> tuple[int, ...]:
        """A packed micro-batch of ``tokens``: a half, a quarter and two smaller documents."""
        half, quarter = self.tokens // 2, self.tokens // 4
        return half, quarter, self.tokens - half - quarter - self.small, self.small


def build_points(models: list[str], token_counts: tuple[int, ...] = TOKENS) -> list[Point]:
    """Smallest token count first, every combination within it: a run cut short keeps whole token counts."""
    points = []
    for tokens in sorted(token_counts):
        group = [(model, ckpt, kept, layers) for model in models for ckpt in (False, True)
                 for kept in KEPT_FRACTIONS for layers in LAYERS]
        step = max(1, tokens // 4 // (len(group) + 1))
        points += [Point(m, tokens, layers, ckpt, kept, (i + 1) * step)
                   for i, (m, ckpt, kept, layers) in enumerate(group)]
    return points


# ----------------------------------------------------------------------------- measuring
class CudaProbe:
    """The caching allocator's counters: bytes of live tensors, and the most since the last reset."""

    def __init__(self, torch) -> None:
        self.cuda = torch.cuda

    def sync(self) -> None:
        self.cuda.synchronize()

    def reset_peak(self) -> None:
        self.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return self.cuda.memory_allocated()

    def peak(self) -> int:
        return self.cuda.max_memory_allocated()


class Measurer:
    """Runs the points of one machine; ``probe`` reads the allocator (CudaProbe, or a stand-in in tests)."""

    def __init__(self, shapes: list[ModelShape], attention, probe, device: str, dtype, block_size: int,
                 seed: int = 0) -> None:
        import torch

        from sparsebalance.model import Block

        self.torch, self.probe, self.attention = torch, probe, attention
        self.device, self.dtype, self.block_size, self.seed = device, dtype, block_size, seed
        self.shapes = {s.name: s for s in shapes}
        self.blocks = {}
        for shape in shapes:
            torch.manual_seed(seed)
            with torch.device(device):  # initialised where they run: no host copy of an 8B model's layers
                blocks = [Block(shape).to(dtype=dtype) for _ in range(max(LAYERS))]
            for p in (p for b in blocks for p in b.parameters()):
                p.grad = torch.zeros_like(p)  # as the runner: gradients exist before the first backward
            self.blocks[shape.name] = blocks

    def measure(self, point: Point) -> dict:
        torch, probe, shape = self.torch, self.probe, self.shapes[point.model]
        from sparsebalance.model import packed_positions, rope_angles

        torch.manual_seed(self.seed)
        x = torch.randn(point.tokens, shape.hidden, device=self.device, dtype=self.dtype, requires_grad=True)
        ends = torch.tensor(point.lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu = torch.cat([ends.new_zeros(1), ends])  # on the host, as the runner passes it
        n = len(point.lengths)
        budgets = (torch.ones(n), None if point.kept_fraction >= 1 else torch.full((n,), point.kept_fraction))
        self._release_dense_selection()
        gc.collect()
        probe.sync()
        probe.reset_peak()
        base = probe.allocated()
        # positions and RoPE tables are made per micro-batch by the model's forward: inside the measurement
        rotary = rope_angles(packed_positions(cu.to(self.device), point.tokens), shape.head_dim, shape.rope_theta)
        y = self._forward(self.blocks[point.model][:point.layers], x, rotary, cu, budgets, point.checkpointing)
        probe.sync()
        after, forward_peak = probe.allocated(), probe.peak()
        grad = torch.randn_like(y)  # the gradient a stage receives: allocated just before its backward
        y.backward(grad)
        probe.sync()
        peak = probe.peak()
        # the stage's input counts (its first layer keeps it), its output does not (the next stage's input)
        edge = x.numel() * x.element_size() - y.numel() * y.element_size()
        del x, y, grad, rotary
        return {
            "model": point.model, **{k: getattr(shape, k) for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn")},
            "block_size": self.block_size, "layers": point.layers, "checkpointing": int(point.checkpointing),
            "kept_fraction": point.kept_fraction, "lengths": ";".join(map(str, point.lengths)),
            "tokens": point.tokens, "base_bytes": base, "held_bytes": after - base + edge,
            "peak_bytes": peak - base + edge, "forward_peak_bytes": forward_peak - base + edge,
        }

    def _release_dense_selection(self) -> None:
        """The kernel keeps its last dense selection for the next call (the other layers of a micro-batch) and
        drops it when it builds another: a one-block one built here drops the previous point's before this
        point is measured, instead of inside it."""
        from sparsebalance.kernels.sparse_attention import select_blocks

        qk = self.torch.zeros(16, 1, 16, device=self.device, dtype=self.dtype)  # 16 tokens, one head of 16
        select_blocks(qk, qk, self.torch.tensor([0, 16], dtype=self.torch.int32), block_size=16)

    def _forward(self, blocks, x, rotary, cu, budgets, checkpointing: bool):
        from torch.utils.checkpoint import checkpoint

        for block in blocks:
            if checkpointing:
                x = checkpoint(block, x, rotary, cu, budgets, self.attention, use_reentrant=False)[0]
            else:
                x = block(x, rotary, cu, budgets, self.attention)[0]
        return x


def measure_all(points: list[Point], measurer: Measurer, csv_path: Path, time_budget_s: float) -> int:
    """Measure and append every point until the time budget is spent; the points measured."""
    start = time.monotonic()
    for done, point in enumerate(points):
        if time.monotonic() - start > time_budget_s:
            print(f"time budget of {time_budget_s:.0f} s spent: {len(points) - done} points left out", file=sys.stderr)
            return done
        row = measurer.measure(point)
        append_rows(csv_path, [row], COLUMNS)
        print(f"{point.model} tokens={point.tokens} layers={point.layers} checkpointing={int(point.checkpointing)} "
              f"kept={point.kept_fraction}: held {row['held_bytes'] / 1e9:.3f} GB, "
              f"peak {row['peak_bytes'] / 1e9:.3f} GB",
              file=sys.stderr, flush=True)
    return len(points)


def warm_up(points: list[Point], measurer: Measurer) -> None:
    """The smallest token count's points once, unrecorded: the first matmuls allocate cuBLAS workspaces
    that stay allocated, and would otherwise count in whichever point came first."""
    smallest = min(p.tokens for p in points)
    for point in points:
        if point.tokens == smallest:
            measurer.measure(point)


def run_measurement(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        fail("python -m calibrate.memory --out needs CUDA (torch.cuda.is_available() is False here); measure on a "
             "GPU machine, fit the CSV anywhere with --fit")
    from sparsebalance.calibrate.run import machine_facts
    from sparsebalance.runner.attention import make_attention

    shapes = load_shapes(args.models)
    points = build_points([s.name for s in shapes])
    csv_path = args.out / RAW_CSV
    if csv_path.exists():  # one run per directory: a fit reads one run's points only
        fail(f"--out {args.out} already holds {RAW_CSV}; allowed: a directory without one")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": shlex.join(["python", "-m", "calibrate.memory", *argv]), "code_version": args.code_version,
            **machine_facts("cuda"), "block_size": args.block_size, "time_budget_s": args.time_budget_s,
            "grid": {"tokens": list(TOKENS), "layers": list(LAYERS), "kept_fractions": list(KEPT_FRACTIONS),
                     "models": {s.name: vars(s) for s in shapes}, "points": len(points)}}
    meta_path = csv_path.with_name(csv_path.stem + ".meta.json")
    write_json_atomic(meta_path, meta | {"points_measured": None})
    started = time.monotonic()
    measurer = Measurer(shapes, make_attention("kernel", args.block_size), CudaProbe(torch), "cuda",
                        torch.bfloat16, args.block_size)
    warm_up(points, measurer)
    measured = measure_all(points, measurer, csv_path, args.time_budget_s - (time.monotonic() - started))
    write_json_atomic(meta_path, meta | {"points_measured": measured, "seconds": round(time.monotonic() - started, 1)})
    print(f"{measured} of {len(points)} points in {time.monotonic() - started:.0f} s: {csv_path}")
    return 0


# ----------------------------------------------------------------------------- fitting
def read_rows(path: Path):
    import pandas as pd

    try:
        rows = pd.read_csv(path)
    except (OSError, ValueError) as exc:
        fail(f"--fit {path}: not a readable CSV ({type(exc).__name__})")
    missing = [c for c in COLUMNS if c not in rows.columns]
    if missing or rows.empty:
        fail(f"--fit {path}: needs the columns of calibrate.memory's CSV and at least one row; missing: {missing}")
    problem = rows_problem(rows)
    if problem:
        fail(f"--fit {path}: {problem}")
    return rows


def rows_problem(rows) -> str | None:
    """The first field calibrate.memory's measurer would not write, as ``row N (model M) has F=V; allowed: ...``."""
    import numpy as np
    import pandas as pd

    def number(column):
        return pd.to_numeric(rows[column], errors="coerce")

    def whole(column, minimum):
        values = number(column)
        return (values >= minimum) & (values == np.floor(values))

    def lengths_ok(text, tokens) -> bool:
        try:
            lengths = [int(v) for v in str(text).split(";")]
        except ValueError:
            return False
        return min(lengths) >= 1 and sum(lengths) == tokens

    checks = [(c, whole(c, 1), "a whole number >= 1")
              for c in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "block_size", "layers", "tokens")]
    checks += [("checkpointing", number("checkpointing").isin([0, 1]), "0 or 1"),
               ("kept_fraction", (number("kept_fraction") > 0) & (number("kept_fraction") <= 1), "a number in (0, 1]"),
               ("lengths", pd.Series(map(lengths_ok, rows["lengths"], number("tokens"))),
                "';'-joined whole numbers >= 1 adding up to tokens")]
    checks += [(c, np.isfinite(number(c)) & (number(c) >= 0), "a finite number of bytes >= 0")
               for c in ("base_bytes", "held_bytes", "peak_bytes", "forward_peak_bytes")]
    for column, ok, allowed in checks:
        bad = np.flatnonzero(~ok.to_numpy(dtype=bool))
        if bad.size:
            i = bad[0]
            return (f"row {i + 1} (model {rows['model'].tolist()[i]}) has {column}={rows[column].tolist()[i]!r}; "
                    f"allowed: {allowed}")
    return None


def model_config(row):
    """The row's layer shape as sim's ModelConfig (one layer: per-layer terms only; no vocabulary)."""
    from sparsebalance.sim.config import ModelConfig

    return ModelConfig(name=str(row["model"]), hidden=int(row["hidden"]), layers=int(row["layers"]),
                       heads=int(row["heads"]), kv_heads=int(row["kv_heads"]), head_dim=int(row["head_dim"]),
                       ffn=int(row["ffn"]), vocab=1, max_context=int(row["tokens"]))


def activation_bytes(row, terms) -> tuple[float, float]:
    """(held, peak) sim.memory predicts for the row's micro-batch on a stage of its layers, with ``terms``
    (None: the first-principles default config)."""
    import numpy as np

    from sparsebalance.sim.cluster import Layout
    from sparsebalance.sim.config import MemoryConfig
    from sparsebalance.sim.memory import MemoryModel

    cfg = MemoryConfig(activation_checkpointing=bool(row["checkpointing"]), logits_bytes=0.0)
    memory = MemoryModel(cfg, model_config(row), Layout(dp=1), 1e6, int(row["block_size"]), terms)
    lengths = np.array([int(v) for v in str(row["lengths"]).split(";")], dtype=np.float64)
    kept = float(row["kept_fraction"])
    # the points are measured at fixed kept fractions: a sparse one selects top-k
    held, transient = memory.micro_batch_bytes(lengths, np.full(lengths.size, kept),
                                               np.zeros(lengths.size, dtype=np.int64), 1,
                                               topk=np.full(lengths.size, kept < 1))
    return float(held[0, 0]), float(held[0, 0] + transient[0, 0])


def fit_terms(rows):
    """TokenTerms of one (shape, mode) from its rows, by non-negative least squares on the activation bytes
    left after the block selection (sim.memory's count of it: the model with all-zero terms)."""
    import numpy as np
    from scipy.optimize import nnls

    from sparsebalance.sim.memory import TokenTerms

    zero = TokenTerms(0.0, 0.0, 0.0, 0.0)
    selection = np.array([activation_bytes(r, zero) for _, r in rows.iterrows()])
    tokens, layers = rows["tokens"].to_numpy(float), rows["layers"].to_numpy(float)
    held = rows["held_bytes"].to_numpy(float) - selection[:, 0]
    peak = rows["peak_bytes"].to_numpy(float) - selection[:, 1]
    transient = peak - held
    (held_layer, held_mb), _ = nnls(np.column_stack([layers * tokens, tokens]), held)
    (per_token, const), _ = nnls(np.column_stack([tokens, np.ones_like(tokens)]), transient)
    return TokenTerms(float(held_layer), float(held_mb), float(per_token), float(const))


def fit_profile(rows, meta: dict):
    """(profile, table): the fitted profile, and every point's measured and predicted (first principles,
    fitted) activation peak."""
    import pandas as pd

    from sparsebalance.sim.memory import MODES, PROFILE_SCHEMA_VERSION, SHAPE_KEYS, TERMS

    shapes, table = {}, []
    for model, by_model in rows.groupby("model", sort=True):
        modes = {}
        for ckpt, mode in enumerate(MODES):
            points = by_model[by_model["checkpointing"] == ckpt]
            train = points[points["tokens"] != HELDOUT_TOKENS]
            if train["layers"].nunique() < 2 or train["tokens"].nunique() < 2:
                fail(f"--fit: model {model} ({mode}) needs points at 2+ layer counts and 2+ token counts besides "
                     f"the held-out {HELDOUT_TOKENS}; it has layers {_ints(train['layers'])}, tokens "
                     f"{_ints(train['tokens'])}")
            terms = fit_terms(train)
            modes[mode] = {k: getattr(terms, k) for k in TERMS}
            table += [point_row(row, mode, terms) for _, row in points.iterrows()]
        shapes[model] = {"shape": {k: int(by_model[k].iloc[0]) for k in SHAPE_KEYS}, "modes": modes}
    table = pd.DataFrame(table)
    profile = {
        "schema_version": PROFILE_SCHEMA_VERSION, "gpu": meta.get("gpu_name", "unknown"), "meta": meta,
        "block_size": int(rows["block_size"].iloc[0]), "shapes": shapes,
        "fit": {"points": len(table), "heldout_tokens": HELDOUT_TOKENS,
                "heldout_peak_abs_err_pct": abs_errors(table[table["split"] == "heldout"]["fitted_err_%"]),
                "first_principles_peak_abs_err_pct": abs_errors(table["first_principles_err_%"])},
    }
    return profile, table


def point_row(row, mode: str, terms) -> dict:
    measured = float(row["peak_bytes"])
    first, fitted = activation_bytes(row, None)[1], activation_bytes(row, terms)[1]
    return {"model": row["model"], "mode": mode, "layers": int(row["layers"]), "tokens": int(row["tokens"]),
            "kept": float(row["kept_fraction"]), "split": "heldout" if row["tokens"] == HELDOUT_TOKENS else "fit",
            "measured_gb": measured / 1e9, "first_principles_gb": first / 1e9,
            "first_principles_err_%": 100 * (first / measured - 1), "fitted_gb": fitted / 1e9,
            "fitted_err_%": 100 * (fitted / measured - 1)}


def abs_errors(errors) -> dict | None:
    """Median and largest |error| in %, or None without points."""
    if not len(errors):
        return None
    return {"median": float(errors.abs().median()), "max": float(errors.abs().max())}


def _ints(values) -> list[int]:
    return sorted(int(v) for v in values.unique())


def run_fit(args: argparse.Namespace, argv: list[str]) -> int:
    from sparsebalance.sim.memory import profile_problem

    rows = read_rows(args.fit)
    if rows["block_size"].nunique() != 1:
        fail(f"--fit {args.fit}: the rows mix block sizes {_ints(rows['block_size'])}; allowed: one")
    meta_path = args.fit.with_name(args.fit.stem + ".meta.json")
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta["fit_command"] = shlex.join(["python", "-m", "calibrate.memory", *argv])
    profile, table = fit_profile(rows, meta)
    problem = profile_problem(profile)
    if problem:
        fail(f"--fit {args.fit}: the fitted profile is unusable: {problem}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"held-out peak |error| %: {profile['fit']['heldout_peak_abs_err_pct']}; first principles, every point: "
          f"{profile['fit']['first_principles_peak_abs_err_pct']}")
    write_json_atomic(args.profile, profile)
    print(f"profile: {args.profile}")
    return 0


# ----------------------------------------------------------------------------- command line
class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, like every entry point of the project
        fail(f"python -m calibrate.memory: {message}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = Parser(prog="python -m calibrate.memory", description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", type=Path, help="measure (CUDA): write memory_raw.csv and its .meta.json here")
    what.add_argument("--fit", type=Path, help="fit a measured memory_raw.csv into --profile")
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, help="the profile --fit writes")
    ap.add_argument("--models", nargs="+", default=["qwen2.5-3b", "llama3-8b"], help="conf/model/ names")
    ap.add_argument("--block-size", type=int, default=128, help="kernel block size (the simulator's)")
    ap.add_argument("--time-budget-s", type=float, default=TIME_BUDGET_S, help="start no point after this long")
    ap.add_argument("--code-version", default=None, help="commit of the code measured (GPU copies lack .git)")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models if m not in model_names()]
    if unknown:
        fail(f"--models {' '.join(unknown)}: no such model config; allowed: {', '.join(model_names())}")
    if args.block_size not in (64, 128):
        fail(f"--block-size {args.block_size}: allowed: 64 or 128 (the kernel's tuned sizes)")
    if not math.isfinite(args.time_budget_s) or args.time_budget_s <= 0:
        fail(f"--time-budget-s {args.time_budget_s}: allowed: a number of seconds > 0")
    if args.fit is not None and not args.fit.is_file():
        fail(f"--fit {args.fit}: no such file")
    # output paths are checked before anything is measured or fitted
    if args.out is not None:
        check_writable(args.out, "--out", directory=True)
    else:
        check_writable(args.profile, "--profile")
    return args


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return run_fit(args, argv) if args.fit is not None else run_measurement(args, argv)


if __name__ == "__main__":
    sys.exit(main())
