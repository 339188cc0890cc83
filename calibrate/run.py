"""Measure the cost-model terms on this machine's GPU: ``python -m calibrate.run``.

A small argparse CLI rather than Hydra (which sim.run uses): the GPU boxes this runs on carry torch and
Triton but no Hydra/OmegaConf, and the calibration has a handful of flags, no config composition.

Each finished point is appended to the CSV at once; a rerun with the same CSV skips what is there, so a
run cut short by a time limit resumes where it stopped. Run facts (GPU, driver, versions, grid, command)
go to ``<csv>.meta.json`` beside it, one entry per run.

Every attention backend of ``--backends`` that runs here is timed over the same documents (``kernels.backends``:
our kernel over the whole grid, each dense peer over the grid's documents, all kept, each sparse peer over our
attention points, at their kept fractions, on our selection); one that cannot run is one line (``fa4: absent
(...)``) and is left out, unless named on the command line. ``--peers-only`` leaves our kernel's and the layer's
points out: a peer timed on another clock goes into a CSV of its own (a CSV holds one clock).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import warnings
from pathlib import Path

from sparsebalance.calibrate import grid, store, timing
from sparsebalance.kernels.backends import BACKENDS, is_sparse_backend, load_all
from sparsebalance.calibrate.grid import GridPoint, build_grid
from sparsebalance.sim.backends import OURS
from sparsebalance.sim.gpu_kinds import default_kind
from sparsebalance.sim.core import ArgumentParser, ConfigError, number_list, one_line_errors
from sparsebalance.sim.progress import with_progress
from sparsebalance.sim.shapes import ModelShape, load_shapes, model_names

DEFAULT_CSV = Path(__file__).resolve().parent / "profiles" / f"{default_kind().gpu}_raw.csv"  # the default cluster's
# The layer shapes the simulator's profile prices (conf/model/ also holds the runner's small learning model).
CALIBRATED_MODELS = ("llama3-8b", "qwen2.5-3b")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m calibrate.run", description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="raw measurements, appended per point")
    ap.add_argument("--models", nargs="*", default=list(CALIBRATED_MODELS),
                    help=f"conf/model/ names (default: {' '.join(CALIBRATED_MODELS)})")
    ap.add_argument("--block-size", type=int, default=128,
                    help="kernel block size in tokens (the simulator's, conf/cost)")
    ap.add_argument("--max-tokens", type=int, default=None, help="only points with at most this many tokens")
    ap.add_argument("--min-tokens", type=int, default=None,
                    help="only points with at least this many tokens (the long end timed again, into another --csv)")
    ap.add_argument("--time-budget-s", type=float, default=None, help="start no new point after this long")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: Triton interpreter, fp32")
    ap.add_argument("--timing", default="busy", choices=("busy", "events"),
                    help="busy: the GPU's summed kernel time per call (training runs ahead of the GPU); events: "
                         "do_bench's device events around each call (host launch gaps included)")
    ap.add_argument("--dry-run", action="store_true", help="print the grid and its estimated cost, time nothing")
    ap.add_argument("--backends", type=number_list(str, lambda b: b in BACKENDS, ", ".join(BACKENDS)), default=None,
                    help=f"attention backends to time (default: every one that runs here, of {', '.join(BACKENDS)}); "
                         f"{OURS} always runs, unless --peers-only")
    ap.add_argument("--peers-only", action="store_true",
                    help=f"time only the peers' points, none of {OURS}' or the layer's: a peer timed on another "
                         "clock than the profile's own terms, into a CSV of its own (calibrate.fit --backends-only "
                         "adds it to the profile)")
    ap.add_argument("--code-version", default=None,
                    help="commit of the kernel and layer code being timed (GPU boxes get a copy without .git)")
    args = ap.parse_args(argv)
    known = model_names()
    if not args.models:
        ap.error(f"--models: no model named; allowed: one or more of {', '.join(known)}")
    unknown = [m for m in args.models if m not in known]
    if unknown:
        ap.error(f"--models {' '.join(unknown)}: no such model config; allowed: {', '.join(known)}")
    if args.block_size not in (64, 128):
        ap.error(f"--block-size {args.block_size}: the kernel is tuned for 64 or 128")
    for name in ("max_tokens", "min_tokens", "time_budget_s"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            ap.error(f"--{name.replace('_', '-')} {value}: must be a finite number > 0")
    if None not in (args.min_tokens, args.max_tokens) and args.min_tokens > args.max_tokens:
        ap.error(f"--min-tokens {args.min_tokens}: above --max-tokens {args.max_tokens}; allowed: at most it")
    return args


def select_points(points: list[GridPoint], max_tokens: int | None, min_tokens: int | None = None) -> list[GridPoint]:
    return [p for p in points if (max_tokens is None or p.tokens <= max_tokens)
            and (min_tokens is None or p.tokens >= min_tokens)]


def pending(points: list[GridPoint], csv: Path) -> list[GridPoint]:
    """The points not yet fully on disk, in grid order."""
    done = store.done_keys(csv, {p.key: p.terms for p in points})
    return [p for p in points if p.key not in done]


def measure_all(points: list[GridPoint], measurer, csv: Path, time_budget_s: float | None) -> int:
    """Time and append each point; returns how many were measured. Stops starting points past the budget."""
    start = time.monotonic()
    measured = 0
    for point in with_progress(points, "calibrate", unit="point"):
        if time_budget_s is not None and time.monotonic() - start > time_budget_s:
            break
        store.append_rows(csv, measurer.measure(point))
        measured += 1
    if measured < len(points):
        print(f"time budget of {time_budget_s:.0f}s spent; {len(points) - measured} points left for a rerun",
              file=sys.stderr)
    return measured


def estimated_seconds(points: list[GridPoint], shapes: dict[str, ModelShape]) -> float:
    """GPU seconds do_bench will take: 6 untimed calls, the heat-up, the warm-up and the repetition windows
    per term."""
    total_ms = 0.0
    for p in points:
        for term in p.terms:
            t = grid.estimate_term_ms(term, p, shapes[p.model])
            total_ms += (6 * t + max(timing.HEAT_MS, t) + max(timing.WARMUP_MS, t)
                         + max(timing.REP_MS, timing.MIN_REPS * t))
    return total_ms / 1e3


def measurement_settings(run: dict) -> dict:
    """What changes the time a run (a meta entry) records for a point, flattened (``models.<name>.<field>``):
    the block size, the grid's timing settings, each model's shape, the clock and the device. The models, the
    backends and ``max_tokens`` / ``min_tokens`` only choose which points are measured."""
    facts = run.get("grid", {})
    chooses = ("models", "max_tokens", "min_tokens", "points", "backends")
    settings = {k: v for k, v in facts.items() if k not in chooses}
    settings |= {f"models.{name}.{k}": v for name, shape in facts.get("models", {}).items() for k, v in shape.items()}
    return settings | {k: run[k] for k in ("timing", "device") if k in run}


def check_same_settings(csv: Path, settings: dict) -> None:
    """Refuse to resume a CSV whose earlier runs measured with other settings: its points would count as done
    though they time something else. Settings a run did not record (an older calibrate.run) are not compared."""
    for past in read_runs(csv):
        theirs = measurement_settings(past)
        for key in sorted(settings.keys() & theirs.keys()):
            if settings[key] != theirs[key]:
                raise ConfigError(f"--csv {csv}: measured with {key}={theirs[key]!r} (its {meta_path(csv).name}), "
                                  f"this run has {key}={settings[key]!r}; allowed: the same settings, or another "
                                  "--csv for these")


def grid_description(shapes: list[ModelShape], block_size: int, max_tokens: int | None, n_points: int,
                     backends: tuple[str, ...] = (), min_tokens: int | None = None) -> dict:
    return {
        "models": {s.name: vars(s) for s in shapes},
        "backends": [OURS, *backends],
        "block_size": block_size,
        "single_lengths": list(grid.SINGLE_LENGTHS),
        "kept_fractions": list(grid.KEPT_FRACTIONS),
        "packs": [list(p) for p in grid.PACKS],
        "mixed_budgets": list(grid.MIXED_BUDGETS),
        "validation": [{"lengths": list(lens), "kept_fractions": list(f)} for lens, f in grid.VALIDATION],
        "max_kept_work": grid.MAX_KEPT_WORK,
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "points": n_points,
        "do_bench": {"warmup_ms": timing.WARMUP_MS, "rep_ms": timing.REP_MS, "min_reps": timing.MIN_REPS,
                     "heat_ms": timing.HEAT_MS},
    }


def machine_facts(device: str) -> dict:
    import torch
    import triton

    facts = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": device,
    }
    if device == "cuda":
        facts |= {
            "gpu_name": torch.cuda.get_device_name(),
            "gpu_count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
            "driver": _driver_version(),
        }
    return facts


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        return f"unknown ({type(e).__name__})"


def write_meta(csv: Path, entry: dict, replace_last: bool = False) -> Path:
    """Append this run's facts to the meta file (a resumed calibration lists each of its runs).

    Written when the run starts and rewritten (``replace_last``) when it ends, so a killed run still
    leaves its machine facts and command behind.
    """
    path = meta_path(csv)
    runs = read_runs(csv)
    runs = runs[:-1] if replace_last else runs
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"runs": runs + [entry]}, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def meta_path(csv: Path) -> Path:
    return csv.with_name(csv.stem + ".meta.json")


def read_runs(csv: Path) -> list[dict]:
    """The runs the CSV's metadata lists (none without the file); a file of another shape is a ConfigError."""
    path = meta_path(csv)
    if not path.exists():
        return []
    try:
        runs = json.loads(path.read_text())["runs"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        runs = None
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise ConfigError(f"--csv {csv}: {path.name} is not calibrate.run's metadata; allowed: a JSON object with a "
                          "list of runs (written by calibrate.run)")
    return runs


def comm_figures(device: str) -> dict | str:
    """NCCL bandwidths where there are GPUs to exchange between; one GPU keeps the cluster config's figures."""
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if gpus < 2:
        return f"not measured: {gpus} GPU(s); the simulator keeps the cluster config's figures"
    from sparsebalance.calibrate.comm import measure_comm

    return measure_comm(gpus)


def make_measurer(shapes: list[ModelShape], device: str, block_size: int, clock: str = "busy", backends=None):
    if device == "cpu":
        # The interpreter must be chosen before Triton is imported; it has no bf16 arithmetic, hence fp32.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from sparsebalance.calibrate.measure import Measurer
    from sparsebalance.kernels import sparse_attention as kernel
    from sparsebalance.runner.attention import make_attention

    # where the fused selection cannot be built for this GPU, the torch selection is what gets timed (as
    # training would run it there): the log must say so, whatever the interpreter's warning filters
    warnings.simplefilter("default", kernel.SelectionFallbackWarning)

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gpu_bench = timing.bench_gpu_busy if clock == "busy" else timing.bench_gpu
    bench = gpu_bench if device == "cuda" else timing.bench_cpu
    attention = make_attention("kernel", block_size)
    return Measurer(shapes, kernel, attention, bench, device=device, dtype=dtype, block_size=block_size,
                    backends=backends)


def peer_backends(named: list[str] | None, dry_run: bool, block_size: int) -> tuple[dict, list[str]]:
    """The peers to time (name -> loaded backend; in a dry run name -> None, nothing loaded) and the lines of
    those left out. A default one that cannot run here is left out with its line; one named with --backends is
    a ConfigError with it. A sparse peer selects at ``block_size``, as ours does."""
    peers = [b for b in (BACKENDS if named is None else named) if b != OURS]
    if dry_run:
        return dict.fromkeys(peers), []
    loaded, absent = load_all(peers, block_size)
    if named is not None and absent:
        raise ConfigError(f"--backends {','.join(named)}: {absent[0]}; allowed: backends that run here")
    return loaded, absent


def split_peers(peers) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(dense, sparse) peers among the names ``peers``, as the registry's classes say."""
    return (tuple(n for n in peers if not is_sparse_backend(n)), tuple(n for n in peers if is_sparse_backend(n)))


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = load_shapes(args.models)
    by_name = {s.name: s for s in shapes}
    peers, absent = peer_backends(args.backends, args.dry_run, args.block_size)
    for line in absent:
        print(line, file=sys.stderr)
    points = select_points(build_grid(shapes, *split_peers(peers)), args.max_tokens, args.min_tokens)
    if args.peers_only:
        if not peers:
            raise ConfigError("--peers-only: no peer backend runs here to time; allowed: --backends naming one that "
                              "does (the peers extra, on a GPU machine)")
        points = [p for p in points if p.backend != OURS]
    grid_facts = grid_description(shapes, args.block_size, args.max_tokens, len(points), tuple(peers),
                                  args.min_tokens)
    check_same_settings(args.csv, measurement_settings({"grid": grid_facts, "timing": args.timing,
                                                         "device": args.device}))
    todo = pending(points, args.csv)
    estimate_s = estimated_seconds(todo, by_name)
    print(f"{len(points)} points, {len(todo)} to measure, roughly {estimate_s:.0f}s of GPU time", file=sys.stderr)
    if args.dry_run or not todo:
        return 0
    if args.device == "cuda":
        import torch

        # checked before anything is written, so that a run on the wrong machine leaves no meta behind
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda: this machine has no CUDA GPU; time on a GPU box, or pass "
                             "--device cpu (Triton interpreter, fp32: for tests, not a profile)")
    command = shlex.join(["python", "-m", "calibrate.run", *(sys.argv[1:] if argv is None else argv)])
    entry = {"command": command, "code_version": args.code_version, "timing": args.timing,
             **machine_facts(args.device),
             "backends": {name: backend.version() for name, backend in peers.items()}, "absent_backends": absent,
             "grid": grid_facts}
    write_meta(args.csv, entry | {"points_measured": None, "points_left": len(todo)})
    started = time.monotonic()
    measurer = make_measurer(shapes, args.device, args.block_size, args.timing, peers)
    measured = measure_all(todo, measurer, args.csv, args.time_budget_s)
    write_meta(args.csv, entry | {"points_measured": measured, "points_left": len(todo) - measured,
                                  "seconds": round(time.monotonic() - started, 1), "comm": comm_figures(args.device)},
               replace_last=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
