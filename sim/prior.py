"""The prior a planner starts from: what a user states, or what they measured, about how attention spreads.

The ``prior`` and ``online`` estimators (sim.estimate) begin from the mean and spread of logit s by length that
``policy.prior`` gives: a measured sensitivity profile (``profile``: ``python -m calibrate.sensitivity``'s file,
sim.sensitivity), or a stated mean and standard deviation of s, taken to logit s at first order
(``logit(mean)``, ``spread / (mean (1 - mean))``), with a stated trend of logit s per doubling of the length. It
is never the generator the simulator draws the data's truth from: a stated prior may be wrong, and
``benchmarks.prior_robustness`` shows what a wrong one costs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import special

from sparsebalance.sim.config import PriorConfig, validate
from sparsebalance.sim.sensitivity import SensitivityModel, load_sensitivity_profile


@dataclass(frozen=True)
class Prior:
    """``moments(lengths) -> (logit mean, logit std)`` per length, and how a table names it."""

    cfg: PriorConfig
    model: SensitivityModel | None

    def moments(self, lengths) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.asarray(lengths, dtype=np.float64)
        if self.model is not None:
            return self.model.mean(lengths), self.model.std(lengths)
        cfg = self.cfg
        mean = special.logit(cfg.mean) + cfg.trend * np.log2(np.maximum(lengths, 1.0) / cfg.pivot)
        return mean, np.full(lengths.size, cfg.spread / (cfg.mean * (1.0 - cfg.mean)))

    def describe(self) -> str:
        cfg = self.cfg
        if self.model is not None:
            return f"profile {cfg.profile} ({self.model.task})"
        trend = f", logit s {cfg.trend:+g} per doubling from {cfg.pivot}" if cfg.trend else ""
        return f"stated s {cfg.mean:g} +- {cfg.spread:g}{trend}"


def stated_prior(cfg: PriorConfig, key: str = "policy.prior") -> Prior:
    """The prior ``cfg`` states, once its values pass their checks (one ConfigError line naming ``key``)."""
    validate(cfg, f"{key}.")
    model = (load_sensitivity_profile(cfg.profile, cfg.task, key=f"{key}.profile", task_key=f"{key}.task")
             if cfg.profile is not None else None)
    return Prior(cfg, model)
