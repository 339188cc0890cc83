"""Fit the cost model's coefficients to raw measurements.

Features come from ``sim.cost`` itself: a CostModel whose ``term_ms`` records the feature arrays it is
handed, so the fit sees exactly the features (selection semantics, layer FLOPs) that the simulator will
multiply the coefficients by. Each term is then a nonnegative, outlier-robust fit of
``time = sum(coef[f] * feature[f])`` on relative error (rows divided by the measured time), so a 20 ms
point does not drown the 0.05 ms ones. Columns are scaled to unit norm and features that the others rebuild
exactly are merged into them (``merged_columns``), so that the coefficients are unique, not just the
predictions. ``calibrate.report`` measures the fit's error, ``python -m calibrate.fit`` runs both.
"""
from __future__ import annotations

import datetime as dt
import math
from collections.abc import Collection
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from sparsebalance.calibrate import store
from sparsebalance.calibrate.grid import TERMS as GRID_TERMS
from sparsebalance.calibrate.grid import GridPoint
from sparsebalance.calibrate.linear import COLLINEAR, TermFit, fit_term, predict
from sparsebalance.calibrate.run import read_runs
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.gpu_kinds import gpu_kind
from sparsebalance.sim.config import ModelConfig
from sparsebalance.sim.core import ConfigError, write_checked_json
from sparsebalance.sim.backends import BACKEND_NAME, DENSE_TERMS, OURS
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.profile import PROFILE_SCHEMA_VERSION, TERMS, profile_problem

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

    def __init__(self, model: ModelConfig, block_size: int, sm_count: int) -> None:
        # One GPU, cp = 1: the ring exchange (the only user of the cluster) is never priced; of the GPU the launch
        # features need its multiprocessors.
        super().__init__(model, cluster=None, block_size=block_size)
        self.sm_count = sm_count
        self.seen: dict[str, dict[str, float]] = {}

    def term_ms(self, term: str, feats: dict[str, np.ndarray]) -> np.ndarray:
        self.seen[term] = {f: float(np.asarray(v)[0]) for f, v in feats.items()}
        return np.zeros_like(feats["const"])

    def launch_ms(self, term: str, const: np.ndarray) -> np.ndarray:
        return np.zeros_like(const)  # tp = 1 here: the launch share of a TP split is never taken

    def features(self, lengths, kept_fractions) -> dict[str, dict[str, float]]:
        """Per-layer features of every term for one micro-batch."""
        self.micro_batch_cost(lengths, kept_fractions, Layout(dp=1))
        return dict(self.seen)


class FeatureSource:
    """Features of a measurement, by model name (shapes as recorded in the run's metadata), on the GPU kind ``gpu``
    of conf/cluster the measurements ran on."""

    def __init__(self, models: dict[str, dict], block_size: int, gpu: str) -> None:
        # A recorded shape may carry more than the simulator prices (the runner's rope_theta), and less:
        # a field added to ModelConfig after the run keeps its default.
        keys = [f.name for f in fields(ModelConfig)]
        sm_count = gpu_kind(gpu, "gpu").sm_count
        self.taps = {name: _FeatureTap(ModelConfig(**{k: shape[k] for k in keys if k in shape}), block_size, sm_count)
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
