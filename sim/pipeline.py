"""1F1B pipeline timing in closed form: the engine's schedule as a longest-path recurrence over numpy arrays.

``sim.engine`` runs the same schedule as SimPy events (per-op waits, traces); planners (DST's budget search,
the pipeline order search, the planner's step-time prediction) evaluate thousands of candidate schedules at
once with ``pipeline_ms`` / ``stage_finish_ms`` instead.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np


def one_f_one_b(stage: int, pp: int, m: int) -> list[tuple[bool, int]]:
    """(is_forward, micro_batch) in 1F1B order for one stage."""
    warmup = min(pp - stage - 1, m)
    ops = [(True, i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [(True, warmup + i), (False, i)]
    return ops + [(False, i) for i in range(m - warmup, m)]


def last_micro_batches(pp: int, m: int) -> list[int]:
    """The micro-batch whose backward each stage runs last under 1F1B."""
    return [one_f_one_b(stage, pp, m)[-1][1] for stage in range(pp)] if m else []


@lru_cache(maxsize=64)
def schedule(pp: int, m: int) -> tuple[tuple[int, bool, int], ...]:
    """(stage, is_forward, micro_batch) of every op in an order that respects the 1F1B dependencies."""
    queues = [one_f_one_b(stage, pp, m) for stage in range(pp)]
    done: set[tuple[int, bool, int]] = set()
    order = []
    while len(order) < 2 * pp * m:
        for stage, queue in enumerate(queues):
            while queue:
                is_fwd, mb = queue[0]
                dep = ((stage - 1, True, mb) if is_fwd
                       else (stage, True, mb) if stage == pp - 1 else (stage + 1, False, mb))
                if (is_fwd and stage == 0) or dep in done:
                    queue.pop(0)
                    done.add((stage, is_fwd, mb))
                    order.append((stage, is_fwd, mb))
                else:
                    break
    return tuple(order)


def stage_finish_ms(fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray, pp: int) -> np.ndarray:
    """[..., pp] finish time of each stage of a 1F1B pipeline whose every stage takes fwd/bwd[..., j] for
    micro-batch j (the engine's schedule and hand-offs: a stage waits for its input, the last stage turns a
    forward straight into its backward)."""
    if pp == 1:
        return (fwd + bwd).sum(axis=-1)[..., None]
    free = [np.zeros(fwd.shape[:-1])] * pp
    end: dict[tuple[int, bool, int], np.ndarray] = {}
    for stage, is_fwd, mb in schedule(pp, fwd.shape[-1]):
        if is_fwd:
            ready = end[(stage - 1, True, mb)] + p2p[..., mb] if stage > 0 else 0.0
        elif stage == pp - 1:
            ready = end[(stage, True, mb)]
        else:
            ready = end[(stage + 1, False, mb)] + p2p[..., mb]
        free[stage] = np.maximum(free[stage], ready) + (fwd[..., mb] if is_fwd else bwd[..., mb])
        end[(stage, is_fwd, mb)] = free[stage]
    return np.stack(np.broadcast_arrays(*free), axis=-1)


def pipeline_ms(fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray, pp: int) -> np.ndarray:
    """Finish time of the whole pipeline (its slowest stage), over the leading axes."""
    if pp == 1:
        return (fwd + bwd).sum(axis=-1)
    return stage_finish_ms(fwd, bwd, p2p, pp).max(axis=-1)
