"""The advisor's search space as data: every value of every swept sim.run key, crossed, less what cannot run.

A candidate is a policy of ``conf/policy/`` and a tuple of ``(key, value)`` sim.run overrides. ``space.settings``
maps sim.run keys (``layout.pp``, ``layout.micro_batches``, ``cost.attention_backend``; a new layout key is one
more entry) to their values; the keys in ``space.degrees`` are parallel degrees whose product with dp is the GPU
count (dp takes what they leave). ``space.sparsity`` maps a sparsity policy's registry name to values of its
parameters, swept only in the policies whose config sets that parameter. ``cost.attention_backend`` is swept only
for policies that name no backend of their own (theirs would win). What is left out is counted by reason: a
config sim.run refuses (sim.setup.prepare, the policies' parameters), a micro-batch no sequence could fill, and
the memory model's verdict on the longest sequence the workload holds, alone in a micro-batch.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from sparsebalance.sim.cluster import Cluster
from sparsebalance.sim.config import RunConfig, policy_cost
from sparsebalance.sim.core import ConfigError, group_options
from sparsebalance.sim.memory import MemoryLimitError
from sparsebalance.sim.setup import Setup, load_policy, make_planner, prepare
from sparsebalance.sim.workload import Request, read_trace

BACKEND_KEY = "cost.attention_backend"


@dataclass(frozen=True)
class Candidate:
    policy: str
    settings: tuple[tuple[str, object], ...]  # sim.run keys and values, in the space's order

    def overrides(self) -> list[str]:
        """The candidate's sim.run overrides (beside the base config's)."""
        return [f"policy={self.policy}", *(f"{key}={_text(value)}" for key, value in self.settings)]

    def value(self, key: str, default=None):
        return dict(self.settings).get(key, default)

    def label(self) -> str:
        """Short row name: the policy, its swept parameters, the layout degrees, then the other settings."""
        params = [f"{k.rsplit('.', 1)[-1]}={_text(v)}" for k, v in self.settings if k.startswith("policy.")]
        layout = "".join(f"{'m' if k.endswith('micro_batches') else k.rsplit('.', 1)[-1]}{_text(v)}"
                         if not k.endswith("micro_batches") else f" m{_text(v)}"
                         for k, v in self.settings if k.startswith("layout."))
        layout = layout.replace("cp", "xcp").replace("pp", "xpp")
        rest = [_text(v) for k, v in self.settings if not k.startswith(("policy.", "layout."))]
        return " ".join([self.policy, *params, layout, *rest]).replace("  ", " ").strip()


def _text(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@dataclass
class Space:
    candidates: list[Candidate]
    pruned: Counter  # reason -> candidates left out for it
    examples: dict  # reason -> one candidate left out for it (its label)


def enumerate_space(space: DictConfig, base: DictConfig) -> Space:
    """Every candidate of ``space`` on the composed ``base`` config, those that cannot run counted out. A
    policy's own check (its parameters, its backend) runs once per policy variant on the base layout, a
    setting's (layout, backend, memory) once per setting under the base policy."""
    typed = OmegaConf.to_object(base)
    gpus = Cluster.gpus(typed.cluster)
    policies = list(space.policy) if space.policy is not None else group_options("policy")
    unknown = [p for p in policies if p not in group_options("policy")]
    if unknown:
        raise ConfigError(f"space.policy: {unknown[0]!r} is not a policy; "
                          f"allowed: {', '.join(group_options('policy'))}")
    longest = longest_length(typed)
    out, reasons = Space([], Counter(), {}), {}
    for policy in policies:
        for candidate in policy_candidates(policy, space, gpus):
            own = tuple((k, v) for k, v in candidate.settings if k.startswith("policy."))
            rest = tuple((k, v) for k, v in candidate.settings if not k.startswith("policy."))
            if (policy, own) not in reasons:
                reasons[policy, own] = feasibility(Candidate(policy, own), base, None)
            if rest not in reasons:
                reasons[rest] = feasibility(Candidate(typed.policy.name, rest), base, longest)
            reason = reasons[policy, own] or reasons[rest]
            if reason is None:
                out.candidates.append(candidate)
            else:
                out.pruned[reason] += 1
                out.examples.setdefault(reason, candidate.label())
    return out


def policy_candidates(policy: str, space: DictConfig, gpus: int) -> list[Candidate]:
    """One policy's corner of the grid: its swept parameters, the settings, dp from the degrees."""
    config = load_policy(policy)
    swept = {f"policy.sparsity.params.{key}": list(values)
             for key, values in (space.sparsity.get(config.sparsity.name) or {}).items()
             if config.sparsity.params.get(key) is not None}
    settings = {key: list(values) for key, values in flat(space.settings).items()
                if not (key == BACKEND_KEY and config.attention_backend is not None)}
    grid = {**swept, **settings}
    degrees = [f"layout.{d}" for d in space.degrees]
    out = []
    for values in itertools.product(*grid.values()):
        chosen = dict(zip(grid, values, strict=True))
        used = math.prod(int(chosen.get(d, 1)) for d in degrees)
        dp = gpus // used if gpus % used == 0 else 0  # 0: the degrees do not divide the GPUs (refused below)
        out.append(Candidate(policy, (("layout.dp", dp), *chosen.items())))
    return out


def flat(node: DictConfig, prefix: str = "") -> dict[str, list]:
    """A nested mapping of lists as ``{dotted key: values}``."""
    out = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        out.update(flat(value, f"{name}.") if isinstance(value, DictConfig) else {name: list(value)})
    return out


def longest_length(cfg: RunConfig) -> int:
    """The longest sequence the workload can hand a step: the trace's longest, else workload.max_len within the
    model's context."""
    if cfg.workload.trace_path:
        return int(np.max(read_trace(cfg.workload.trace_path)))
    return int(min(cfg.workload.max_len, cfg.model.max_context))


def configured(base: DictConfig, candidate: Candidate, **top) -> RunConfig:
    """The typed run config of a candidate on ``base`` (``top``: seed, steps), with the policy's backend."""
    cfg = base.copy()
    with open_dict(cfg):
        cfg.policy = load_policy(candidate.policy)
        for key, value in [*candidate.settings, *top.items()]:
            OmegaConf.update(cfg, key, value, merge=True)
    typed = OmegaConf.to_object(cfg)
    return replace(typed, cost=policy_cost(typed.cost, typed.policy))


EMPTY_MICRO_BATCHES = "more micro-batches than a DP rank's sequences (workload.global_batch / dp)"


def feasibility(candidate: Candidate, base: DictConfig, longest: int | None) -> str | None:
    """Why the candidate cannot run (one reason, general enough to count), or None. With ``longest`` the
    candidate's settings are judged too: its micro-batches must all be fillable and the longest sequence must
    fit alone in one; without, only what sim.run refuses (a policy's own check, on the base layout)."""
    if candidate.value("layout.dp") == 0:
        return "the parallel degrees do not divide the GPU count"
    try:
        cfg = configured(base, candidate)
        setup = prepare(cfg)
        make_planner(cfg, setup)
    except (ConfigError, OmegaConfBaseException) as exc:
        if "micro-batches would be empty" in str(exc):  # the layout's fault, judged below with the candidate's
            return None if longest is None else EMPTY_MICRO_BATCHES
        return refusal(str(exc).splitlines()[0])
    if longest is None:
        return None
    if setup.layout.dp * setup.layout.micro_batches > cfg.workload.global_batch:
        return EMPTY_MICRO_BATCHES
    return memory_refusal(setup, longest)


def memory_refusal(setup: Setup, longest: int) -> str | None:
    """The memory model's verdict on the longest sequence alone in a micro-batch, before anything is planned."""
    try:
        setup.memory.check_batch([Request(0, longest)])
    except MemoryLimitError:
        return f"memory: a {longest}-token sequence alone in a micro-batch does not fit a stage"
    return None


def refusal(message: str) -> str:
    """A config error as a countable reason: the value's own number left out where it names one."""
    for marker in (" does not split", " prices no dense backend", " is smaller than the DP degree"):
        if marker in message:
            return message.split("=", 1)[0] + "=..." + marker + message.split(marker, 1)[1].split(";")[0]
    return message
