"""Fit a sensitivity profile to measured coverage curves: ``python -m calibrate.sensitivity raw.csv [raw2.csv ...]
--out calibrate/profiles/sensitivity_<name>.json [--check [PROFILE]]``.

Input: the CSVs of ``python -m runner.sensitivity`` (one per checkpoint, one task each; the columns are
``sim.sensitivity.RAW_COLUMNS``, the run's facts in ``<stem>.meta.json`` beside each). Nothing of the runner is
imported: the fit reads the files only.

1. Exponents. The coverage model is ``coverage = kept_fraction ** s`` (docs/CONTRACTS.md), i.e.
   ``ln coverage = s ln kept_fraction``: per curve, s is the least-squares slope through the origin over that
   curve's budgets (top-p and fixed kept fractions alike), leaving out the points with kept_fraction = 1
   (ln 1 = 0 says nothing about s), clipped into (0, 1]. Per (sequence, layer), and per sequence on the
   curve averaged over layers, which is what the simulator's coverage of a sequence is (the runner records the
   layer mean); the model below is fitted on the per-sequence exponents, the per-layer ones are reported.
   How well the power law itself fits is the median relative error of ``kept_fraction ** s`` against the
   measured coverage over those points.
2. The model of s by length, per task: ``logit(s) = intercept + slope ln(length) + residual_std z``, z standard
   normal. The logit keeps every draw inside (0, 1) whatever the spread, and the residual std is constant in
   logit space, where a share near 0 or 1 has a small spread in s as a Beta's has. Whether the data support
   it is in the held-out report: it is compared with a free mean per length (the most a model of the mean by
   length can do) and with one mean for every length (length does not matter); ``--check`` asks that it come
   within HELDOUT_SLACK of the free mean per length.
3. Held-out error, split by sequence: of each (task, length)'s sequences, by id, every HOLDOUT_EVERY-th is held
   out; the model is fitted on the others. Reported per task: logit RMSE, median |s - median draw|, and the
   share of held-out s inside the model's central 80% interval (0.8 when the spread is right).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.special import expit, logit
from scipy.stats import norm, spearmanr

from sparsebalance.sim.core import ArgumentParser, ConfigError, check_writable, one_line_errors, write_checked_json
from sparsebalance.sim.sensitivity import (FAMILY, KIND, MODES, RAW_COLUMNS, SENSITIVITY_SCHEMA_VERSION,
                                           SensitivityModel, profile_problem, raw_meta_path, read_profile)
from sparsebalance.sim.workload import MIN_SENSITIVITY

HOLDOUT_EVERY = 4  # every 4th sequence of a (task, length), by id, is held out
INTERVAL = 0.8  # the central interval whose held-out share is reported
INTERVAL_KEY = f"share_in_{int(INTERVAL * 100)}pct_interval"
MIN_INTERVAL_SHARE = 0.6  # --check: at least this share of held-out s inside the chosen model's 80% interval
POWER_LAW_TARGET = 0.05  # --check: median relative error of kf ** s against measured coverage, per sequence
# The straight line in ln(length) is kept while its held-out logit RMSE is at most this times a free mean per length's.
HELDOUT_SLACK = 1.1
# s is clipped into [S_LO, S_HI] before the logit: a curve with coverage 1 at every budget (s = 0) or with
# coverage = kept fraction (s = 1) would otherwise sit at minus or plus infinity.
S_LO, S_HI = MIN_SENSITIVITY, 1.0 - MIN_SENSITIVITY
CURVE = ["source", "task", "seq_id", "length"]  # one sequence of one measurement


# ---------------------------------------------------------------------- reading
def read_raw(csvs: list[Path]) -> tuple[pd.DataFrame, list[dict]]:
    """Every CSV's rows (``source``: its index) and run facts; one ConfigError line on the first bad one."""
    frames, facts, seen = [], [], {}
    for i, csv in enumerate(csvs):
        frame, meta = _read_one(csv)
        for task in frame["task"].unique():
            if task in seen:
                raise ConfigError(f"{csv}: task {task!r} is measured in {seen[task]} too; allowed: one "
                                  "measurement (checkpoint) per task")
            seen[task] = csv
        frames.append(frame.assign(source=i))
        facts.append(meta)
    return pd.concat(frames, ignore_index=True), facts


def _read_one(csv: Path) -> tuple[pd.DataFrame, dict]:
    if not csv.is_file():
        raise ConfigError(f"{csv}: no such file (raw measurements are written by python -m runner.sensitivity)")
    meta = raw_meta_path(csv)
    if not meta.is_file():
        raise ConfigError(f"{csv}: no run facts {meta.name} beside it (written by python -m runner.sensitivity)")
    try:
        frame = pd.read_csv(csv)
        facts = json.loads(meta.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{csv}: unreadable ({str(exc).splitlines()[0]})") from None
    problem = _frame_problem(frame) or (None if isinstance(facts, dict) else f"{meta.name} is not a JSON object")
    if problem:
        raise ConfigError(f"{csv}: {problem}")
    return frame, facts


def _frame_problem(frame: pd.DataFrame) -> str | None:
    if list(frame.columns) != list(RAW_COLUMNS):
        return f"columns {list(frame.columns)}; allowed: {', '.join(RAW_COLUMNS)} (python -m runner.sensitivity)"
    if frame.empty:
        return "no rows"
    checks = [
        ("mode", frame["mode"].isin(MODES), f"one of {', '.join(MODES)}"),
        ("length", _whole(frame["length"], 1), "a whole number of tokens >= 1"),
        ("seq_id", _whole(frame["seq_id"], 0), "a whole number >= 0"),
        ("layer", _whole(frame["layer"], 0), "a whole number >= 0"),
        ("data_sensitivity", _share(frame["data_sensitivity"]), "a number in (0, 1]"),
    ] + [(c, _share(frame[c]), "a number in (0, 1]") for c in ("budget", "kept_fraction", "coverage")]
    for column, ok, allowed in checks:
        bad = np.flatnonzero(~ok.to_numpy())
        if bad.size:
            return f"row {bad[0] + 1} has {column}={frame[column].tolist()[bad[0]]!r}; allowed: {allowed}"
    return None


def _whole(column: pd.Series, minimum: int) -> pd.Series:
    values = pd.to_numeric(column, errors="coerce")
    return values.notna() & (values >= minimum) & (values == np.floor(values))


def _share(column: pd.Series) -> pd.Series:
    values = pd.to_numeric(column, errors="coerce")
    return values.notna() & (values > 0) & (values <= 1)


# ---------------------------------------------------------------------- 1. exponents
def exponents(points: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per group: s = sum(x y) / sum(x x) with x = ln kept_fraction, y = ln coverage over its points with
    kept_fraction < 1, clipped into [MIN_SENSITIVITY, 1]; groups without such a point are left out."""
    informative = points[points["kept_fraction"] < 1.0]
    x, y = np.log(informative["kept_fraction"]), np.log(informative["coverage"])
    sums = pd.DataFrame({"xy": x * y, "xx": x * x}).groupby([informative[c] for c in by]).sum()
    raw = sums["xy"] / sums["xx"]
    return pd.DataFrame({"s": raw.clip(MIN_SENSITIVITY, 1.0), "clipped": (raw > 1.0) | (raw < MIN_SENSITIVITY),
                         "points": informative.groupby(by).size()}).reset_index()


def layer_mean_curves(raw: pd.DataFrame) -> pd.DataFrame:
    """Each sequence's kept fraction and coverage at each budget, averaged over layers (the runner's coverage)."""
    keys = [*CURVE, "data_sensitivity", "mode", "budget"]
    return raw.groupby(keys, as_index=False)[["kept_fraction", "coverage"]].mean()


def power_law_error(points: pd.DataFrame, fitted: pd.DataFrame, by: list[str]) -> dict:
    """Relative error |kf ** s - coverage| / coverage over the points the exponents were fitted on."""
    joined = points[points["kept_fraction"] < 1.0].merge(fitted[[*by, "s"]], on=by)
    rel = np.abs(joined["kept_fraction"] ** joined["s"] - joined["coverage"]) / joined["coverage"]
    return {"median_rel_err_coverage": _num(np.median(rel)), "p90_rel_err_coverage": _num(np.quantile(rel, 0.9)),
            "points": int(rel.size)}


# ---------------------------------------------------------------------- 2. the model
@dataclass(frozen=True)
class LogitLinear:
    intercept: float
    slope: float
    residual_std: float

    def mean(self, lengths) -> np.ndarray:
        return self.intercept + self.slope * np.log(np.asarray(lengths, dtype=np.float64))


def to_logit(s) -> np.ndarray:
    return logit(np.clip(np.asarray(s, dtype=np.float64), S_LO, S_HI))


def fit_linear(lengths: np.ndarray, s: np.ndarray) -> LogitLinear:
    """Least squares of logit(s) on [1, ln length]; residual std with the two fitted degrees of freedom."""
    X = np.column_stack([np.ones(lengths.size), np.log(lengths.astype(np.float64))])
    z = to_logit(s)
    coef, *_ = np.linalg.lstsq(X, z, rcond=None)
    resid = z - X @ coef
    return LogitLinear(float(coef[0]), float(coef[1]), float(np.sqrt(resid @ resid / (z.size - 2))))


def candidates(task: str, fit: pd.DataFrame, knots: list[int]) -> dict[str, SensitivityModel]:
    """The two models, as the simulator evaluates them: ``linear`` (two knots at the measured range's ends, one
    std) and ``per_length`` (a knot per measured length with that length's mean and std of logit(s))."""
    line = fit_linear(fit["length"].to_numpy(), fit["s"].to_numpy())
    ends = (knots[0], knots[-1])
    z = pd.Series(to_logit(fit["s"]), index=fit.index).groupby(fit["length"])
    return {
        "linear": SensitivityModel(task, ends, tuple(line.mean(ends).tolist()), (line.residual_std,) * 2),
        "per_length": SensitivityModel(task, tuple(knots), tuple(z.mean()[knots].tolist()),
                                       tuple(z.std(ddof=1)[knots].tolist())),
    }


def held_out_mask(sequences: pd.DataFrame) -> np.ndarray:
    """Every HOLDOUT_EVERY-th sequence of each (source, task, length), in id order."""
    rank = sequences.groupby(["source", "task", "length"])["seq_id"].rank(method="first").to_numpy()
    return (rank % HOLDOUT_EVERY) == 0


def check_fittable(task: str, fit: pd.DataFrame, test: pd.DataFrame) -> None:
    counts = fit.groupby("length").size()
    if counts.size < 2 or counts.min() < 2:
        raise ConfigError(f"task {task!r}: fit sequences per length {counts.to_dict()}; allowed: two lengths or more "
                          "with two fit sequences each (more --lengths or --sequences in runner.sensitivity)")
    if test.empty:
        raise ConfigError(f"task {task!r}: no held-out sequence; allowed: at least {HOLDOUT_EVERY} sequences per "
                          "length (runner.sensitivity --sequences)")


def held_out_errors(model: SensitivityModel, test: pd.DataFrame) -> dict:
    z, lengths = to_logit(test["s"]), test["length"].to_numpy()
    mu, half = model.mean(lengths), norm.ppf(0.5 + INTERVAL / 2) * model.std(lengths)
    return {
        "rmse_logit": _num(_rmse(z - mu)),
        "median_abs_err_s": _num(np.median(np.abs(test["s"].to_numpy() - expit(mu)))),
        INTERVAL_KEY: _num(np.mean(np.abs(z - mu) <= half)),
    }


def choose(errors: dict[str, dict]) -> str:
    """``linear`` unless a free mean per length predicts the held-out sequences clearly better."""
    linear, free = errors["linear"]["rmse_logit"], errors["per_length"]["rmse_logit"]
    return "linear" if linear <= HELDOUT_SLACK * free else "per_length"


def by_length(sequences: pd.DataFrame, model: SensitivityModel) -> list[dict]:
    rows = []
    for length, group in sequences.groupby("length"):
        z = to_logit(group["s"])
        rows.append({"length": int(length), "sequences": int(len(group)), "mean_s": _num(group["s"].mean()),
                     "std_s": _num(group["s"].std(ddof=0)), "mean_logit_s": _num(z.mean()),
                     "std_logit_s": _num(z.std(ddof=0)), "model_logit_mean": _num(model.mean([length])[0]),
                     "model_logit_std": _num(model.std([length])[0])})
    return rows


def per_layer(layers: pd.DataFrame) -> list[dict]:
    return [{"layer": int(layer), "mean_s": _num(g["s"].mean()), "std_s": _num(g["s"].std(ddof=0)),
             "sequences": int(len(g))} for layer, g in layers.groupby("layer")]


def fit_task(task: str, sequences: pd.DataFrame, layers: pd.DataFrame, measured: int) -> tuple[dict, dict]:
    """The task's profile entry (the chosen model) and its report; ``measured`` sequences were measured, those
    that kept every block at every budget (no sparse point: too short for the block size) have no exponent."""
    test_mask = held_out_mask(sequences)
    fit, test = sequences[~test_mask], sequences[test_mask]
    check_fittable(task, fit, test)
    models = candidates(task, fit, sorted(int(n) for n in sequences["length"].unique()))
    errors = {name: held_out_errors(model, test) for name, model in models.items()}
    chosen = models[choose(errors)]
    entry = {"lengths": list(chosen.lengths), "logit_mean": [_num(v) for v in chosen.logit_mean],
             "logit_std": [_num(v) for v in chosen.logit_std]}
    varied = sequences["data_sensitivity"].nunique() > 1
    report = {
        "sequences": {"fit": int(len(fit)), "heldout": int(len(test)), "clipped": int(sequences["clipped"].sum()),
                      "dense": measured - int(len(sequences))},
        "chosen": choose(errors),
        "heldout": {**errors, "constant_rmse_logit": _num(_rmse(to_logit(test["s"]) - to_logit(fit["s"]).mean()))},
        "by_length": by_length(sequences, chosen),
        "per_layer": per_layer(layers),
        # does s rise with the sensitivity the task's generator was given (more records to find)?
        "data_sensitivity_spearman": _num(spearmanr(sequences["data_sensitivity"], sequences["s"]).statistic)
        if varied else None,
    }
    return entry, report


# ---------------------------------------------------------------------- the profile
def build_profile(raw: pd.DataFrame, facts: list[dict], fit_command: str) -> dict:
    curves = layer_mean_curves(raw)
    seq_s = exponents(curves, [*CURVE, "data_sensitivity"])
    layer_s = exponents(raw, [*CURVE, "layer"])
    tasks, reports = {}, {}
    for task, sequences in seq_s.groupby("task"):
        measured = int(raw.loc[raw["task"] == task, "seq_id"].nunique())
        tasks[task], reports[task] = fit_task(task, sequences, layer_s[layer_s["task"] == task], measured)
    return {
        "schema_version": SENSITIVITY_SCHEMA_VERSION,
        "kind": KIND,
        "family": FAMILY,
        "meta": {
            "command": " && ".join([f.get("command", "?") for f in facts] + [fit_command]),
            "date": facts[0].get("date"),
            "fitted": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "model": {task: f.get("model") for f in facts for task in f.get("task", {})},
            "task": {task: config for f in facts for task, config in f.get("task", {}).items()},
            "measurements": facts,
        },
        "tasks": tasks,
        "fit": {
            "method": f"per task, logit(s) as a straight line in ln(length) with one std (linear), or a mean and std "
                      f"per measured length (per_length) where that predicts the held-out sequences better by more "
                      f"than {HELDOUT_SLACK:g}x in logit RMSE; fitted on the per-sequence exponents, every "
                      f"{HOLDOUT_EVERY}th sequence of a length held out",
            "power_law": {"sequence": power_law_error(curves, seq_s, [*CURVE, "data_sensitivity"]),
                          "layer": power_law_error(raw, layer_s, [*CURVE, "layer"])},
            "tasks": reports,
        },
    }


def write_profile(path: Path, profile: dict) -> None:
    """Write only a profile the simulator accepts: sim.sensitivity's check reads its text before anything is
    written (a refused one leaves ``path`` as it was)."""
    write_checked_json(path, profile, profile_problem, "--out")


def print_report(profile: dict) -> None:
    law = profile["fit"]["power_law"]
    for level in ("sequence", "layer"):
        e = law[level]
        print(f"power law kf ** s, per {level}: median relative coverage error {e['median_rel_err_coverage']:.4f}, "
              f"p90 {e['p90_rel_err_coverage']:.4f} over {e['points']} points")
    for task, entry in profile["tasks"].items():
        report = profile["fit"]["tasks"][task]
        h = report["heldout"]
        print(f"{task}: {report['chosen']} model, knots {entry['lengths']}; sequences {report['sequences']}; "
              f"spearman(s, data sensitivity) {report['data_sensitivity_spearman']}")
        for name in ("linear", "per_length"):
            e = h[name]
            print(f"  held out, {name:>10}: logit RMSE {e['rmse_logit']:.4f}, median |s error| "
                  f"{e['median_abs_err_s']:.4f}, in the {int(INTERVAL * 100)}% interval {e[INTERVAL_KEY]:.2f}")
        print(f"  held out, one mean for every length: logit RMSE {h['constant_rmse_logit']:.4f}")
        for row in report["by_length"]:
            print(f"  length {row['length']:>6}: {row['sequences']:3d} sequences, s {row['mean_s']:.4f} "
                  f"+- {row['std_s']:.4f}, logit {row['mean_logit_s']:+.3f} +- {row['std_logit_s']:.3f} "
                  f"(model {row['model_logit_mean']:+.3f} +- {row['model_logit_std']:.3f})")


# ---------------------------------------------------------------------- --check
def target_checks(profile: dict) -> list[tuple[str, float | None, float, bool]]:
    """(what, recorded value or None, its bound, whether the bound is a maximum) for every target of a profile."""
    fit = profile["fit"]
    checks = [("power law median relative coverage error per sequence",
               _recorded(fit, "power_law", "sequence", "median_rel_err_coverage"), POWER_LAW_TARGET, True)]
    for task in profile["tasks"]:
        chosen = _chosen(fit, task)
        checks.append((f"{task} held-out share in the {chosen} model's {int(INTERVAL * 100)}% interval",
                       _recorded(fit, "tasks", task, "heldout", chosen, INTERVAL_KEY), MIN_INTERVAL_SHARE, False))
    return checks


def _chosen(fit: dict, task: str) -> str:
    report = fit.get("tasks", {}).get(task) if isinstance(fit.get("tasks"), dict) else None
    return report.get("chosen", "?") if isinstance(report, dict) else "?"


def check(path: Path) -> int:
    """0 when the profile's recorded fit meets every target, else 1 and one line on stderr (a file that is not
    a sensitivity profile is bad input: ConfigError)."""
    profile = read_profile(str(path), key="--check")
    print(f"{path} (fitted {profile['meta'].get('fitted', 'never')}):")
    missed = []
    for what, value, bound, is_max in target_checks(profile):
        met = value is not None and (value <= bound if is_max else value >= bound)
        shown = "not recorded" if value is None else f"{value:.4f}"
        wanted = f"{'at most' if is_max else 'at least'} {bound:g}"
        print(f"  {what}: {shown} ({wanted}) {'ok' if met else 'MISSED'}")
        if not met:
            missed.append(f"{what} {shown} ({wanted})")
    if missed:
        print(f"{path}: targets missed: {'; '.join(missed)}", file=sys.stderr)
        return 1
    print("targets met")
    return 0


# ---------------------------------------------------------------------- helpers
def _num(value) -> float | None:
    """A finite float at 6 significant digits for the JSON; None for what is not one (never NaN)."""
    if value is None or not np.isfinite(value):
        return None
    return float(f"{float(value):.6g}")


def _rmse(residuals) -> float:
    return float(np.sqrt(np.mean(np.square(residuals))))


def _recorded(section, *keys: str) -> float | None:
    for key in keys:
        section = section.get(key) if isinstance(section, dict) else None
    return float(section) if isinstance(section, (int, float)) and not isinstance(section, bool) else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m calibrate.sensitivity", description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="*", type=Path, help="raw CSVs of python -m runner.sensitivity (one per task)")
    ap.add_argument("--out", type=Path, help="the profile to write (calibrate/profiles/sensitivity_<name>.json)")
    ap.add_argument("--check", nargs="?", const="", metavar="PROFILE",
                    help=f"check that PROFILE (default: --out) meets the targets: power-law median relative coverage "
                         f"error <= {POWER_LAW_TARGET:g}, held-out share in the {int(INTERVAL * 100)}%% interval >= "
                         f"{MIN_INTERVAL_SHARE:g}")
    return ap.parse_args(argv)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.csv and args.check is None:
        raise ConfigError("nothing to do; allowed: raw CSVs to fit (with --out), or --check PROFILE")
    if args.csv:
        if args.out is None:
            raise ConfigError("--out is missing; allowed: the profile path to write, e.g. "
                              "calibrate/profiles/sensitivity_<name>.json")
        check_writable(args.out, "--out")
        raw, facts = read_raw(args.csv)
        fit_command = shlex.join(["python", "-m", "calibrate.sensitivity", *(sys.argv[1:] if argv is None else argv)])
        profile = build_profile(raw, facts, fit_command)
        write_profile(args.out, profile)
        print_report(profile)
        print(f"wrote {args.out}")
    if args.check is None:
        return 0
    target = Path(args.check) if args.check else args.out
    if target is None:
        raise ConfigError("--check without a PROFILE needs --out; allowed: --check PROFILE")
    return check(target)


if __name__ == "__main__":
    sys.exit(main())
