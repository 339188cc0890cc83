"""``python -m sim.breakeven [overrides...]``: from which kept fraction sparse attention pays.

For one document alone in a micro-batch, at each length from 1K to 128K tokens, the kept fraction at which our
kernel's attention (selection, forward and backward, one layer of ``model=``) takes as long as each dense
backend of the profile (``cost.profile=``) takes for all of its causal blocks: below it, sparsity on our kernel
is faster than that backend; ``always``: ours is faster even dense; ``never``: slower even keeping only the
diagonal blocks. ``fastest dense`` is the break-even against the fastest dense backend at that length (the
user's real alternative), ``dense: a/b`` the time of dense backend a over dense backend b. Where the profile
prices a sparse peer (FlashAttention-4's block-sparse form on our selection), its columns follow, ``<peer> vs
<dense>`` and ``<peer>: fastest dense``, and ``best sparse: fastest dense``: below it the faster of ours and the
peers beats every dense backend (what ``cost.attention_backend=hybrid`` can pick). Prices only, from the
profile's fitted terms; nothing is written.
"""
from __future__ import annotations

import sys

import numpy as np
import pandas as pd
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sparsebalance.sim.backends import OURS
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.config import compose_config, register
from sparsebalance.sim.core import ArgumentParser, ConfigError, fail
from sparsebalance.sim.cost import CostModel, diag_fraction, make_cost

LENGTHS = tuple(1024 * 2 ** i for i in range(8))  # 1K .. 128K
ALWAYS, NEVER = 1.0, 0.0  # table cells: ours wins even dense / loses even at the diagonal alone
BISECTIONS = 50  # halvings of the kept-fraction interval: far below any printed digit


def break_even(cost: CostModel, lengths, backend: str, sparse: str = OURS) -> np.ndarray:
    """Per length, the largest kept fraction at which the sparse backend ``sparse`` (ours, or a sparse peer on
    our selection) takes no longer than ``backend`` (ALWAYS where it does keeping every block, NEVER where even
    the diagonal blocks alone take longer). It grows with the kept fraction below 1, where it also pays the
    selection, which a dense call of our kernel (kept 1) skips."""
    lengths = np.asarray(lengths, dtype=np.int64)
    layout = Layout(dp=1)

    def times(kept):
        options = cost.attention_options(lengths, kept, layout)
        return options[sparse], options[backend]

    dense_ms, target = times(np.ones(lengths.size))
    low, high = diag_fraction(lengths, cost.block_size), np.ones(lengths.size)
    at_low, _ = times(low)
    for _ in range(BISECTIONS):
        mid = (low + high) / 2.0
        ms, _ = times(mid)
        faster = ms <= target
        low, high = np.where(faster, mid, low), np.where(faster, high, mid)
    return np.where(dense_ms <= target, ALWAYS, np.where(at_low > target, NEVER, low))


def table(cost: CostModel, lengths=LENGTHS) -> pd.DataFrame:
    """One row per length: the break-even kept fraction of ours and of each sparse peer against each dense
    backend and the fastest of them, each pair of dense backends' time ratio, and (with sparse peers) the best
    sparse option's break-even against the fastest dense backend."""
    dense = cost.dense_backends()
    if not dense:
        raise ConfigError("the cost model prices no dense attention backend, so there is nothing to break even "
                          "with; allowed: a profile with a 'backends' section (cost.profile=...)")
    lengths = np.asarray(lengths, dtype=np.int64)
    frame = pd.DataFrame({"length": lengths})
    fastest = {}
    for sparse in (OURS, *cost.sparse_backends()):
        even = {name: break_even(cost, lengths, name, sparse) for name in dense}
        for name in dense:
            frame[f"{sparse} vs {name}"] = even[name]
        fastest[sparse] = np.min(np.array(list(even.values())), axis=0)
        frame["fastest dense" if sparse == OURS else f"{sparse}: fastest dense"] = fastest[sparse]
        if sparse == OURS:
            dense_ms = cost.attention_options(lengths, np.ones(lengths.size), Layout(dp=1))
            for i, a in enumerate(dense):
                for b in dense[i + 1:]:
                    frame[f"dense: {a}/{b}"] = dense_ms[a] / dense_ms[b]
    if len(fastest) > 1:
        frame["best sparse: fastest dense"] = np.max(np.array(list(fastest.values())), axis=0)
    return frame


def formatted(frame: pd.DataFrame) -> pd.DataFrame:
    out = pd.DataFrame({"length": [f"{n // 1024}K" for n in frame["length"]]})
    for col in frame.columns[1:]:
        if col.startswith("dense: "):
            out[col] = frame[col].map(lambda r: f"{r:.3f}")
        else:
            out[col] = frame[col].map(lambda kf: "always" if kf == ALWAYS else "never" if kf == NEVER else f"{kf:.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m sim.breakeven", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: cost.profile=..., model=...")
    register()
    try:
        args = parser.parse_args(argv)
        cfg = OmegaConf.to_object(compose_config(args.overrides))
        cost = make_cost(cfg.cost, cfg.model, Cluster.from_config(cfg.cluster), recompute=False)
        frame = table(cost)
    except (ConfigError, HydraException, OmegaConfBaseException) as exc:
        fail(str(exc).splitlines()[0])
    gpu = cost.profile.get("meta", {}).get("gpu_name") or cost.profile["gpu"]
    print(f"break-even kept fraction, one document, one layer of {cfg.model.name}, fwd+bwd (+ selection when "
          f"sparse), profile {cfg.cost.profile} ({gpu})")
    print(formatted(frame).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
