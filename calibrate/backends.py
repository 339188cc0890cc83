"""The peer attention backends' terms: fitted from their points of the raw CSV into a profile's ``backends``.

A dense peer's point (``attn@<backend>`` keys, ``calibrate.grid.dense_points``) times its forward and its
backward over every causal block of a micro-batch's documents; a sparse peer's (``calibrate.grid.
sparse_points``) over the blocks our selection keeps, at the kept fractions the selection realised (the rows
record them). Each term is fitted as our kernel's are (``calibrate.linear.fit_term``) on the features the
simulator prices it on (``sim.cost.dense_features``: const, tokens, documents, causal FLOPs; for a sparse peer
``sim.cost.sparse_features``: tokens padded to whole blocks, the kept blocks' FLOPs), and its version is the one
the run recorded. Which peers are sparse is the registry's word (``kernels.backends``: a backend's ``sparse``);
their entries carry ``"sparse": true``. Every backend, ours included, is held to the same error targets on its
held-out attention forward plus backward (:func:`backend_checks`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import fields

import numpy as np

from sparsebalance.calibrate.linear import ape, fit_term, predict, summarise
from sparsebalance.kernels.backends import has_host_work, is_sparse_backend  # a name it does not know: dense, none
from sparsebalance.sim.backends import DENSE_FEATURES, DENSE_TERMS, OURS, SPARSE_KEY
from sparsebalance.sim.config import ModelConfig
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import dense_features, sparse_features

HELDOUT_MEDIAN_PCT = 3.0  # held-out attention fwd+bwd of every backend: median absolute % error
HELDOUT_MAX_PCT = 10.0  # and the largest


def recorded_versions(runs: list[dict]) -> dict[str, str]:
    """Each backend's version as the last run that timed it recorded it."""
    versions: dict[str, str] = {}
    for run in runs:
        versions.update(run.get("backends") or {})
    return versions


def recorded_clocks(runs: list[dict]) -> dict[str, str]:
    """Each backend's clock (``busy`` or ``events``; a run that did not record it: busy) as the last run that
    timed it ran."""
    return {name: run.get("timing", "busy") for run in runs for name in run.get("backends") or {}}


def unfinished_backends(runs: list[dict]) -> dict[str, int]:
    """Peers whose last run stopped with points of their grid left (its time budget spent), with how many: the
    points a run starts last are the longest, so a fit on the rest would price long documents from short ones."""
    left: dict[str, int] = {}
    for run in runs:
        for name in run.get("backends") or {}:
            left[name] = run.get("points_left") or 0
    return {name: n for name, n in left.items() if n}


def busy_timed_host_work(runs: list[dict]) -> list[str]:
    """Peers whose call does host work (the registry's ``host_work``) that a run timed on the busy clock: it sums
    their kernels and leaves out the host time the GPU waits on, so a fit of it would price them low."""
    return sorted({name for run in runs if run.get("timing", "busy") == "busy" for name in run.get("backends") or {}
                   if has_host_work(name)})


def peer_features(name: str, lengths, kept_fractions, model: ModelConfig, block_size: int) -> dict[str, float]:
    """The features the simulator prices peer ``name`` on for one micro-batch (dense or sparse)."""
    if is_sparse_backend(name):
        return sparse_features(lengths, kept_fractions, model, block_size)
    return dense_features(lengths, model, block_size)


def fit_backends(measurements: list, models: dict[str, dict], block_size: int, versions: dict[str, str],
                 clocks: dict[str, str]) -> dict:
    """The profile's ``backends`` section from the peers' measurements (none: empty), each entry with the version
    and the clock its run recorded."""
    keys = [f.name for f in fields(ModelConfig)]
    shapes = {name: ModelConfig(**{k: shape[k] for k in keys if k in shape}) for name, shape in models.items()}
    by_backend: dict[str, list] = defaultdict(list)
    for m in measurements:
        by_backend[m.backend].append(m)
    section = {}
    for name, points in sorted(by_backend.items()):
        feats = {m.key: peer_features(name, m.lengths, m.kept_fractions, shapes[m.model], block_size)
                 for m in points}
        terms, conditioning = {}, {}
        for term in DENSE_TERMS:
            rows = [m for m in points if m.term == term and m.split == "fit"]
            if not rows:
                raise ConfigError(f"backend {name}: no 'fit' measurements of {term}; allowed: raw measurements with "
                                  "them (calibrate.run times them)")
            X = np.array([[feats[m.key][f] for f in DENSE_FEATURES] for m in rows])
            fitted = fit_term(X, np.array([m.median_ms for m in rows]), list(DENSE_FEATURES))
            terms[term], conditioning[term] = fitted.coefs, fitted.conditioning()
        section[name] = {
            "version": versions.get(name) or "unknown (not recorded by calibrate.run)",
            **({SPARSE_KEY: True} if is_sparse_backend(name) else {}),
            "timing": clocks.get(name, "busy"),
            "terms": terms,
            "fit": {"heldout_mape": summarise(_errors(points, terms, feats, "heldout")),
                    "fit_mape": summarise(_errors(points, terms, feats, "fit")),
                    "conditioning": conditioning,
                    "points": {s: sum(m.split == s and m.term == DENSE_TERMS[0] for m in points)
                               for s in ("fit", "heldout")}},
        }
    return section


def with_backends(profile: dict, section: dict, runs: list[dict], fit_command: str) -> dict:
    """``profile`` with the peers of ``section`` (none: an error) added to its backends, replacing those of the
    same names and keeping the rest (a peer may be timed from another CSV, on another clock), and, in its meta,
    the commands that timed and fitted them after those of the peers it keeps; its own terms and fit unchanged."""
    if not section:
        raise ConfigError("--backends-only: the CSV holds no peer backend's measurements; allowed: a CSV that "
                          "calibrate.run timed a peer (dense or sparse) into")
    timed = [run["command"] for run in runs if set(run.get("backends") or ()) & section.keys()]
    kept = {name: entry for name, entry in (profile.get("backends") or {}).items() if name not in section}
    earlier = [profile["meta"]["backends_command"]] if kept and profile["meta"].get("backends_command") else []
    meta = profile["meta"] | {"backends_command": " && ".join([*earlier, *timed, fit_command])}
    return profile | {"meta": meta, "backends": kept | section}


def _errors(points: list, terms: dict, feats: dict, split: str) -> dict[str, list[float]]:
    """Absolute % errors per term and of forward plus backward, on one split."""
    errors: dict[str, list[float]] = defaultdict(list)
    pairs: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    for m in points:
        if m.split == split:
            pred = predict(terms[m.term], feats[m.key])
            errors[m.term].append(ape(pred, m.median_ms))
            pairs[m.key][m.term] = (pred, m.median_ms)
    for pair in pairs.values():
        if len(pair) == len(DENSE_TERMS):
            errors["attn_fwd+bwd"].append(ape(*(sum(v[i] for v in pair.values()) for i in (0, 1))))
    return errors


def backend_checks(profile: dict, recorded) -> list[tuple[str, float | None, float]]:
    """(what, recorded % error or None, limit) of every backend's held-out attention fwd+bwd: ours (the
    profile's own fit) and each peer of its ``backends``, dense or sparse. ``recorded(section, *keys)`` reads a
    number."""
    peers = profile.get("backends") or {}
    fits = {OURS: profile.get("fit")} | {name: entry.get("fit") for name, entry in peers.items()}
    return [(f"held-out attn_fwd+bwd {stat}, {name}", recorded(fit, "heldout_mape", "attn_fwd+bwd", key), limit)
            for name, fit in fits.items()
            for stat, key, limit in (("median", "median_ape_pct", HELDOUT_MEDIAN_PCT),
                                     ("max", "max_ape_pct", HELDOUT_MAX_PCT))]


def print_backends(section: dict) -> None:
    for name, entry in section.items():
        print(f"backend {name} ({entry['version']}), absolute % error (median / max / points):")
        for split in ("heldout", "fit"):
            for term, s in entry["fit"][f"{split}_mape"].items():
                print(f"  {split:>7} {term:>13}: {s['median_ape_pct']:7.2f} {s['max_ape_pct']:8.2f} {s['points']:5d}")
