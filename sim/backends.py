"""Peer attention backends in the cost model: the kernels a user runs instead of our block-sparse kernel.

A profile may price, beside our kernel (its ``terms``), attention on other kernels of the same GPU
(``kernels.backends``), each in its optional ``backends`` section:

    "backends": {"fa4": {"version": "flash-attn-4 4.0.0b40", "terms": {"attn_fwd": {...}, "attn_bwd": {...}},
                         "fit": {...}},
                 "fa4_sparse": {"version": "...", "sparse": true, "terms": {...}, "fit": {...}}}

A dense peer (cuDNN, FlashAttention-4, FlashAttention-3) computes every causal block, so it needs no kept
fraction: its two terms are linear in DENSE_FEATURES (a call, tokens, tokens x heads, documents, documents x
heads, the FLOPs of the causal blocks) and it has no selection. A sparse peer (``"sparse": true``; a missing key
means dense) computes the blocks our selection keeps with its own kernels: its terms are linear in the same
features, but ``flops`` counts the kept blocks' FLOPs (our kernel's ``flops``) and ``tokens``/``head_tokens``
the tokens padded to whole blocks per document (it pads each document to a multiple of the block size), and it
pays our selection (the profile's ``select`` term). A profile without a backend's section simply has no such
backend. ``cost.attention_backend`` says which the simulator prices: ``ours`` (the default), ``dense_best``
(every micro-batch dense on its fastest dense peer) or ``hybrid`` (each micro-batch on whichever the profile
prices fastest at its budget: our kernel, a dense peer or a sparse peer at the same kept fractions).
"""
from __future__ import annotations

import math
import re

import numpy as np

DENSE_TERMS = ("attn_fwd", "attn_bwd")
# const: one call per non-empty micro-batch; tokens; head_tokens: tokens x (query + KV heads), what a kernel
# reads and writes per token; docs: documents (a call per document: its launches); doc_heads: documents x query
# heads (each document's partial last tile per head); flops: the forward FLOPs of every causal block (the block
# size of the profile), as our kernel's ``flops`` at kept 1. On the H100's measurements the head-scaled
# features carry FlashAttention-4 (its per-token and per-document costs grow with the heads) and the plain ones
# cuDNN's call per document.
DENSE_FEATURES = ("const", "tokens", "head_tokens", "docs", "doc_heads", "flops")
BACKEND_NAME = re.compile(r"[a-z][a-z0-9_]*")
OURS = "ours"  # our kernel: the profile's ``terms``, never a ``backends`` entry
SPARSE_KEY = "sparse"  # a ``backends`` entry's flag: true for a sparse peer, missing or false for a dense one


def grouped_dense(per_seq: dict, groups, pair_flops: float, heads: int, kv_heads: int,
                  cp: int = 1) -> dict[str, np.ndarray]:
    """DENSE_FEATURES of the micro-batches of ``groups`` (sim.groups.Groups) from the cost model's per-sequence
    features (``tokens``,
    ``blocks``: causal block pairs x heads; ``pair_flops``: FLOPs of one block pair and head). On CP ranks the
    tokens and FLOPs are 1/cp (zigzag sharding balances dense causal work), a rank still holds a share of every
    document, and each micro-batch is one call."""
    docs = groups.sum(np.ones(np.shape(per_seq["tokens"])[-1]))
    tokens = groups.sum(per_seq["tokens"]) / cp
    return {
        "const": np.minimum(docs, 1.0),
        "tokens": tokens,
        "head_tokens": tokens * (heads + kv_heads),
        "docs": docs,
        "doc_heads": docs * heads,
        "flops": groups.sum(per_seq["blocks"]) * pair_flops / cp,
    }


def grouped_sparse(per_seq: dict, groups, kept_flops: np.ndarray, block_size: int,
                   heads: int, kv_heads: int, cp: int = 1) -> dict[str, np.ndarray]:
    """DENSE_FEATURES of the micro-batches of ``groups`` on a sparse peer: as :func:`grouped_dense`, but each
    document's tokens padded to whole blocks (the peer pads them so) and ``flops`` the kept blocks' FLOPs,
    ``kept_flops`` per micro-batch (our kernel's ``flops`` feature: on CP ranks that of the slowest rank)."""
    padded = per_seq | {"tokens": np.ceil(np.asarray(per_seq["tokens"], dtype=np.float64) / block_size) * block_size}
    feats = grouped_dense(padded, groups, 0.0, heads, kv_heads, cp)
    return feats | {"flops": np.broadcast_to(np.asarray(kept_flops, dtype=np.float64), (groups.size,))}


def peer_options(dense: dict, sparse: dict, per_seq: dict, groups, kept_flops: np.ndarray,
                 select: np.ndarray, pair_flops: float, block_size: int, heads: int, kv_heads: int,
                 cp: int = 1) -> dict[str, tuple]:
    """(attn_fwd, attn_bwd, select) per layer of each micro-batch on each peer, by name: each dense one of ``dense``
    (name -> terms) over all its causal blocks (:func:`grouped_dense`) with no selection, each sparse one of
    ``sparse`` over the blocks our selection keeps (:func:`grouped_sparse`, ``kept_flops``) with our selection's
    time ``select``."""
    # each kind's features only where the profile prices one of that kind (this runs for every Plan priced)
    feats = {}
    if dense:
        feats["dense"] = grouped_dense(per_seq, groups, pair_flops, heads, kv_heads, cp)
    if sparse:
        feats["sparse"] = grouped_sparse(per_seq, groups, kept_flops, block_size, heads, kv_heads, cp)
    options = {}
    for name in sorted(dense | sparse):
        terms, kind, sel = (sparse[name], "sparse", select) if name in sparse else (dense[name], "dense",
                                                                                   np.zeros(groups.size))
        options[name] = (*(linear_ms(terms[t], feats[kind]) for t in DENSE_TERMS), sel)
    return options


def missing_peers(mode: str, dense: dict, sparse: dict) -> str | None:
    """What ``mode`` needs a profile to price that it does not (dense_best a dense peer, hybrid any peer), or
    None."""
    if mode == "dense_best" and not dense:
        return "dense backend"
    return "dense backend nor sparse peer" if mode == "hybrid" and not dense | sparse else None


def linear_ms(coefs: dict[str, float], feats: dict[str, np.ndarray]) -> np.ndarray:
    """``sum(coef[f] * feature[f])``: a term's time per micro-batch."""
    return sum((c * feats[f] for f, c in coefs.items()), np.zeros_like(feats["const"]))


def choose(mode: str, times: dict[str, np.ndarray], dense: tuple[str, ...] = (), margin: float = 0.0) -> np.ndarray:
    """The backend that runs each micro-batch's attention under ``mode`` (``cost.attention_backend``), by name.

    ``times`` maps ``ours`` and each peer the mode may run to its attention time per micro-batch (what it adds
    to the micro-batch: ``CostModel._attention_ms``): under ``dense_best`` the dense peers, under ``hybrid`` the
    sparse ones too; ``dense`` names the dense ones. ``ours``: ours everywhere; ``dense_best``: the fastest peer in
    ``times`` besides ours; ``hybrid``: the fastest sparse option (ours or a sparse peer) where it is priced
    faster than the fastest dense peer by at least ``margin`` (a share of the dense time), else that dense peer.
    A tie goes to the first in ``times`` (ours, then the peers by name). The simulator's cost model decides with
    it, and so do the runner (at the kept fractions its planner expects) and the attention benchmark's hybrid
    column (at the measured ones)."""
    if mode not in (OURS, "dense_best", "hybrid"):
        raise ValueError(f"attention backend mode {mode!r} is unknown; allowed: {OURS}, dense_best, hybrid")
    n_groups = np.shape(times[OURS])
    if mode == OURS:
        return np.full(n_groups, OURS)
    if mode == "dense_best":
        peers = {name: t for name, t in times.items() if name != OURS}
        if not peers:
            raise ValueError("attention backend mode dense_best: no dense backend is priced")
        return _fastest(peers, n_groups)[0]
    sparse, sparse_ms = _fastest({name: t for name, t in times.items() if name not in dense}, n_groups)
    dense_times = {name: t for name, t in times.items() if name in dense}
    if not dense_times:
        return sparse
    fastest_dense, dense_ms = _fastest(dense_times, n_groups)
    return np.where(sparse_ms <= dense_ms * (1.0 - margin), sparse, fastest_dense)


def _fastest(times: dict[str, np.ndarray], n_groups) -> tuple[np.ndarray, np.ndarray]:
    """(name, time) of the fastest in ``times`` per micro-batch (a tie: the first)."""
    names = list(times)
    stacked = np.array([np.broadcast_to(times[name], n_groups) for name in names])
    fastest = np.argmin(stacked, axis=0)
    return np.array(names)[fastest], np.take_along_axis(stacked, fastest[None], axis=0)[0]


def backends_problem(section) -> str | None:
    """What is wrong with a profile's ``backends`` section, as ``<key>=<value>: <what is allowed>``; None when it
    is usable (or absent: ``section`` None)."""
    if section is None:
        return None
    if not isinstance(section, dict):
        return f"backends={section!r}: must map backend names to their version and terms"
    for name, entry in section.items():
        if name == OURS or not BACKEND_NAME.fullmatch(name):
            return (f"backends.{name}: not a peer backend's name; allowed: lower-case names such as cudnn, fa4 "
                    f"('{OURS}' is the profile's own terms)")
        if not isinstance(entry, dict) or not isinstance(entry.get("terms"), dict):
            return f"backends.{name}={entry!r}: must be an object with 'version' and 'terms'"
        if not isinstance(entry.get("version"), str) or not entry["version"]:
            return f"backends.{name}.version={entry.get('version')!r}: must be a non-empty string"
        if not isinstance(entry.get(SPARSE_KEY, False), bool):
            return (f"backends.{name}.{SPARSE_KEY}={entry[SPARSE_KEY]!r}: must be true (a sparse peer) or false "
                    "(dense; the default where the key is missing)")
        problem = _peer_terms_problem(name, entry["terms"])
        if problem:
            return problem
    return None


def is_sparse(entry: dict) -> bool:
    """Whether a (checked) ``backends`` entry is a sparse peer's."""
    return entry.get(SPARSE_KEY, False) is True


def _peer_terms_problem(name: str, terms: dict) -> str | None:
    if set(terms) != set(DENSE_TERMS):
        return f"backends.{name}.terms={sorted(terms)!r}: a peer backend's terms are exactly {', '.join(DENSE_TERMS)}"
    for term, coefs in terms.items():
        where = f"backends.{name}.terms.{term}"
        if not isinstance(coefs, dict) or set(coefs) != set(DENSE_FEATURES):
            found = sorted(coefs) if isinstance(coefs, dict) else coefs
            return f"{where}={found!r}: must map exactly the features {', '.join(DENSE_FEATURES)} to coefficients"
        for feat, coef in coefs.items():
            if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
                return f"{where}.{feat}={coef!r}: coefficients are finite numbers >= 0 (no negative times)"
    return None
