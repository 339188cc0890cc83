"""The linear fit behind every calibrated term: non-negative, outlier-robust least squares on relative error.

``fit_term`` fits ``time = sum(coef[f] * feature[f])`` of one term (our kernel's, the layer's, a dense
backend's) with the rows divided by the measured time, so a 20 ms point does not drown the 0.05 ms ones, and
columns that the others rebuild exactly merged into them (``merged_columns``), so that the coefficients are
unique, not just the predictions. ``ape`` and ``summarise`` give the absolute % errors a profile records.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares, nnls

ROBUST_SCALE = 0.05  # relative residuals beyond ~5% count linearly, not squared
# A feature column that a non-negative combination of the other columns rebuilds to within this share of
# its norm (columns scaled to unit norm) adds no prediction the others cannot make: it is merged into them.
COLLINEAR = 1e-6


@dataclass(frozen=True)
class TermFit:
    """One term's coefficients and how its fit was conditioned.

    ``merged`` maps a feature held at zero to the weights that rebuild its column from the fitted ones
    (``x[f] = sum(w * x[g])`` on every fit point); ``condition`` is the condition number of the scaled
    design matrix that was solved.
    """

    coefs: dict[str, float]
    merged: dict[str, dict[str, float]]
    condition: float

    def conditioning(self) -> dict:
        return {"condition_number": float(f"{self.condition:.4g}"), "merged": self.merged}


def merged_columns(A: np.ndarray) -> dict[int, np.ndarray]:
    """Columns of A (unit-norm or zero) that are non-negative combinations of the others, with the weights.

    At the grid's lengths (multiples of the block size) ``tokens``, ``q_blocks`` and ``kv_blocks`` are each
    the block count times a per-model constant, so on a grid of two models one of them is exactly a
    combination of the other two: the coefficients along that direction are not determined by the data and
    move with the solver's rounding.
    Holding such a column at zero changes no prediction on the fit points when its weights are
    non-negative (any non-negative fit that uses it is rewritten without it). Columns are tried from the
    last to the first, so the order of the features decides which of a collinear set is kept.
    """
    keep = list(range(A.shape[1]))
    merged = {}
    for j in reversed(range(A.shape[1])):
        others = [k for k in keep if k != j]
        if not others:
            continue
        weights, miss = nnls(A[:, others], A[:, j], maxiter=50 * len(others))
        if miss <= COLLINEAR:
            keep.remove(j)
            merged[j] = np.zeros(A.shape[1])
            merged[j][others] = weights
    return merged


def fit_term(X: np.ndarray, y: np.ndarray, names: list[str]) -> TermFit:
    """Nonnegative coefficients minimising a robust loss of the relative error of X @ c against y.

    Rows are divided by the measured time (relative error) and columns scaled to unit norm, so features
    twelve orders of magnitude apart meet the solver on equal terms; columns that the others rebuild
    (``merged_columns``) are held at zero. NNLS on the squared relative error gives the start; a soft-L1
    refinement then keeps a few outlying timings (a host hiccup in a 30 us call, the first call after a
    shape change) from pulling the rest.
    """
    A = X / y[:, None]
    norm = np.linalg.norm(A, axis=0)
    norm[norm == 0] = 1.0  # an all-zero feature is merged (coefficient 0)
    A = A / norm
    merged = merged_columns(A)
    free = [j for j in range(A.shape[1]) if j not in merged]
    Af = A[:, free]
    start, _ = nnls(Af, np.ones_like(y), maxiter=50 * Af.shape[1])
    robust = least_squares(lambda c: Af @ c - 1.0, start, bounds=(0.0, np.inf), loss="soft_l1",
                           f_scale=ROBUST_SCALE, x_scale="jac").x
    # The bounded solver stays strictly inside the bounds; a feature worth under a millionth of every
    # point's time (unit-norm columns: no entry above 1) is really at its bound of zero.
    robust[robust < 1e-6] = 0.0
    coefs = np.zeros(A.shape[1])
    coefs[free] = robust / norm[free]
    return TermFit(dict(zip(names, coefs.tolist(), strict=True)), _in_feature_units(merged, norm, names),
                   float(np.linalg.cond(Af)))


def _in_feature_units(merged: dict[int, np.ndarray], norm: np.ndarray, names: list[str]) -> dict:
    """Merge weights of scaled columns as weights of the features: x_j = sum(w_i * norm_j / norm_i * x_i).
    A weight under COLLINEAR adds less than the tolerance the column was merged at and is left out."""
    return {names[j]: {names[i]: float(f"{w[i] * norm[j] / norm[i]:.6g}") for i in np.flatnonzero(w > COLLINEAR)}
            for j, w in sorted(merged.items())}


def predict(coefs: dict[str, float], feats: dict[str, float]) -> float:
    return sum(c * feats[f] for f, c in coefs.items())


def ape(pred: float, measured: float) -> float:
    return abs(pred - measured) / measured * 100.0


def summarise(errors: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        name: {"median_ape_pct": round(float(np.median(v)), 3), "max_ape_pct": round(float(np.max(v)), 3),
               "points": len(v)}
        for name, v in sorted(errors.items())
        if v
    }
