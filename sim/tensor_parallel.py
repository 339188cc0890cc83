"""Tensor parallelism with sequence parallelism (Megatron-LM's split), as the cost model prices it.

A layer's GEMMs are split over the ``tp`` ranks of one node: the QKV and gate/up projections by output columns,
the attention output and down projections by input rows, the LM head by vocabulary rows. Each rank runs
``heads / tp`` query heads and ``kv_heads / tp`` KV heads of attention. Between those, sequence parallelism keeps
the activations cut along the tokens, so every layer runs, per direction, two all-gathers of the activations (in
front of the column-parallel GEMMs) and two reduce-scatters (behind the row-parallel ones), on the intra-node
link; a backward that recomputes its forward (activation checkpointing) runs the forward's four again. They are
exposed: Megatron overlaps them with GEMMs only under its optional userbuffer overlap, which is not modelled.

A rank's GEMM time is the undivided layer's work / (tp x efficiency) plus its launches, which every rank pays.
The efficiency is the profile's where a GPU run measured it (a profile's ``tp_efficiency``, ``{"<tp>":
value}``), otherwise the roofline's ratio over the per-rank GEMM shapes: time(tp = 1) / (tp x time(tp)), each
GEMM ``max(FLOPs / peak, bytes / HBM rate)``; it falls below 1 where narrower GEMMs stream their inputs at a
lower arithmetic intensity.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.config import ModelConfig
from sparsebalance.sim.shapes import ModelShape

BF16 = 2  # bytes per activation element
# Per layer and direction under sequence parallelism: all-gathers before the two column-parallel GEMMs, and
# reduce-scatters after the two row-parallel ones.
ALL_GATHERS = 2
REDUCE_SCATTERS = 2


def rank_model(model: ModelConfig, tp: int) -> ModelConfig | ModelShape:
    """The attention shape one TP rank runs: ``heads / tp`` query and ``kv_heads / tp`` KV heads."""
    if tp == 1:
        return model
    shape = ModelShape.from_config(model)
    return replace(shape, heads=shape.heads // tp, kv_heads=shape.kv_heads // tp)


def gemm_shapes(model: ModelConfig, tp: int) -> list[tuple[float, float, float]]:
    """(N, K, weight) of a layer's forward GEMMs on one TP rank, each ``[tokens, K] @ [K, N]``: QKV and gate/up
    split by columns, output and down projections by rows, the LM head by vocabulary rows, spread over the
    layers as the cost model's layer FLOPs spread it (weight 1 / layers)."""
    h, q, kv = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim
    return [((q + 2 * kv) / tp, h, 1.0), (h, q / tp, 1.0), (2 * model.ffn / tp, h, 1.0), (h, model.ffn / tp, 1.0),
            (model.vocab / tp, h, 1.0 / model.layers)]


def _gemms_ms(tokens: np.ndarray, model: ModelConfig, tp: int, flops_per_ms: float, bytes_per_ms: float):
    """Roofline time of a layer's forward GEMMs on one rank for ``tokens`` rows each."""
    total = np.zeros(np.shape(tokens))
    for n, k, weight in gemm_shapes(model, tp):
        flops = 2.0 * tokens * n * k
        moved = BF16 * (tokens * k + k * n + tokens * n)
        total = total + weight * np.maximum(flops / flops_per_ms, moved / bytes_per_ms)
    return total


def roofline_efficiency(tokens, model: ModelConfig, tp: int, cluster: Cluster) -> np.ndarray:
    """time(tp = 1) / (tp x time(tp)) of a layer's GEMMs over ``tokens`` rows (per CP rank), on the roofline of
    the cluster's peak FLOP rate and HBM rate."""
    tokens = np.asarray(tokens, dtype=np.float64)
    rates = (cluster.peak_tflops * 1e9, cluster.hbm_tbps * 1e9)
    return _gemms_ms(tokens, model, 1, *rates) / (tp * _gemms_ms(tokens, model, tp, *rates))


def gemm_efficiency(tokens, model: ModelConfig, layout: Layout, cluster: Cluster,
                    measured: dict[str, float] | None) -> np.ndarray:
    """The GEMMs' TP efficiency per micro-batch of ``tokens`` (per CP rank): the profile's measured figure for
    this tp where it has one, else the roofline's."""
    if measured and str(layout.tp) in measured:
        return np.full(np.shape(tokens), float(measured[str(layout.tp)]))
    return roofline_efficiency(tokens, model, layout.tp, cluster)


def split_ms(time_ms: np.ndarray, launch_ms: np.ndarray, tp: int, efficiency: np.ndarray) -> np.ndarray:
    """One rank's time of a term whose undivided time is ``time_ms``: its launches, then the rest / (tp x eff)."""
    return launch_ms + (time_ms - launch_ms) / (tp * efficiency)


def collective_ms(tokens: np.ndarray, model: ModelConfig, layout: Layout, cluster: Cluster) -> np.ndarray:
    """One all-gather (or reduce-scatter) of a micro-batch's activations, ``tokens / cp x hidden`` bf16 over the
    tp ranks of a node (ring: tp - 1 hops of latency + (tp - 1)/tp of the bytes at the intra-node bus
    bandwidth); 0 for an empty micro-batch or tp = 1."""
    tokens = np.asarray(tokens, dtype=np.float64)
    if layout.tp == 1:
        return np.zeros_like(tokens)
    nbytes = tokens / layout.cp * model.hidden * BF16
    return np.where(tokens > 0, cluster.gather_ms(nbytes, layout.tp, span=layout.tp), 0.0)


def comm_ms(tokens: np.ndarray, model: ModelConfig, layout: Layout, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) TP collectives per layer: two all-gathers and two reduce-scatters each (the backward of
    an all-gather is a reduce-scatter and the other way round)."""
    one = collective_ms(tokens, model, layout, cluster)
    per_direction = (ALL_GATHERS + REDUCE_SCATTERS) * one
    return per_direction, per_direction


def efficiency_problem(measured) -> str | None:
    """What is wrong with a profile's ``tp_efficiency`` ({"<tp>": efficiency in (0, 1]}), or None."""
    if measured is None:
        return None
    if not isinstance(measured, dict):
        return f"tp_efficiency={measured!r}: must map a TP degree (\"2\") to its measured efficiency in (0, 1]"
    for tp, value in measured.items():
        if not (isinstance(tp, str) and tp.isdigit() and int(tp) >= 2):
            return f"tp_efficiency.{tp}: the key must be a TP degree >= 2 written as a string (\"2\")"
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                or not 0 < value <= 1):
            return f"tp_efficiency.{tp}={value!r}: allowed: a number in (0, 1]"
    return None
