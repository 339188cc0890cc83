"""Measured sensitivity profiles: a model of each sequence's sensitivity s by its length, fitted on a trained
model's attention (``python -m runner.sensitivity``, then ``python -m calibrate.sensitivity``), from which the
workload draws s instead of its Beta prior (``workload.sensitivity_profile``).

Family ``logit_linear``: per task, ``logit(s) = intercept + slope * ln(length) + residual_std * z`` with z
standard normal; the length is clamped to the measured range ``lengths`` first, so that the model is never
extrapolated beyond the lengths it was fitted on.

The file (``calibrate/profiles/sensitivity_<name>.json``):
```json
{"schema_version": 1, "kind": "sensitivity", "family": "logit_linear",
 "meta": {"command": "...", "date": "...", "model": {...}, "task": {...}},
 "tasks": {"retrieval": {"intercept": ..., "slope": ..., "residual_std": ..., "lengths": [512, 32768]}},
 "fit": {...}}
```
Anything else (another version or kind, a missing or extra key, a non-finite or negative spread, a range that is
not two whole lengths lo <= hi) is refused in one line naming the key.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
from scipy.special import expit

from sim.core import ConfigError, resolve_path

SENSITIVITY_SCHEMA_VERSION = 1
KIND = "sensitivity"
FAMILY = "logit_linear"
KEYS = ("schema_version", "kind", "family", "meta", "tasks", "fit")
TASK_KEYS = ("intercept", "slope", "residual_std", "lengths")


@dataclass(frozen=True)
class SensitivityModel:
    """One task's model of s by length."""

    task: str
    intercept: float
    slope: float
    residual_std: float
    lengths: tuple[int, int]  # the measured range; lengths outside it are clamped into it

    def logit_mean(self, lengths) -> np.ndarray:
        clamped = np.clip(np.asarray(lengths, dtype=np.float64), *self.lengths)
        return self.intercept + self.slope * np.log(clamped)

    def draw(self, lengths, rng: np.random.Generator) -> np.ndarray:
        """One s per length, in (0, 1); one standard normal per length from ``rng``."""
        mean = self.logit_mean(lengths)
        return expit(mean + self.residual_std * rng.standard_normal(mean.size))


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
    return SensitivityModel(task, float(entry["intercept"]), float(entry["slope"]), float(entry["residual_std"]),
                            (int(entry["lengths"][0]), int(entry["lengths"][1])))


def read_profile(path: str, key: str) -> dict:
    """The parsed profile, once it passes every check of ``profile_problem``."""
    file = resolve_path(path)
    if not file.is_file():
        raise ConfigError(f"{key}={path!r}: no such file (profiles are written by python -m calibrate.sensitivity)")
    try:
        profile = json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}={path!r}: not valid JSON ({exc})") from None
    except (OSError, RecursionError) as exc:
        raise ConfigError(f"{key}={path!r}: cannot be read ({type(exc).__name__})") from None
    problem = profile_problem(profile)
    if problem:
        raise ConfigError(f"{key}={path!r}: {problem}")
    return profile


def profile_problem(profile) -> str | None:
    """What is wrong with a parsed profile, as ``<key>=<value>: <what is allowed>``; None when it is usable."""
    if not isinstance(profile, dict):
        return f"the top level is a {type(profile).__name__}; a sensitivity profile is a JSON object"
    version = profile.get("schema_version")
    if version != SENSITIVITY_SCHEMA_VERSION or isinstance(version, bool):
        return f"schema_version={version!r}: this simulator reads {SENSITIVITY_SCHEMA_VERSION}"
    if profile.get("kind") != KIND:
        return f"kind={profile.get('kind')!r}: allowed: {KIND!r} (a cost or memory profile is not a sensitivity one)"
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
        for name in ("intercept", "slope", "residual_std"):
            value = entry[name]
            if not _is_finite(value):
                return f"{where}.{name}={value!r}: must be a finite number"
        if entry["residual_std"] < 0:
            return f"{where}.residual_std={entry['residual_std']!r}: must be >= 0 (a spread)"
        problem = _range_problem(entry["lengths"], f"{where}.lengths")
        if problem:
            return problem
    return None


def _range_problem(lengths, where: str) -> str | None:
    if (not isinstance(lengths, list) or len(lengths) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
            or lengths[0] > lengths[1]):
        return f"{where}={lengths!r}: must be [shortest, longest] measured length, whole numbers 1 <= lo <= hi"
    return None


def _is_finite(value) -> bool:
    """A JSON number that is finite as a float (an integer too large for one is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
