"""The cost model against measurements: its calibration grid, a kernel benchmark, residuals per point."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from sparsebalance.calibrate.fitting import FeatureSource, Measurement, load_measurements, term_prediction
from sparsebalance.calibrate.linear import predict
from sparsebalance.sim.backends import OURS
from sparsebalance.sim.gpu_kinds import default_kind
from sparsebalance.calibrate.grid import GridPoint
from sparsebalance.calibrate.run import meta_path
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.profile import load_profile
from sparsebalance.sim.sensitivity import KIND as SENSITIVITY_KIND
from sparsebalance.sim.shapes import load_shapes
from sparsebalance.viz.runs import PlotError
from sparsebalance.viz.style import OKABE_ITO, plain_log, viridis

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / default_kind().profile  # the default cluster's measured one
TERM_ORDER = ("attn_fwd", "attn_bwd", "attn_fwd+bwd", "select", "layer_fwd", "layer_bwd")


def read_profile(path: str | Path) -> dict:
    """A cost profile; calibrate's other profiles are named as what they are, not as a cost profile to refit."""
    try:
        return load_profile(str(path))
    except ConfigError as exc:
        other = other_profile(path)
        if other:
            raise PlotError(f"{path}: a {other}, which viz does not draw; allowed: a cost profile "
                            "(calibrate/profiles/<gpu>.json, from calibrate.fit)") from None
        raise PlotError(str(exc)) from None


def other_profile(path: str | Path) -> str | None:
    """What a JSON file is when it is calibrate's sensitivity or memory profile (None: neither)."""
    try:
        profile = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(profile, dict):
        return None
    if profile.get("kind") == SENSITIVITY_KIND:
        return "sensitivity profile (from calibrate.sensitivity)"
    if "shapes" in profile and "terms" not in profile:
        return "memory profile (from calibrate.memory)"
    return None


def raw_csv_of(profile_path: Path, profile: dict) -> Path:
    """The raw measurements a profile was fitted on (named in its meta, else ``<gpu>_raw.csv``)."""
    name = profile.get("meta", {}).get("raw_csv") or f"{profile.get('gpu', profile_path.stem)}_raw.csv"
    return profile_path.parent / name


def calibration_frame(profile_path: str | Path) -> pd.DataFrame:
    """One row per raw measurement: measured and fitted ms, batch shape, split and residual (%)."""
    profile_path = Path(profile_path)
    profile = read_profile(profile_path)
    csv = raw_csv_of(profile_path, profile)
    if profile.get("provisional") or not csv.is_file():
        raise PlotError(
            f"{profile_path}: no measurements to compare with "
            f"({'provisional profile, ' if profile.get('provisional') else ''}"
            f"no {csv.name}); measure with `python -m calibrate.run` on a GPU, then `python -m calibrate.fit`"
        )
    meta = meta_path(csv)
    if not meta.is_file():
        raise PlotError(f"{csv}: no {meta.name} beside it (written by calibrate.run)")
    grid = json.loads(meta.read_text())["runs"][-1]["grid"]
    features = FeatureSource(grid["models"], grid["block_size"], profile["gpu"])
    coefs = profile["terms"]
    rows = []
    for m in load_measurements(csv):
        if m.backend != OURS:  # a dense backend's point: the profile's `backends` price it, not these terms
            continue
        feats = features(m)
        pred = term_prediction(m.term, coefs, feats)
        lengths = np.array(m.lengths, dtype=float)
        # Kept fractions weighted by each sequence's causal work (~ length^2), what the kernel pays for: the
        # one the kernel realised, and the one the grid asked for (the key's last field), which groups points.
        work = lengths**2 / np.dot(lengths, lengths)
        asked = GridPoint.budgets_of(m.key)
        rows.append({
            "term": m.term, "split": m.split, "model": m.model, "tokens": int(lengths.sum()),
            "sequences": len(m.lengths), "kept_fraction": float(np.dot(m.kept_fractions, work)),
            "budget": round(float(np.dot(asked, work)), 3), "measured_ms": m.median_ms, "predicted_ms": pred,
        })
    return _with_residuals(pd.DataFrame(rows))


def _with_residuals(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(residual_pct=100 * (frame["predicted_ms"] - frame["measured_ms"]) / frame["measured_ms"])


def benchmark_vs_profile(bench: pd.DataFrame, profile_path: str | Path, model: str = "qwen2.5-3b") -> pd.DataFrame:
    """Our kernel's benchmarked single-sequence times against what the profile predicts for them.

    The benchmark (16 query heads, D = 128) matches the attention shape of ``model``, so the profile's
    ``attn_fwd`` and ``attn_fwd + attn_bwd`` terms price the very same work; a check of the cost model on
    measurements from another harness, also for a provisional profile.
    """
    profile = read_profile(profile_path)
    (shape,) = load_shapes([model])
    features = FeatureSource({model: vars(shape)}, profile["block_size"], profile["gpu"])
    coefs = profile["terms"]
    ours = bench[(bench["impl"] == "triton_sparse") & (bench["ndocs"] == 1)]
    if ours.empty:
        raise PlotError("the benchmark has no single-sequence timings of our kernel")
    rows = []
    for r in ours.itertuples():
        feats = features(Measurement("", "", "", model, (int(r.T),), (float(r.kept_fraction),), 1.0, 0.0))
        fwd = predict(coefs["attn_fwd"], feats["attn_fwd"])
        both = fwd + predict(coefs["attn_bwd"], feats["attn_bwd"])
        for term, measured, predicted in (("attn_fwd", r.fwd_ms, fwd), ("attn_fwd+bwd", r.fwdbwd_ms, both)):
            rows.append({"term": term, "split": "benchmark", "model": model, "tokens": int(r.T), "sequences": 1,
                         "kept_fraction": float(r.kept_fraction), "budget": round(1.0 - float(r.sparsity), 3),
                         "measured_ms": float(measured), "predicted_ms": predicted})
    return _with_residuals(pd.DataFrame(rows))


def profile_title(profile: dict) -> str:
    meta = profile.get("meta", {})
    kind = "provisional roofline" if profile.get("provisional") else "fitted"
    return f"{profile.get('gpu', '?')} profile, {kind}, {str(meta.get('fitted') or meta.get('date', '?'))[:10]}"


def plot_calibration(frame: pd.DataFrame, profile: dict, model: str | None = None,
                     source: str = "calibration grid") -> Figure:
    """Measured (markers) vs fitted (lines) time of single sequences over length, one line per kept fraction."""
    model = model or frame["model"].value_counts().index[0]
    singles = frame[(frame["sequences"] == 1) & (frame["model"] == model)]
    terms = [t for t in TERM_ORDER if t in set(singles["term"])]
    if not terms:
        raise PlotError(f"no single-sequence measurements of model {model!r} to plot")
    fractions = sorted(singles["budget"].unique(), reverse=True)
    cmap = viridis(len(fractions))
    fig = Figure(figsize=(max(9.0, 3.4 * len(terms) + 2.0), 4.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(terms)))
    for ax, term in zip(axes, terms, strict=True):
        sub = singles[singles["term"] == term]
        for colour, kf in zip(cmap, fractions, strict=True):
            pts = sub[sub["budget"] == kf].sort_values("tokens")
            if pts.empty:
                continue
            ax.plot(pts["tokens"], pts["predicted_ms"], color=colour, lw=1.2)
            ax.scatter(pts["tokens"], pts["measured_ms"], color=colour, s=18, label=f"{kf:g}", zorder=3)
        ax.set_xscale("log", base=2)
        plain_log(ax, x=False)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(term)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("time per layer (ms)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, title="kept fraction\n(markers: measured,\nlines: cost model)", loc="outside right",
               fontsize=8)
    fig.suptitle(f"Measured vs cost-model time per layer, {model}\n(measured: {source}; {profile_title(profile)})")
    return fig


def plot_residuals(frame: pd.DataFrame, profile: dict) -> Figure:
    """Relative error of the fitted model per measurement, by term, fit vs held-out vs validation points."""
    # The simulator prices selection of an all-dense batch at zero by design (calibrate.fit does not fit
    # those points either); their -100% would only squash the axis, so they are counted, not drawn.
    zero = frame["predicted_ms"] <= 0
    frame = frame[~zero]
    colours = dict(zip(sorted(frame["term"].unique()), OKABE_ITO[1:] * 2, strict=False))
    markers = {"fit": "o", "heldout": "^", "validate": "s", "benchmark": "D"}
    fig = Figure(figsize=(8.5, 4.8), layout="constrained")
    ax = fig.subplots()
    ax.axhspan(-10, 10, color="0.92", zorder=0, label="±10%")
    for (term, split), sub in frame.groupby(["term", "split"]):
        ax.scatter(sub["measured_ms"], sub["residual_pct"], s=20, color=colours[term],
                   marker=markers.get(split, "x"), facecolors="none" if split == "fit" else colours[term],
                   label=f"{term} ({split})")
    ax.axhline(0, color="0.3", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("measured time (ms)")
    ax.set_ylabel("residual: (model − measured) / measured (%)")
    # The honest numbers: error on points the fit did not see (the fit's own error is in its legend marker).
    unseen = [s for s in ("heldout", "validate", "benchmark") if s in set(frame["split"])]
    note = "; ".join(f"{s} median |error| {frame.loc[frame['split'] == s, 'residual_pct'].abs().median():.1f}%"
                     for s in unseen) or "no held-out points"
    if zero.any():
        note += f"\n({int(zero.sum())} selection points of dense batches, priced at 0 by design, not shown)"
    ax.set_title(f"Cost model vs measurements, per point ({profile_title(profile)})\n{note}", fontsize=10)
    ax.legend(fontsize=7, ncols=2, loc="best")
    ax.grid(alpha=0.3)
    return fig
