"""``python -m sim.provisional [--out PATH] [--replace-measured]``: write the roofline model as a provisional
profile, until the calibration harness (calibrate.run) measures one."""
from __future__ import annotations

import json
import shlex
import sys
from datetime import date
from pathlib import Path

from sparsebalance.sim.cluster import Cluster
from sparsebalance.sim.gpu_kinds import default_kind
from sparsebalance.sim.config import CostConfig, ModelConfig
from sparsebalance.sim.core import (ArgumentParser, ConfigError, check_writable, one_line_errors, resolve_path,
                                    write_json_atomic)
from sparsebalance.sim.cost import BF16
from sparsebalance.sim.profile import PROFILE_FEATURES, PROFILE_SCHEMA_VERSION


def provisional_profile(model: ModelConfig, cluster: Cluster, cfg: CostConfig, command: str) -> dict:
    """The roofline model written as profile coefficients, until the calibration harness measures them."""
    attn = cluster.peak_tflops * 1e9 * cfg.attn_efficiency
    mm = cluster.peak_tflops * 1e9 * cfg.matmul_efficiency
    hbm = cluster.hbm_tbps * 1e9
    launch = cfg.launch_ms
    return {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "gpu": default_kind().gpu,  # the default cluster's, whose figures these are
        "provisional": True,
        "meta": {
            "command": command,
            "date": date.today().isoformat(),
            "source": "roofline (sim.cost.RooflineCost) with the default cluster, model and cost configs",
            "model": model.name,
            "torch": None,
            "triton": None,
            "driver": None,
            "grid": {},
        },
        "block_size": cfg.block_size,
        "terms": _every_feature({
            "attn_fwd": {"const": launch, "flops": 1.0 / attn},
            "attn_bwd": {"const": launch, "flops": cfg.attn_bwd_ratio / attn},
            "select": {
                "const": launch,
                "blocks": 2.0 * model.head_dim / attn,
                "tokens": (model.heads + model.kv_heads) * model.head_dim * BF16 / hbm,
            },
            # The roofline's weight-streaming floor is not linear; at micro-batch sizes the FLOPs dominate.
            "layer_fwd": {"const": launch, "flops": 1.0 / mm},
            "layer_bwd": {"const": launch, "flops": 2.0 / mm},
        }),
        "comm": {"allreduce_busbw_gbps": None, "p2p_gbps": None},
        "fit": {"heldout_mape": {}},
    }


def _every_feature(terms: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Terms with a coefficient for every feature of their set: the ones a model does not price are 0."""
    return {term: {f: 0.0 for f in PROFILE_FEATURES[term]} | coefs for term, coefs in terms.items()}


PROVISIONAL_OUT = f"calibrate/profiles/{default_kind().gpu}_provisional.json"


def _measured_profile_at(path: Path) -> bool:
    """Whether ``path`` holds anything but a provisional profile (a measurement, or a file of unknown kind)."""
    if not path.exists():
        return False
    try:
        existing = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return True
    return not (isinstance(existing, dict) and existing.get("provisional") is True)


def _write_provisional(out: str, replace_measured: bool) -> None:
    from sparsebalance.sim.config import compose_config

    target = check_writable(resolve_path(out), "--out")
    if not replace_measured and _measured_profile_at(target):
        raise ConfigError(f"--out={out}: holds a measured (not provisional) profile; pass --replace-measured "
                          "to overwrite it with the roofline-derived one")
    cfg = compose_config(["cost=roofline"])
    command = shlex.join(["python", "-m", "sim.provisional", "--out", out]
                         + ["--replace-measured"] * replace_measured)
    profile = provisional_profile(cfg.model, Cluster.from_config(cfg.cluster), cfg.cost, command)
    write_json_atomic(target, profile)
    print(f"wrote provisional profile {out}")


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m sim.provisional", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=PROVISIONAL_OUT, help=f"where to write it (default {PROVISIONAL_OUT})")
    parser.add_argument("--replace-measured", action="store_true",
                        help="allow --out to name a measured profile, which is then overwritten")
    args = parser.parse_args(argv)
    _write_provisional(args.out, args.replace_measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
