"""Fit the cost model to raw measurements and report its error: ``python -m calibrate.fit``.

Features come from ``sim.cost`` itself: a CostModel whose ``term_ms`` records the feature arrays it is
handed, so the fit sees exactly the features (selection semantics, layer FLOPs) that the simulator will
multiply the coefficients by. Each term is then a nonnegative, outlier-robust fit of
``time = sum(coef[f] * feature[f])`` on relative error (rows divided by the measured time), so a 20 ms
point does not drown the 0.05 ms ones.

A small argparse CLI, like calibrate.run, so that both halves read the same way.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
from collections import defaultdict
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares, nnls

from calibrate import store
from calibrate.run import DEFAULT_CSV, meta_path
from sim.cluster import Layout
from sim.config import ModelConfig
from sim.cost import PROFILE_SCHEMA_VERSION, TERMS, CostModel, load_profile, write_json_atomic

DEFAULT_OUT = DEFAULT_CSV.with_name("h200.json")


@dataclass(frozen=True)
class Measurement:
    key: str
    term: str
    split: str
    model: str
    lengths: tuple[int, ...]
    kept_fractions: tuple[float, ...]
    median_ms: float
    spread: float  # (p80 - p20) / median

    @classmethod
    def from_row(cls, row: dict) -> Measurement:
        median = float(row["median_ms"])
        return cls(
            key=row["key"],
            term=row["term"],
            split=row["split"],
            model=row["model"],
            lengths=tuple(int(x) for x in row["lengths"].split(";")),
            kept_fractions=tuple(float(x) for x in row["kept_fractions"].split(";")),
            median_ms=median,
            spread=(float(row["p80_ms"]) - float(row["p20_ms"])) / median,
        )


def load_measurements(csv: Path) -> list[Measurement]:
    """Rows of the raw CSV; a point measured twice (a resumed run) counts once, its last measurement."""
    latest = {(r["key"], r["term"]): r for r in store.read_rows(csv)}
    return [Measurement.from_row(r) for r in latest.values()]


class _FeatureTap(CostModel):
    """A CostModel that records the features each term is priced on instead of pricing them."""

    def __init__(self, model: ModelConfig, block_size: int) -> None:
        # One GPU, cp = 1: the ring exchange (the only user of the cluster) is never priced.
        super().__init__(model, cluster=None, block_size=block_size)
        self.seen: dict[str, dict[str, float]] = {}

    def term_ms(self, term: str, feats: dict[str, np.ndarray]) -> np.ndarray:
        self.seen[term] = {f: float(np.asarray(v)[0]) for f, v in feats.items()}
        return np.zeros_like(feats["const"])

    def features(self, lengths, kept_fractions) -> dict[str, dict[str, float]]:
        """Per-layer features of every term for one micro-batch."""
        self.micro_batch_cost(lengths, kept_fractions, Layout(dp=1))
        return dict(self.seen)


class FeatureSource:
    """Features of a measurement, by model name (shapes as recorded in the run's metadata)."""

    def __init__(self, models: dict[str, dict], block_size: int) -> None:
        # a recorded shape may carry more than the simulator prices (the runner's rope_theta)
        keys = [f.name for f in fields(ModelConfig)]
        self.taps = {name: _FeatureTap(ModelConfig(**{k: shape[k] for k in keys}), block_size)
                     for name, shape in models.items()}

    def __call__(self, m: Measurement) -> dict[str, dict[str, float]]:
        return self.taps[m.model].features(m.lengths, m.kept_fractions)


ROBUST_SCALE = 0.05  # relative residuals beyond ~5% count linearly, not squared


def fit_term(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Nonnegative coefficients minimising a robust loss of the relative error of X @ c against y.

    NNLS on the squared relative error gives the start; a soft-L1 refinement then keeps a few outlying
    timings (a host hiccup in a 30 us call, the first call after a shape change) from pulling the rest.
    """
    A = X / y[:, None]
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0  # an all-zero feature keeps coefficient 0
    A = A / scale
    start, _ = nnls(A, np.ones_like(y), maxiter=50 * A.shape[1])
    robust = least_squares(lambda c: A @ c - 1.0, start, bounds=(0.0, np.inf), loss="soft_l1",
                           f_scale=ROBUST_SCALE, x_scale="jac").x
    # The bounded solver stays strictly inside the bounds; a feature worth under a millionth of every
    # point's time (columns are scaled to a largest share of 1) is really at its bound of zero.
    robust[robust < 1e-6] = 0.0
    return robust / scale


def predict(coefs: dict[str, float], feats: dict[str, float]) -> float:
    return sum(c * feats[f] for f, c in coefs.items())


def fit_all(measurements: list[Measurement], features: FeatureSource) -> dict[str, dict[str, float]]:
    """Coefficients of every term from the ``fit`` split."""
    terms: dict[str, dict[str, float]] = {}
    for term in TERMS:
        rows = [(m, features(m)[term]) for m in measurements if m.term == term and m.split == "fit"]
        # A point whose features are all zero (selection of an all-dense batch, which the simulator prices
        # at zero) says nothing about the coefficients; it is reported, not fitted.
        rows = [(m, f) for m, f in rows if any(f.values())]
        if not rows:
            raise ValueError(f"no 'fit' measurements of term {term!r}; cannot fit it")
        names = list(rows[0][1])
        X = np.array([[f[n] for n in names] for _, f in rows])
        y = np.array([m.median_ms for m, _ in rows])
        terms[term] = {n: float(c) for n, c in zip(names, fit_term(X, y))}
    return terms


def layer_prediction(coefs: dict, feats: dict[str, dict[str, float]]) -> float:
    """Forward plus backward of one whole layer: the sum of every term (one GPU, no CP overlap)."""
    return sum(predict(coefs[t], feats[t]) for t in TERMS)


def _ape(pred: float, measured: float) -> float:
    return abs(pred - measured) / measured * 100.0


def evaluate(measurements: list[Measurement], coefs: dict, features: FeatureSource, split: str) -> dict:
    """Absolute % errors on one split: per term, attention forward+backward, and whole layers."""
    errors: dict[str, list[float]] = defaultdict(list)
    attn: dict[str, dict[str, float]] = defaultdict(dict)
    for m in measurements:
        if m.split != split:
            continue
        feats = features(m)
        if m.term == "layer_full":
            errors["layer"].append(_ape(layer_prediction(coefs, feats), m.median_ms))
            continue
        errors[m.term].append(_ape(predict(coefs[m.term], feats[m.term]), m.median_ms))
        if m.term in ("attn_fwd", "attn_bwd"):
            attn[m.key][m.term] = (predict(coefs[m.term], feats[m.term]), m.median_ms)
    for pair in attn.values():
        if len(pair) == 2:
            pred, measured = (sum(v[i] for v in pair.values()) for i in (0, 1))
            errors["attn_fwd+bwd"].append(_ape(pred, measured))
    return errors


def summarise(errors: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        name: {"median_ape_pct": round(float(np.median(v)), 3), "max_ape_pct": round(float(np.max(v)), 3), "points": len(v)}
        for name, v in sorted(errors.items())
        if v
    }


def validation_table(measurements: list[Measurement], coefs: dict, features: FeatureSource) -> list[dict]:
    """Predicted vs measured whole-layer time of each validation micro-batch."""
    table = []
    for m in measurements:
        if m.split == "validate" and m.term == "layer_full":
            pred = layer_prediction(coefs, features(m))
            table.append({
                "model": m.model,
                "lengths": list(m.lengths),
                "kept_fractions": [round(f, 4) for f in m.kept_fractions],
                "measured_ms": round(m.median_ms, 4),
                "predicted_ms": round(pred, 4),
                "error_pct": round((pred - m.median_ms) / m.median_ms * 100.0, 2),
            })
    return table


def noise(measurements: list[Measurement]) -> dict[str, float]:
    """Median timing spread (p80 - p20 over median, %) per term: the floor any fit can reach."""
    by_term: dict[str, list[float]] = defaultdict(list)
    for m in measurements:
        by_term[m.term].append(m.spread * 100.0)
    return {t: round(float(np.median(v)), 3) for t, v in sorted(by_term.items())}


def build_profile(gpu: str, runs: list[dict], coefs: dict, report: dict, fit_command: str, csv: Path) -> dict:
    first, last = runs[0], runs[-1]
    return {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "gpu": gpu,
        "provisional": False,
        "meta": {
            "command": " && ".join([r["command"] for r in runs] + [fit_command]),
            "date": first["date"],
            "fitted": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "code_version": last.get("code_version"),
            "gpu_name": last.get("gpu_name"),
            "driver": last.get("driver"),
            "cuda": last.get("cuda"),
            "torch": last["torch"],
            "triton": last["triton"],
            "grid": last["grid"],
            "raw_csv": csv.name,
            "runs": runs,
        },
        "block_size": last["grid"]["block_size"],
        "terms": coefs,
        "comm": comm_section(last.get("comm", "not measured")),
        "fit": report,
    }


def comm_section(comm: dict | str) -> dict:
    """Large-message bandwidths when the run measured them, else nulls (the cluster config's figures stand)."""
    if isinstance(comm, str):
        return {"allreduce_busbw_gbps": None, "p2p_gbps": None, "measured": comm}
    return {"allreduce_busbw_gbps": comm["allreduce_busbw_gbps"], "p2p_gbps": comm["p2p_gbps"], "measured": comm}


def write_profile(path: Path, profile: dict) -> None:
    """Write only a profile the simulator accepts: check a temporary copy with sim.cost's loader first."""
    tmp = path.with_name(path.name + ".check")
    write_json_atomic(tmp, profile)
    try:
        load_profile(str(tmp))
    except Exception:
        tmp.unlink()
        raise
    os.replace(tmp, path)


def print_report(report: dict) -> None:
    for split in ("heldout", "fit"):
        print(f"{split} absolute % error (median / max / points):")
        for name, s in report[f"{split}_mape"].items():
            print(f"  {name:>13}: {s['median_ape_pct']:7.2f} {s['max_ape_pct']:8.2f} {s['points']:5d}")
    print("timing spread (p80-p20)/median %:", report["noise_pct"])
    print("validation (whole layer fwd+bwd, packed mixed budgets):")
    for v in report["validation"]:
        print(f"  {v['model']:>10} {v['lengths']} kf={v['kept_fractions']}: measured {v['measured_ms']:.3f} ms, "
              f"predicted {v['predicted_ms']:.3f} ms, {v['error_pct']:+.1f}%")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m calibrate.fit", description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="raw measurements from calibrate.run")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="profile to write")
    ap.add_argument("--gpu", default="h200", help="the profile's gpu name")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.csv.is_file():
        raise SystemExit(f"error: --csv {args.csv}: no such file (raw measurements are written by calibrate.run)")
    meta = meta_path(args.csv)
    if not meta.exists():
        raise SystemExit(f"{meta}: no run metadata beside {args.csv} (written by calibrate.run)")
    runs = json.loads(meta.read_text())["runs"]
    grid = runs[-1]["grid"]
    measurements = load_measurements(args.csv)
    features = FeatureSource(grid["models"], grid["block_size"])
    coefs = fit_all(measurements, features)
    report = {
        "heldout_mape": summarise(evaluate(measurements, coefs, features, "heldout")),
        "fit_mape": summarise(evaluate(measurements, coefs, features, "fit")),
        "validation": validation_table(measurements, coefs, features),
        "noise_pct": noise(measurements),
        "points": {s: sum(m.split == s for m in measurements) for s in ("fit", "heldout", "validate")},
    }
    fit_command = shlex.join(["python", "-m", "calibrate.fit", *(sys.argv[1:] if argv is None else argv)])
    write_profile(args.out, build_profile(args.gpu, runs, coefs, report, fit_command, args.csv))
    print_report(report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
