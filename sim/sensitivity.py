"""Measured sensitivity profiles: a model of each sequence's sensitivity s by its length, fitted on a trained
model's attention (``python -m runner.sensitivity``, then ``python -m calibrate.sensitivity``), from which the
workload draws s instead of its Beta prior (``workload.sensitivity_profile``).

Family ``logit_normal``: per task, ``logit(s) ~ Normal(mean(length), std(length) ** 2)``, where ``mean`` and
``std`` are given at knots ``lengths`` and interpolated linearly in ln(length) between them, held at the end
knots' values beyond (the model is never extrapolated past the lengths it was measured at). Two knots with one
std are ``logit(s) = a + b ln(length) + std z``; a knot per measured length is a free mean and spread per length.

The file (``calibrate/profiles/sensitivity_<name>.json``):
```json
{"schema_version": 1, "kind": "sensitivity", "family": "logit_normal",
 "meta": {"command": "...", "date": "...", "model": {...}, "task": {...}},
 "tasks": {"retrieval": {"lengths": [512, 32768], "logit_mean": [..., ...], "logit_std": [..., ...]}},
 "fit": {...}}
```
Anything else (another version or kind, a missing or extra key, knots that are not increasing whole lengths,
lists of different sizes, a non-finite value or a negative std) is refused in one line naming the key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.special import expit

from sparsebalance.sim.core import ConfigError, read_checked_json

# The measurement ``python -m runner.sensitivity`` writes and ``python -m calibrate.sensitivity`` fits (the two may
# not import each other): one row per (sequence, layer, budget); ``mode`` is ``p`` (top-p coverage target) or
# ``kept`` (fixed kept fraction), ``budget`` its value, ``kept_fraction`` and ``coverage`` what the kernel's
# selection reports; ``data_sensitivity`` is the s the task's generator was given for the sequence. The run's facts
# (command, date, model, task, checkpoint) go to ``<stem>.meta.json`` beside the CSV.
RAW_COLUMNS = ("task", "seq_id", "length", "data_sensitivity", "layer", "mode", "budget", "kept_fraction", "coverage")
MODES = ("p", "kept")

SENSITIVITY_SCHEMA_VERSION = 1
KIND = "sensitivity"
FAMILY = "logit_normal"
KEYS = ("schema_version", "kind", "family", "meta", "tasks", "fit")
TASK_KEYS = ("lengths", "logit_mean", "logit_std")


@dataclass(frozen=True)
class SensitivityModel:
    """One task's model of s by length."""

    task: str
    lengths: tuple[int, ...]  # knots, increasing
    logit_mean: tuple[float, ...]
    logit_std: tuple[float, ...]

    def _at(self, values: tuple[float, ...], lengths) -> np.ndarray:
        return np.interp(np.log(np.asarray(lengths, dtype=np.float64)), np.log(self.lengths), values)

    def mean(self, lengths) -> np.ndarray:
        """The mean of logit(s) at each length."""
        return self._at(self.logit_mean, lengths)

    def std(self, lengths) -> np.ndarray:
        return self._at(self.logit_std, lengths)

    def draw(self, lengths, rng: np.random.Generator) -> np.ndarray:
        """One s per length, in (0, 1); one standard normal per length from ``rng``."""
        lengths = np.asarray(lengths)
        return expit(self.mean(lengths) + self.std(lengths) * rng.standard_normal(lengths.size))


def raw_meta_path(csv: Path) -> Path:
    return csv.with_name(csv.stem + ".meta.json")


def load_sensitivity_profile(path: str, task: str | None = None,
                             key: str = "workload.sensitivity_profile") -> SensitivityModel:
    """The model of ``task`` (None: the profile's only task) in the profile at ``path``; any problem is one
    ConfigError line naming ``key`` and the file."""
    profile = read_profile(path, key)
    tasks = profile["tasks"]
    if task is None:
        if len(tasks) != 1:
            raise ConfigError(f"{key}={path!r} holds the tasks {', '.join(sorted(tasks))}; set "
                              "workload.sensitivity_task to one of them")
        task = next(iter(tasks))
    if task not in tasks:
        raise ConfigError(f"workload.sensitivity_task={task!r} is not in {key}={path!r}; allowed: "
                          f"{', '.join(sorted(tasks))}")
    entry = tasks[task]
    return SensitivityModel(task, tuple(entry["lengths"]), tuple(map(float, entry["logit_mean"])),
                            tuple(map(float, entry["logit_std"])))


def read_profile(path: str, key: str) -> dict:
    """The parsed profile, once it passes every check of ``profile_problem``."""
    return read_checked_json(path, key, "profiles are written by python -m calibrate.sensitivity", profile_problem)


def profile_problem(profile) -> str | None:
    """What is wrong with a parsed profile, as ``<key>=<value>: <what is allowed>``; None when it is usable."""
    if not isinstance(profile, dict):
        return f"the top level is a {type(profile).__name__}; a sensitivity profile is a JSON object"
    # the kind first: a cost or memory profile is refused for what it is, whatever its schema version
    if profile.get("kind") != KIND:
        return f"kind={profile.get('kind')!r}: allowed: {KIND!r} (a cost or memory profile is not a sensitivity one)"
    version = profile.get("schema_version")
    if version != SENSITIVITY_SCHEMA_VERSION or isinstance(version, bool):
        return f"schema_version={version!r}: this simulator reads {SENSITIVITY_SCHEMA_VERSION}"
    missing = [k for k in KEYS if k not in profile]
    if missing:
        return f"missing key {missing[0]!r}; a sensitivity profile has {', '.join(KEYS)}"
    extra = sorted(set(profile) - set(KEYS))
    if extra:
        return f"unknown key {extra[0]!r}; a sensitivity profile has {', '.join(KEYS)}"
    if profile["family"] != FAMILY:
        return f"family={profile['family']!r}: allowed: {FAMILY!r}"
    for name in ("meta", "fit"):
        if not isinstance(profile[name], dict):
            return f"{name}={profile[name]!r}: must be a JSON object"
    return _tasks_problem(profile["tasks"])


def _tasks_problem(tasks) -> str | None:
    if not isinstance(tasks, dict) or not tasks:
        return f"tasks={tasks!r}: must map at least one task name to its model ({', '.join(TASK_KEYS)})"
    for task, entry in tasks.items():
        where = f"tasks.{task}"
        if not isinstance(entry, dict) or set(entry) != set(TASK_KEYS):
            found = sorted(entry) if isinstance(entry, dict) else entry
            return f"{where}={found!r}: must have exactly the keys {', '.join(TASK_KEYS)}"
        problem = _knots_problem(entry["lengths"], f"{where}.lengths") or _values_problem(entry, where)
        if problem:
            return problem
    return None


def _values_problem(entry: dict, where: str) -> str | None:
    for name in ("logit_mean", "logit_std"):
        values = entry[name]
        if not isinstance(values, list) or len(values) != len(entry["lengths"]):
            return f"{where}.{name}={values!r}: must be a list of one number per knot in {where}.lengths"
        if not all(_is_finite(v) for v in values):
            return f"{where}.{name}={values!r}: must be finite numbers"
        if name == "logit_std" and min(values) < 0:
            return f"{where}.{name}={values!r}: must be >= 0 (spreads)"
    return None


def _knots_problem(lengths, where: str) -> str | None:
    if (not isinstance(lengths, list) or not lengths
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
            or any(a >= b for a, b in zip(lengths, lengths[1:], strict=False))):
        return f"{where}={lengths!r}: must be increasing whole lengths >= 1 (the knots)"
    return None


def _is_finite(value) -> bool:
    """A JSON number that is finite as a float (an integer too large for one is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
