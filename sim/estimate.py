"""What a planner believes about sequences it has not run yet, and how it learns from those it has.

A sequence's sensitivity s (how fast its attention coverage falls as blocks are dropped) is the data's truth:
the engine prices a step with it, a planner never sees it. A planner asks an estimator for a ``Belief``: per
sequence ``SAMPLES`` equally likely values of s (stratified quantiles of a logit-normal, shuffled per sequence
with the step's generator, so that a batch's samples are independent across sequences and the same seed
gives the same plans). After a step, the estimator ``observe``s what the kernel reported per sequence: its
kept fraction kf and coverage c, from which ``s = ln c / ln kf`` (the coverage model's c = kf ** s).

Estimators (``ESTIMATORS``):

* ``prior``: the stated prior by length (``policy.prior``, sim.prior: a measured profile or a stated mean and
  spread, never the workload's generator), nothing learned and nothing per sequence;
* ``online`` (the default): per length bucket, the prior updated with every observed s (a normal update of
  logit s with the prior counted as ``prior_weight`` observations); the bucket's spread stays in the belief;
* ``oracle``: each sequence's true s, for labelled bound rows of ``sim.compare`` only. It needs the data's
  truth, which only the simulator has: the runner refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
from scipy import special, stats

from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.workload import MIN_SENSITIVITY

SAMPLES = 16  # draws of s per sequence: enough that a rank's time quantile is stable, cheap to price
ESTIMATORS = ("prior", "online", "oracle")


@dataclass(frozen=True)
class Belief:
    """Per sequence id, ``samples`` draws of its sensitivity (columns follow ``ids``)."""

    ids: np.ndarray  # [n]
    samples: np.ndarray  # [S, n] in [MIN_SENSITIVITY, 1]

    def at(self, ids) -> np.ndarray:
        """[S, len(ids)] samples of the given sequences (a KeyError names the first id the belief lacks)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        order = np.argsort(self.ids, kind="stable")
        pos = np.searchsorted(self.ids[order], ids, side="right") - 1  # the last column of an id seen twice
        columns = order[pos.clip(0, max(order.size - 1, 0))] if order.size else pos
        missing = (pos < 0) | (self.ids[columns] != ids) if order.size else np.ones(ids.size, dtype=bool)
        if missing.any():
            raise KeyError(int(ids[np.argmax(missing)]))
        return self.samples[:, columns]


@dataclass(frozen=True)
class Observation:
    """What one step reported, per sequence in plan order (and, where measured, per micro-batch)."""

    plan: Plan
    kept_fraction: np.ndarray  # [n] blocks kept / causal blocks
    coverage: np.ndarray  # [n] routing mass kept
    step_ms: float
    micro_batch_ms: np.ndarray | None = None  # [dp, m] compute ms where the runner measured it


class Estimator(Protocol):
    def belief(self, ids, lengths, step: int) -> Belief: ...

    def observe(self, observation: Observation) -> None: ...


def observed_sensitivity(kept_fraction, coverage) -> np.ndarray:
    """s = ln c / ln kf where the observation says something about s (0 < kf < 1 and 0 < c < 1: a dense
    sequence, or one whose every kept block holds all the mass, does not); NaN elsewhere."""
    kf, c = np.asarray(kept_fraction, dtype=np.float64), np.asarray(coverage, dtype=np.float64)
    informative = (kf > 0) & (kf < 1) & (c > 0) & (c < 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.log(c) / np.log(kf)
    return np.where(informative, np.clip(s, MIN_SENSITIVITY, 1.0), np.nan)


def logit_normal_samples(mean: np.ndarray, std: np.ndarray, seed: int, step: int, samples: int = SAMPLES) -> np.ndarray:
    """[samples, n] draws of s = expit(mean + std z): z at the normal's stratified quantiles, shuffled per
    sequence with the generator of (seed, step)."""
    z = stats.norm.ppf((np.arange(samples) + 0.5) / samples)
    rng = np.random.default_rng([seed, step, 7])
    shuffled = rng.permuted(np.tile(z, (np.size(mean), 1)), axis=1).T
    return np.clip(special.expit(mean + std * shuffled), MIN_SENSITIVITY, 1.0)


@dataclass
class PriorEstimator:
    """The stated prior by length: ``population(lengths) -> (logit mean, logit std)`` (sim.prior)."""

    population: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    seed: int = 0

    def moments(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.population(lengths)

    def belief(self, ids, lengths, step: int) -> Belief:
        mean, std = self.moments(np.asarray(lengths))
        return Belief(np.asarray(ids, dtype=np.int64), logit_normal_samples(mean, std, self.seed, step))

    def observe(self, observation: Observation) -> None:
        """The prior learns nothing."""


@dataclass
class OnlineEstimator(PriorEstimator):
    """The stated prior's logit mean and variance moved first by every observation (of logit s less the prior's
    mean at its length), so that a wrong prior is corrected at lengths not yet seen, then per length bucket
    (log2 of the length in steps of 1 / ``buckets_per_octave``) by that bucket's observed logit s; at each level
    the prior weighs as ``prior_weight`` observations."""

    buckets_per_octave: int = 2
    prior_weight: float = 4.0
    stats: dict[int, tuple[int, float, float]] = field(default_factory=dict)  # bucket -> (n, sum, sum of squares)
    residuals: tuple[int, float, float] = (0, 0.0, 0.0)  # over every observation: (n, sum, sum of squares)

    def bucket(self, lengths: np.ndarray) -> np.ndarray:
        return np.floor(np.log2(np.maximum(lengths, 1)) * self.buckets_per_octave).astype(np.int64)

    def moments(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        prior_mean, std = self.population(lengths)
        # first the prior moved by every residual so far, then each bucket by its own observations
        shift, var = self.updated(np.zeros(np.size(prior_mean)), np.square(std, dtype=np.float64), *self.residuals)
        mean = np.asarray(prior_mean, dtype=np.float64) + shift
        buckets, inverse = np.unique(self.bucket(lengths), return_inverse=True)
        known = np.array([self.stats.get(b, (0, 0.0, 0.0)) for b in buckets.tolist()], dtype=np.float64)
        n, total, squares = known.reshape(-1, 3)[inverse.reshape(-1)].T
        mean, var = self.updated(mean, var, n, total, squares)
        return mean, np.sqrt(np.maximum(var, 0.0))

    def updated(self, mean: np.ndarray, var: np.ndarray, n, total, squares) -> tuple[np.ndarray, np.ndarray]:
        """The prior (mean, var) updated where n > 0 with n observations of sum ``total`` and sum of squares
        ``squares`` (scalars or arrays like ``mean``): the posterior mean and the pooled second moment about it
        (the prior's spread, the data's, and the distance between the two means)."""
        w = self.prior_weight
        with np.errstate(invalid="ignore", divide="ignore"):  # where nothing was seen, nothing is updated
            post_mean = (w * mean + total) / (w + n)
            post_var = (w * (var + (mean - post_mean) ** 2)
                        + squares - 2 * post_mean * total + n * post_mean ** 2) / (w + n)
        seen = np.asarray(n) > 0
        return np.where(seen, post_mean, mean), np.where(seen, post_var, var)

    def observe(self, observation: Observation) -> None:
        s = observed_sensitivity(observation.kept_fraction, observation.coverage)
        seen = ~np.isnan(s)
        logits = special.logit(s[seen])
        lengths = observation.plan.lengths[seen]
        buckets, inverse = np.unique(self.bucket(lengths), return_inverse=True)
        old = [self.stats.get(b, (0, 0.0, 0.0)) for b in buckets.tolist()]
        # added one observation at a time, in plan order, as a running sum does
        total = np.array([o[1] for o in old], dtype=np.float64)
        squares = np.array([o[2] for o in old], dtype=np.float64)
        np.add.at(total, inverse, logits)
        np.add.at(squares, inverse, logits * logits)
        counts = np.bincount(inverse, minlength=buckets.size)
        for b, o, c, t, q in zip(buckets.tolist(), old, counts.tolist(), total.tolist(), squares.tolist(), strict=True):
            self.stats[b] = (o[0] + c, t, q)
        r = logits - np.asarray(self.population(lengths)[0], dtype=np.float64)
        n, r_total, r_squares = self.residuals
        self.residuals = (n + r.size, r_total + float(r.sum()), r_squares + float(np.square(r).sum()))


@dataclass
class OracleEstimator:
    """Every sequence's true s (no spread): a bound, never a plan a trainer could make."""

    truth: Callable[[int], dict[int, float]]  # step -> {sequence id: s}

    def belief(self, ids, lengths, step: int) -> Belief:
        known = self.truth(step)
        return Belief(np.asarray(ids, dtype=np.int64), np.array([[known[int(i)] for i in ids]], dtype=np.float64))

    def observe(self, observation: Observation) -> None:
        """The oracle already knows."""


def make_estimator(name: str, population, seed: int, truth: Callable[[int], dict[int, float]] | None = None):
    """An estimator by name; ``truth`` (the simulator's workload) is needed by ``oracle`` alone."""
    if name == "prior":
        return PriorEstimator(population, seed)
    if name == "online":
        return OnlineEstimator(population, seed)
    if name == "oracle":
        if truth is None:
            raise ConfigError("policy.estimator=oracle needs the data's truth, which only the simulator has; "
                              f"allowed here: {', '.join(e for e in ESTIMATORS if e != 'oracle')}")
        return OracleEstimator(truth)
    raise ConfigError(f"policy.estimator={name!r} is unknown; allowed: {', '.join(ESTIMATORS)}")
