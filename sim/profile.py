"""Cost profiles (``calibrate/profiles/<gpu>.json``): the terms and features a profile prices, and reading and
checking one. Every problem is one line naming the key, the file and the value (docs/CONTRACTS.md)."""
from __future__ import annotations

import hashlib
import math

from sparsebalance.sim.backends import backends_problem
from sparsebalance.sim.gpu_kinds import GpuKind, gpu_kinds
from sparsebalance.sim.core import read_checked_json, resolve_path
from sparsebalance.sim.tensor_parallel import efficiency_problem

PROFILE_SCHEMA_VERSION = 2  # 2: per-term attention features (fwd_path; dkdv_path, dq_path, kv_waves)
TERMS = ("attn_fwd", "attn_bwd", "select", "layer_fwd", "layer_bwd")
# Features of every attention term (see attention_features); the forward and the backward add the launch
# structure of their kernels, which bounds small batches (short GPU calls) by their longest programs.
ATTENTION_FEATURES = ("const", "tokens", "blocks", "flops", "q_blocks", "kv_blocks")
FWD_FEATURES = ATTENTION_FEATURES + ("fwd_path",)
BWD_FEATURES = ATTENTION_FEATURES + ("dkdv_path", "dq_path", "kv_waves")
LAYER_FEATURES = ("const", "tokens", "flops")
# The features each term is priced on: the simulator hands a term only these, so they are what the fit sees
# and every key a profile term carries (a feature the fit holds at zero is written as 0, never left out).
# dK/dV programs resident at once per multiprocessor (the GPU kind's sm_count, conf/cluster): two (4 warps; a
# 64-key K/V tile and two pipeline stages of 64-row Q/dO tiles at head_dim 128 take about 96 KB of shared memory).
DKDV_PER_SM = 2
PROFILE_FEATURES = {"attn_fwd": FWD_FEATURES, "attn_bwd": BWD_FEATURES, "select": ATTENTION_FEATURES,
                    "layer_fwd": LAYER_FEATURES, "layer_bwd": LAYER_FEATURES}


PROFILE_KEYS = ("schema_version", "gpu", "provisional", "meta", "block_size", "terms")


def profile_source(path: str | None) -> dict:
    """What a run's summary records of the profile it priced on: its path as configured and the sha256 of its
    bytes (both None without one: cost=roofline)."""
    if path is None:
        return {"profile": None, "profile_sha256": None}
    return {"profile": path, "profile_sha256": hashlib.sha256(resolve_path(path).read_bytes()).hexdigest()}


def load_profile(path: str, key: str = "cost.profile") -> dict:
    """Read and validate a profile; any problem is one ConfigError line naming ``key``, the file and the value."""
    return read_checked_json(path, key, "profiles live in calibrate/profiles/", profile_problem)


def profile_problem(profile) -> str | None:
    """What is wrong with a parsed profile, as ``<key>=<value>: <what is allowed>``; None when it is usable."""
    if not isinstance(profile, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(profile), "a number")
        return f"the top level is {kind}; a profile is a JSON object"
    if "schema_version" in profile and (profile["schema_version"] != PROFILE_SCHEMA_VERSION
                                        or isinstance(profile["schema_version"], bool)):
        return (f"schema_version={profile['schema_version']!r}: this simulator reads {PROFILE_SCHEMA_VERSION}; refit "
                "the profile from its raw measurements (python -m calibrate.fit --csv RAW.csv --out PROFILE.json)")
    missing = [k for k in PROFILE_KEYS if k not in profile]
    if missing:
        return f"missing key {missing[0]!r}; a profile has {', '.join(PROFILE_KEYS)}"
    return (_header_problem(profile) or _terms_problem(profile["terms"])
            or _physical_problem(profile["terms"], profile["gpu"]) or backends_problem(profile.get("backends"))
            or efficiency_problem(profile.get("tp_efficiency")))


def _header_problem(profile: dict) -> str | None:
    block = profile["block_size"]
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        return f"block_size={block!r}: must be a positive integer"
    if not isinstance(profile["gpu"], str) or not profile["gpu"]:
        return f"gpu={profile['gpu']!r}: must be a non-empty string"
    if not isinstance(profile["provisional"], bool):
        return f"provisional={profile['provisional']!r}: must be true or false"
    if not isinstance(profile["meta"], dict):
        return f"meta={profile['meta']!r}: must be a JSON object"
    return None


def _terms_problem(terms) -> str | None:
    if not isinstance(terms, dict) or set(terms) != set(TERMS):
        found = sorted(terms) if isinstance(terms, dict) else terms
        return f"terms={found!r}: terms must be exactly {', '.join(TERMS)}"
    for term, coefs in terms.items():
        required = PROFILE_FEATURES[term]
        if not isinstance(coefs, dict):
            return f"terms.{term}={coefs!r}: must map the features {', '.join(required)} to coefficients"
        for feat in coefs:
            if feat not in required:
                return f"terms.{term}.{feat}: unknown feature; allowed: {', '.join(required)}"
        for feat in required:
            if feat not in coefs:
                return f"terms.{term}.{feat} is missing; every feature needs a coefficient: {', '.join(required)}"
            coef = coefs[feat]
            if not isinstance(coef, (int, float)) or isinstance(coef, bool):
                return f"terms.{term}.{feat}={coef!r}: not a number; coefficients are finite numbers >= 0"
            if not math.isfinite(coef) or coef < 0:
                return f"terms.{term}.{feat}={coef!r}: coefficients must be finite and >= 0 (no negative times)"
    return None


def fastest_kind() -> GpuKind:
    """The GPU kind of conf/cluster with the highest sparse peak."""
    return max(gpu_kinds().values(), key=lambda kind: kind.sparse_peak_tflops)


# Physical bounds of the coefficients (ms per unit of a feature), from the GPU kinds of conf/cluster: a term that
# prices a FLOP below 1 / (the fastest kind's sparse_peak_tflops, with 2:4 sparsity the most any datasheet claims)
# executes FLOPs faster than these GPUs can. 1 GFLOP/s, about a millionth of such a peak, is slower than any of them
# (a CPU core computes more), and no launch, token, block or program of one layer's kernel takes a second: above
# those a coefficient is a typo (1e300 makes times inf).
SLOWEST_FLOPS_PER_MS = 1e6
SLOWEST_MS_PER_UNIT = 1e3
FLOP_FEATURES = ("flops", "fwd_path", "dq_path", "dkdv_path")  # FLOP counts; the other features count units
WORK_TERMS = ("attn_fwd", "attn_bwd", "layer_fwd", "layer_bwd")  # the terms whose ``flops`` they execute


def _physical_problem(terms: dict, gpu: str) -> str | None:
    """A coefficient outside the physical bounds above, or a term that takes no time at all, as one line. The
    backward's dK/dV programs are spread over the resident programs of the profile's GPU kind (the fastest kind's
    where conf/cluster names none ``gpu``)."""
    fastest = fastest_kind()
    fastest_flops_per_ms = fastest.sparse_peak_tflops * 1e9
    slots = DKDV_PER_SM * gpu_kinds().get(gpu, fastest).sm_count
    for term, coefs in terms.items():
        if not any(coefs.values()):
            return f"terms.{term}: every coefficient is 0, so it takes no time; a kernel call takes some"
        for feat, coef in coefs.items():
            slowest = 1 / SLOWEST_FLOPS_PER_MS if feat in FLOP_FEATURES else SLOWEST_MS_PER_UNIT
            if coef > slowest:
                what = ("ms per FLOP, under 1 GFLOP/s" if feat in FLOP_FEATURES
                        else "ms, a second or more per launch, token, block or program")
                return f"terms.{term}.{feat}={coef!r} {what}: slower than any GPU; allowed: <= {slowest:g}"
        # A large micro-batch's cost per FLOP; the backward's dK/dV path then grows with its FLOPs too
        # (_launch_features). The features count forward FLOPs, so a backward's rate is underestimated: lenient.
        per_flop = coefs["flops"] + (2 / slots * coefs["dkdv_path"] if term == "attn_bwd" else 0.0)
        if term in WORK_TERMS and 0 < per_flop < 1 / fastest_flops_per_ms:
            return (f"terms.{term}.flops={coefs['flops']!r}: {1 / per_flop / 1e9:,.0f} TFLOP/s, faster than any GPU "
                    f"(the fastest peak in conf/cluster is {fastest.sparse_peak_tflops:,.0f} TFLOP/s with 2:4 "
                    f"sparsity, {fastest.gpu}'s); allowed: 0, or >= {1 / fastest_flops_per_ms:.3g} ms per FLOP")
    return None
