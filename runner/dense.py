"""Which attention backend runs each micro-batch in the runner, and loading the peers (dense and sparse).

The choice is ``sim.choice.planned_backends``, the simulator's own, made at the kept fractions the planner expects
of the Plan's budgets: ``ours`` everywhere by default; ``dense_best`` the dense backend the profile prices fastest;
``hybrid`` the fastest of that, ours and the sparse peers at the budgets.
"""
from __future__ import annotations

from sparsebalance.kernels.backends import BackendAbsent, load
from sparsebalance.sim.backends import OURS
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import CostModel


def load_peers(cost: CostModel, key: str, cp: int) -> dict[str, object]:
    """The peers a run's micro-batches may run on, loaded by name: under ``dense_best`` every dense one the cost
    model prices, under ``hybrid`` every one it prices, dense or sparse (its choice may fall on any of them),
    under ``ours`` none. A sparse peer selects at the profile's block size, as ours does. One ConfigError line,
    naming ``key`` (the config key that chose the mode), where one cannot run here or the processes hold CP
    shards (the peers run whole documents)."""
    mode = cost.attention_backend
    if mode == OURS:
        return {}
    if cp > 1:
        raise ConfigError(f"{key}={mode} with layout.cp={cp}: the runner runs a peer backend on whole documents "
                          f"only; allowed: {key}={OURS} with cp > 1, or layout.cp=1 (or runner.one_process=true)")
    names = cost.dense_backends() + (cost.sparse_backends() if mode == "hybrid" else ())
    return {name: _load_peer(name, name in cost.sparse_backends(), cost.block_size, f"{key}={mode}",
                             f"{key}={OURS}, or a machine where {', '.join(names)} load (the peers extra on a GPU)")
            for name in names}


def _load_peer(name: str, sparse: bool, block_size: int, setting: str, allowed: str):
    """Peer ``name`` loaded, as the cost profile prices it (``sparse`` or dense); a sparse one selects at
    ``block_size``. One ConfigError line, starting with ``setting``, where it cannot run here or is not what the
    profile says it is."""
    kind = "sparse peer" if sparse else "dense backend"
    try:
        backend = load(name, block_size)
    except (BackendAbsent, ValueError) as exc:
        raise ConfigError(f"{setting}: the cost profile prices the {kind} {name}, which cannot run here ({exc}); "
                          f"allowed: {allowed}") from None
    if backend.sparse != sparse:
        raise ConfigError(f"{setting}: the cost profile prices {name} as a {kind}, but kernels.backends' {name} is "
                          f"{'sparse' if backend.sparse else 'dense'}; allowed: a profile whose backends entry for "
                          f"{name} says \"sparse\": {str(backend.sparse).lower()}")
    return backend
