"""The fit's error report and the error-target check (``python -m calibrate.fit --check``).

The report is what a fitted profile records under ``fit``: the absolute % errors of the held-out and fitted
points, every validation micro-batch predicted against its measurement, the timing noise, and how far whole
layers are from the sum of their own terms timed alone; ``check`` reads a profile's recorded errors against
the targets.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from sparsebalance.calibrate.backends import backend_checks
from sparsebalance.calibrate.fitting import Fit, FeatureSource, Measurement, layer_prediction, term_prediction
from sparsebalance.calibrate.grid import GridPoint
from sparsebalance.calibrate.linear import ape, summarise
from sparsebalance.sim.profile import load_profile


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


def error_report(fitted: Fit, trained: list[Measurement], measurements: list[Measurement],
                 features: FeatureSource, stepped: int) -> dict:
    """What a profile records under ``fit``: errors of the fit on the measurements as trained (``stepped`` of
    them with the backward a training step pays, ``as_trained``), validation, noise and composition on the
    measurements as timed."""
    coefs = fitted.coefs
    return {
        "conditioning": fitted.conditioning(),
        "layer_bwd_from_step": stepped,
        "heldout_mape": summarise(evaluate(trained, coefs, features, "heldout")),
        "fit_mape": summarise(evaluate(trained, coefs, features, "fit")),
        "validation": validation_table(measurements, coefs, features),
        "noise_pct": noise(measurements),
        "composition_pct": composition(measurements),
        "points": {s: sum(m.split == s for m in measurements) for s in ("fit", "heldout", "validate")},
    }


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
