"""Fit the cost model to raw measurements and report its error: ``python -m calibrate.fit``.

Features come from ``sim.cost`` itself: a CostModel whose ``term_ms`` records the feature arrays it is
handed, so the fit sees exactly the features (selection semantics, layer FLOPs) that the simulator will
multiply the coefficients by. Each term is then a nonnegative, outlier-robust fit of
``time = sum(coef[f] * feature[f])`` on relative error (rows divided by the measured time), so a 20 ms
point does not drown the 0.05 ms ones. Columns are scaled to unit norm and features that the others rebuild
exactly are merged into them (``merged_columns``), so that the coefficients are unique, not just the
predictions.

A small argparse CLI, like calibrate.run, so that both halves read the same way; ``--check [PROFILE]``
fits nothing and says whether a profile meets the error targets.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import shlex
import sys
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from sparsebalance.calibrate import store
from sparsebalance.calibrate.backends import (HELDOUT_MAX_PCT, HELDOUT_MEDIAN_PCT, backend_checks, fit_backends,
                                              print_backends, recorded_versions, with_backends)
from sparsebalance.calibrate.grid import TERMS as GRID_TERMS
from sparsebalance.calibrate.grid import GridPoint
from sparsebalance.calibrate.linear import COLLINEAR, TermFit, ape, fit_term, predict, summarise
from sparsebalance.calibrate.run import DEFAULT_CSV, meta_path, read_runs
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.config import ModelConfig
from sparsebalance.sim.core import ArgumentParser, ConfigError, check_writable, one_line_errors, write_checked_json
from sparsebalance.sim.backends import BACKEND_NAME, DENSE_TERMS, OURS
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.profile import PROFILE_SCHEMA_VERSION, TERMS, load_profile, profile_problem

DEFAULT_OUT = DEFAULT_CSV.with_name("h200.json")
ROOT = Path(__file__).resolve().parents[1]
RAW_SUFFIX = "_raw.csv"  # calibrate/profiles/<gpu>_raw.csv is fitted into <gpu>.json
SPLITS = ("fit", "heldout", "validate")


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
    backend: str = OURS  # a dense backend's point (key kind attn@<backend>) or ours

    @classmethod
    def from_row(cls, row: dict, models: Collection[str]) -> Measurement:
        """One CSV row of a run over ``models``; a field calibrate.run would not write is a ConfigError naming
        the row, the field, its value and what is allowed."""
        def field(name: str, parse, ok, allowed: str):
            try:
                value = parse(row[name])
                good = ok(value)
            except ValueError:
                good = False
            if not good:
                raise ConfigError(f"row key={row['key']!r} term={row['term']!r}: {name}={row[name]!r}; "
                                  f"allowed: {allowed}")
            return value

        def numbers(kind):
            return lambda text: tuple(kind(x) for x in text.split(";"))

        def point_kind(key: str) -> str:
            kind, _model, _lengths, _budgets = key.split("|")
            GridPoint.budgets_of(key)  # composition and the plots read the requested budgets
            return kind

        kind = field("key", point_kind, lambda k: kind_terms(k) is not None, "a calibrate.grid point key, "
                     f"<kind>|<model>|<lengths>|<'+'-joined budgets> with kind one of {', '.join(GRID_TERMS)} "
                     "(attn@<backend> for a dense backend's point)")
        term = field("term", str, lambda t: t in kind_terms(kind),
                     f"{', '.join(kind_terms(kind))} (the key's kind is {kind})")
        lengths = field("lengths", numbers(int), lambda v: min(v) >= 1, "';'-joined whole numbers of tokens >= 1")
        median = field("median_ms", float, lambda v: math.isfinite(v) and v > 0, "a finite number of ms > 0")
        quantiles = [field(q, float, lambda v: math.isfinite(v) and v >= 0, "a finite number of ms >= 0")
                     for q in ("p20_ms", "p80_ms")]
        field("reps", int, lambda v: v >= 1, "a whole number of repetitions >= 1")
        return cls(
            key=row["key"],
            term=term,
            split=field("split", str, lambda v: v in SPLITS, ", ".join(SPLITS)),
            model=field("model", str, lambda v: v in models, f"a model of the run's grid: {', '.join(models)}"),
            lengths=lengths,
            kept_fractions=field("kept_fractions", numbers(float),
                                 lambda v: len(v) == len(lengths) and all(0 < f <= 1 for f in v),
                                 f"{len(lengths)} ';'-joined numbers in (0, 1], one per length"),
            median_ms=median,
            spread=(quantiles[1] - quantiles[0]) / median,
            backend=kind.partition("@")[2] or OURS,
        )


def kind_terms(kind: str) -> tuple[str, ...] | None:
    """The terms a point key's kind has: a grid kind's, or a dense backend's (``attn@<name>``); None if neither."""
    base, at, backend = kind.partition("@")
    if not at:
        return GRID_TERMS.get(kind)
    return DENSE_TERMS if base == "attn" and backend != OURS and BACKEND_NAME.fullmatch(backend) else None


def load_measurements(csv: Path) -> list[Measurement]:
    """Rows of the raw CSV, checked against the models of its run (the metadata beside it); a point measured
    twice (a resumed run) counts once, its last measurement."""
    runs = read_runs(csv)
    models = runs[-1].get("grid", {}).get("models", {}) if runs else {}
    latest = {(r["key"], r["term"]): r for r in store.read_rows(csv)}
    if not latest:
        raise ConfigError(f"--csv {csv}: no measurements; allowed: a CSV that calibrate.run has measured into")
    try:
        return [Measurement.from_row(r, models) for r in latest.values()]
    except ConfigError as exc:
        raise ConfigError(f"--csv {csv}: {exc}") from None


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
        # A recorded shape may carry more than the simulator prices (the runner's rope_theta), and less:
        # a field added to ModelConfig after the run keeps its default.
        keys = [f.name for f in fields(ModelConfig)]
        self.taps = {name: _FeatureTap(ModelConfig(**{k: shape[k] for k in keys if k in shape}), block_size)
                     for name, shape in models.items()}

    def __call__(self, m: Measurement) -> dict[str, dict[str, float]]:
        return self.taps[m.model].features(m.lengths, m.kept_fractions)


@dataclass(frozen=True)
class Fit:
    terms: dict[str, TermFit]

    @property
    def coefs(self) -> dict[str, dict[str, float]]:
        return {t: f.coefs for t, f in self.terms.items()}

    def conditioning(self) -> dict:
        """What the profile's ``fit.conditioning`` records: how the coefficients were made unique."""
        return {
            "method": ("rows divided by the measured time, columns scaled to unit L2 norm; a column that a "
                       f"non-negative combination of the others rebuilds to {COLLINEAR:g} of its norm is "
                       "merged into them (coefficient 0, weights below), so the solved matrix has full rank"),
            "terms": {t: f.conditioning() for t, f in self.terms.items()},
        }


def fit_all(measurements: list[Measurement], features: FeatureSource) -> Fit:
    """Coefficients of every term from the ``fit`` split."""
    terms: dict[str, TermFit] = {}
    for term in TERMS:
        rows = [(m, features(m)[term]) for m in measurements if m.term == term and m.split == "fit"]
        # A point whose features are all zero (selection of an all-dense batch, which the simulator prices
        # at zero) says nothing about the coefficients; it is reported, not fitted.
        rows = [(m, f) for m, f in rows if any(f.values())]
        if not rows:
            raise ConfigError(f"no 'fit' measurements of term {term!r} (besides all-dense selections, priced at 0); "
                              "allowed: raw measurements with them (calibrate.run measures them)")
        names = list(rows[0][1])
        X = np.array([[f[n] for n in names] for _, f in rows])
        y = np.array([m.median_ms for m, _ in rows])
        terms[term] = fit_term(X, y, names)
    return Fit(terms)


def as_trained(measurements: list[Measurement]) -> tuple[list[Measurement], int]:
    """The measurements with the other work's backward as a training step pays it, and how many points moved.

    A training step runs the layer's forward and backward one after the other, as the grid's ``layer_step``
    times them in one call; a backward timed alone misses part of that call (on an H100, a median 2% of
    the whole layer: ``composition_pct``'s ``other_pct``). So where a point has ``layer_step``, its
    ``layer_bwd`` becomes that call less the forward timed alone, and the fitted forward plus backward is the
    step training runs. Points without it (CSVs measured before ``layer_step``) keep the backward as timed.
    """
    times = {(m.key, m.term): m.median_ms for m in measurements}
    out, moved = [], 0
    for m in measurements:
        if m.term == "layer_bwd" and (m.key, "layer_step") in times and (m.key, "layer_fwd") in times:
            target = times[m.key, "layer_step"] - times[m.key, "layer_fwd"]
            if target <= 0:
                raise ConfigError(f"row key={m.key!r}: layer_step {times[m.key, 'layer_step']} ms is not longer "
                                  f"than layer_fwd {times[m.key, 'layer_fwd']} ms; allowed: a forward and "
                                  "backward in one call that take longer than the forward alone (re-measure it)")
            m, moved = replace(m, median_ms=target), moved + 1
        out.append(m)
    return out, moved


def layer_prediction(coefs: dict, feats: dict[str, dict[str, float]]) -> float:
    """Forward plus backward of one whole layer: the sum of every term (one GPU, no CP overlap)."""
    return sum(predict(coefs[t], feats[t]) for t in TERMS)


def term_prediction(term: str, coefs: dict, feats: dict[str, dict[str, float]]) -> float:
    """The model's time of one measured term; a whole layer and the other work's one-call step are sums."""
    if term == "layer_full":
        return layer_prediction(coefs, feats)
    if term == "layer_step":
        return predict(coefs["layer_fwd"], feats["layer_fwd"]) + predict(coefs["layer_bwd"], feats["layer_bwd"])
    return predict(coefs[term], feats[term])


def evaluate(measurements: list[Measurement], coefs: dict, features: FeatureSource, split: str) -> dict:
    """Absolute % errors on one split: per term, attention forward+backward, and whole layers."""
    errors: dict[str, list[float]] = defaultdict(list)
    attn: dict[str, dict[str, float]] = defaultdict(dict)
    for m in measurements:
        if m.split != split:
            continue
        pred = term_prediction(m.term, coefs, features(m))
        errors["layer" if m.term == "layer_full" else m.term].append(ape(pred, m.median_ms))
        if m.term in ("attn_fwd", "attn_bwd"):
            attn[m.key][m.term] = (pred, m.median_ms)
    for pair in attn.values():
        if len(pair) == 2:
            pred, measured = (sum(v[i] for v in pair.values()) for i in (0, 1))
            errors["attn_fwd+bwd"].append(ape(pred, measured))
    return errors


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


ATTENTION_PARTS = ("select", "attn_fwd", "attn_bwd")
OTHER_PARTS = ("layer_fwd", "layer_bwd")


def composition(measurements: list[Measurement]) -> dict[str, float] | None:
    """Whole layers against the sum of their own terms timed one at a time (% of the whole layer).

    The grid times each held-out whole layer's attention (selection, forward, backward) and its other work
    (forward, backward) on their own too. A fit that predicted every term exactly would still miss each
    whole layer by its gap (negative: the whole layer is slower than its parts), so the gaps show how much
    of the held-out layer error is the sum-of-terms model's and not the coefficients'. Where the other work
    was also timed in one call (``layer_step``), each gap splits into the other work's (apart vs in one call)
    and the attention's (alone vs the whole layer less that call), medians in ``other_pct`` / ``attention_pct``.
    None when no whole layer has all its parts in the CSV.
    """
    times = {(m.key, m.term): m.median_ms for m in measurements}
    gaps, split = [], []
    for m in measurements:
        if m.term != "layer_full":
            continue
        attn_key = GridPoint("attn", m.model, m.lengths, GridPoint.budgets_of(m.key)).key
        other_key = GridPoint("layer", m.model, m.lengths, (1.0,) * len(m.lengths)).key
        parts = [(attn_key, t) for t in ATTENTION_PARTS] + [(other_key, t) for t in OTHER_PARTS]
        if not all(part in times for part in parts):
            continue
        whole = m.median_ms
        gaps.append((sum(times[part] for part in parts) - whole) / whole * 100.0)
        if (other_key, "layer_step") in times:
            step = times[other_key, "layer_step"]
            other = sum(times[other_key, t] for t in OTHER_PARTS) - step
            attention = sum(times[attn_key, t] for t in ATTENTION_PARTS) - (whole - step)
            split.append((other / whole * 100.0, attention / whole * 100.0))
    if not gaps:
        return None
    report = {"median_abs_pct": round(float(np.median(np.abs(gaps))), 3),
              "max_abs_pct": round(float(np.max(np.abs(gaps))), 3),
              "median_pct": round(float(np.median(gaps)), 3), "points": len(gaps)}
    if split:
        other, attention = np.array(split).T
        report |= {"other_pct": round(float(np.median(other)), 3),
                   "attention_pct": round(float(np.median(attention)), 3)}
    return report


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
    """Write only a profile the simulator accepts: sim.cost's check reads its text before anything is written
    (a refused one leaves ``path`` as it was)."""
    write_checked_json(path, profile, profile_problem, "--out")


def print_report(report: dict) -> None:
    if report["layer_bwd_from_step"]:
        print(f"layer_bwd: the forward and backward timed in one call (layer_step) less the forward timed alone, "
              f"at {report['layer_bwd_from_step']} points (as a training step runs them)")
    for split in ("heldout", "fit"):
        print(f"{split} absolute % error (median / max / points):")
        for name, s in report[f"{split}_mape"].items():
            print(f"  {name:>13}: {s['median_ape_pct']:7.2f} {s['max_ape_pct']:8.2f} {s['points']:5d}")
    print("timing spread (p80-p20)/median %:", report["noise_pct"])
    gap = report["composition_pct"]
    if gap is not None:
        print(f"whole layer vs the sum of its terms timed alone ({gap['points']} layers): median |gap| "
              f"{gap['median_abs_pct']:.2f}%, max {gap['max_abs_pct']:.2f}%, median {gap['median_pct']:+.2f}% "
              "(what an exact prediction of every term would still miss)")
        if "other_pct" in gap:
            print(f"  of which the other work timed apart vs in one call {gap['other_pct']:+.2f}%, the attention "
                  f"alone vs inside the layer {gap['attention_pct']:+.2f}% (medians)")
    print("conditioning (scaled design matrix; features merged into others, held at 0):")
    for term, c in report["conditioning"]["terms"].items():
        merged = "; ".join(f"{f} = " + " + ".join(f"{w:g} {g}" for g, w in ws.items()) for f, ws in c["merged"].items())
        print(f"  {term:>13}: condition {c['condition_number']:<8g} {merged}".rstrip())
    print("validation (whole layer fwd+bwd, packed mixed budgets):")
    for v in report["validation"]:
        print(f"  {v['model']:>10} {v['lengths']} kf={v['kept_fractions']}: measured {v['measured_ms']:.3f} ms, "
              f"predicted {v['predicted_ms']:.3f} ms, {v['error_pct']:+.1f}%")


HELDOUT_TARGET_PCT = 5.0  # held-out median absolute % error of whole layers
VALIDATION_TARGET_PCT = 10.0  # every validation micro-batch (packed, mixed budgets, outside the grid)


def _recorded(section, *keys: str) -> float | None:
    """The number at ``section[k0][k1]...``, or None when it is absent or not a number (a hand-edited fit)."""
    for key in keys:
        section = section.get(key) if isinstance(section, dict) else None
    return float(section) if isinstance(section, (int, float)) and not isinstance(section, bool) else None


def target_checks(profile: dict) -> list[tuple[str, float | None, float]]:
    """(what, recorded % error or None, limit on its size) for every error target of a profile."""
    report = profile.get("fit")
    checks = backend_checks(profile, _recorded)  # every attention backend's held-out fwd+bwd, ours first
    checks.append(("held-out layer median", _recorded(report, "heldout_mape", "layer", "median_ape_pct"),
                   HELDOUT_TARGET_PCT))
    validation = report.get("validation") if isinstance(report, dict) else None
    # No validation table at all is a miss, not a vacuous pass.
    for point in validation if isinstance(validation, list) and validation else [None]:
        label = (f"validation {point.get('model')} {point.get('lengths')}" if isinstance(point, dict)
                 else "validation")
        checks.append((label, _recorded(point, "error_pct"), VALIDATION_TARGET_PCT))
    return checks


def _met(value: float | None, limit: float) -> bool:
    return value is not None and abs(value) <= limit


def check(path: Path) -> int:
    """``--check``: 0 when the profile's recorded fit meets every error target, else 1 and one line on stderr
    (a file that is not a profile is bad input: ConfigError)."""
    profile = load_profile(str(path), key="--check")
    kind = "provisional" if profile["provisional"] else "measured"
    print(f"{path} ({kind}, {profile['gpu']}, fitted {profile['meta'].get('fitted', 'never')}):")
    checks = target_checks(profile)
    for what, value, limit in checks:
        shown = "not recorded" if value is None else f"{value:.2f}%"
        print(f"  {what}: {shown} (target within {limit:g}%) {'ok' if _met(value, limit) else 'MISSED'}")
    missed = [f"{what} {'not recorded' if value is None else f'{value:+g}%'} (target within {limit:g}%)"
              for what, value, limit in checks if not _met(value, limit)]
    if missed:
        print(f"{path}: error targets missed: {'; '.join(missed)}", file=sys.stderr)
        return 1
    print("error targets met")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m calibrate.fit", description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="raw measurements from calibrate.run")
    ap.add_argument("--out", type=Path, help=f"profile to write (default: <gpu>.json beside --csv <gpu>{RAW_SUFFIX})")
    ap.add_argument("--gpu", help=f"the profile's gpu name (default: <gpu> of --csv <gpu>{RAW_SUFFIX})")
    ap.add_argument("--replace-measured", action="store_true",
                    help="allow --out to name a profile measured on another GPU, which is then overwritten")
    ap.add_argument("--check", nargs="?", const=DEFAULT_OUT, type=Path, metavar="PROFILE",
                    help=f"fit nothing; check that PROFILE (default {DEFAULT_OUT.relative_to(ROOT)}) meets the "
                         f"error targets: held-out attention fwd+bwd of every backend median <= "
                         f"{HELDOUT_MEDIAN_PCT:g}%%, max <= {HELDOUT_MAX_PCT:g}%%; whole layers median <= "
                         f"{HELDOUT_TARGET_PCT:g}%%; every validation point within {VALIDATION_TARGET_PCT:g}%%")
    ap.add_argument("--backends-only", action="store_true",
                    help="fit only the dense backends' terms and write them into the profile at --out, whose own "
                         "terms and fit stay as they are (a peer timed later, beside a committed profile)")
    return ap.parse_args(argv)


def output_names(args: argparse.Namespace) -> tuple[str, Path]:
    """The profile's gpu name and path: as given, else the GPU that --csv <gpu>_raw.csv is named after."""
    named = args.csv.name[:-len(RAW_SUFFIX)] if args.csv.name.endswith(RAW_SUFFIX) else ""
    if (args.gpu is None or args.out is None) and not named:
        raise ConfigError(f"--csv {args.csv}: its name does not say the GPU; allowed: a CSV named "
                          f"<gpu>{RAW_SUFFIX}, or --gpu and --out")
    gpu = named if args.gpu is None else args.gpu
    if not gpu.strip():
        raise ConfigError(f"--gpu={gpu!r}: allowed: a non-empty name, such as h200")
    return gpu, args.csv.with_name(f"{named}.json") if args.out is None else args.out


def check_same_gpu(out: Path, gpu_name: str | None, csv: Path) -> None:
    """Refuse to overwrite a measured profile of another GPU (or a file that is not a provisional profile):
    refitting a GPU's own measurements replaces its profile, fitting another's needs --replace-measured."""
    if not out.exists():
        return
    try:
        existing = json.loads(out.read_bytes())
    except (OSError, ValueError):
        existing = None
    if isinstance(existing, dict) and existing.get("provisional") is True:
        return
    meta = existing.get("meta") if isinstance(existing, dict) else None
    theirs = meta.get("gpu_name") if isinstance(meta, dict) else None
    if theirs != gpu_name:
        raise ConfigError(f"--out={out}: holds a measured profile of {theirs!r}, and --csv {csv} was measured on "
                          f"{gpu_name!r}; pass --replace-measured to overwrite it with this fit")


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check is not None:
        return check(args.check)
    if not args.csv.is_file():
        raise ConfigError(f"--csv {args.csv}: no such file (raw measurements are written by calibrate.run)")
    runs = read_runs(args.csv)
    if not runs:
        raise ConfigError(f"--csv {args.csv}: no run metadata {meta_path(args.csv).name} beside it (written by "
                          "calibrate.run)")
    gpu, out = output_names(args)
    check_writable(out, "--out")
    if not args.replace_measured:
        check_same_gpu(out, runs[-1].get("gpu_name"), args.csv)
    grid = runs[-1]["grid"]
    measured = load_measurements(args.csv)
    measurements = [m for m in measured if m.backend == OURS]  # our kernel's and the layer's
    features = FeatureSource(grid["models"], grid["block_size"])
    fit_command = shlex.join(["python", "-m", "calibrate.fit", *(sys.argv[1:] if argv is None else argv)])
    try:
        backends = fit_backends([m for m in measured if m.backend != OURS], grid["models"], grid["block_size"],
                                recorded_versions(runs))
        if args.backends_only:
            write_profile(out, with_backends(load_profile(str(out), key="--out"), backends, runs, fit_command))
            print_backends(backends)
            print(f"wrote the backends of {out}")
            return 0
        trained, stepped = as_trained(measurements)
        fitted = fit_all(trained, features)
    except ConfigError as exc:
        raise ConfigError(f"--csv {args.csv}: {exc}") from None
    coefs = fitted.coefs
    report = {
        "conditioning": fitted.conditioning(),
        "layer_bwd_from_step": stepped,
        "heldout_mape": summarise(evaluate(trained, coefs, features, "heldout")),
        "fit_mape": summarise(evaluate(trained, coefs, features, "fit")),
        "validation": validation_table(measurements, coefs, features),
        "noise_pct": noise(measurements),
        "composition_pct": composition(measurements),
        "points": {s: sum(m.split == s for m in measurements) for s in ("fit", "heldout", "validate")},
    }
    profile = build_profile(gpu, runs, coefs, report, fit_command, args.csv)
    write_profile(out, profile | ({"backends": backends} if backends else {}))
    print_report(report)
    print_backends(backends)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
