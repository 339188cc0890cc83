"""Colours and axis styles every figure shares, so that one sweep's figures agree."""
from __future__ import annotations

import numpy as np
from matplotlib import colormaps
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

# Okabe-Ito (colour-blind safe), yellow left out: it vanishes on white.
OKABE_ITO = ("#000000", "#D55E00", "#0072B2", "#009E73", "#CC79A7", "#E69F00", "#56B4E9")
FORWARD, BACKWARD, IDLE, COMM = "#56B4E9", "#0072B2", "#D9D9D9", "#E69F00"


def policy_colours(policies) -> dict[str, str]:
    """A colour per policy in order of first appearance, so every figure of one sweep agrees."""
    names = list(dict.fromkeys(policies))
    if "baseline" in names:  # the reference is always black
        names.remove("baseline")
        names.insert(0, "baseline")
    return {name: OKABE_ITO[i % len(OKABE_ITO)] for i, name in enumerate(names)}


def plain_log(ax, x: bool = True) -> None:
    """Log axes labelled 0.1, 0.2, 0.5, 1, ... instead of crowded 2x10^-1 minor labels."""
    if x:
        ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis) if x else (ax.yaxis,):
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def viridis(n: int) -> list:
    """``n`` colours of an ordered quantity (e.g. kept fractions), the brightest yellow left out."""
    return [colormaps["viridis"](x) for x in np.linspace(0.0, 0.9, max(n, 1))]
