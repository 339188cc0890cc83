"""``python -m sim.compare experiment=paper [overrides...]``: the SparseBalance comparison as one table.

Simulates the baseline (arrival order, fixed budget), lbb, sab, dst and sparsebalance on one composed
config (same workload, seed and steps for all) and prints step time, speedup over the baseline and
mean/min coverage. ``experiment=<name>`` selects a preset from ``conf/experiment/``; other arguments are
Hydra overrides (``steps=100``, ``seed=3``, ``workload.sigma=1.2``). Nothing is written to disk.
"""
from __future__ import annotations

import argparse

import pandas as pd
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from sim.config import register

from sim.core import compose_config, ConfigError, fail
from sim.run import load_policy, simulate, summary_table

POLICIES = ("baseline", "lbb", "sab", "dst", "sparsebalance")


def compare(overrides: list[str], policies: tuple[str, ...] = POLICIES) -> pd.DataFrame:
    """One row per policy; the first policy is the baseline of the speedup column."""
    cfg = compose_config(overrides)
    rows = [simulate(cfg, load_policy(name)).summary for name in policies]
    return summary_table(rows, rows[0]["step_ms"])


def hydra_overrides(args: list[str]) -> list[str]:
    """``experiment=x`` is not in the default list, so Hydra needs it appended (``+experiment=x``)."""
    return [f"+{a}" if a.startswith("experiment=") else a for a in args]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="experiment=<name> and Hydra overrides")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, baseline first")
    args = parser.parse_args()
    register()
    try:
        table = compare(hydra_overrides(args.overrides), tuple(args.policies.split(",")))
    except (ConfigError, HydraException, OmegaConfBaseException) as exc:
        fail(str(exc).splitlines()[0])
    print(" ".join(args.overrides))
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
