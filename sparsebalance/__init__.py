"""sparsebalance-sim under one import name: ``sparsebalance.sim``, ``.policies``, ``.kernels``, ``.calibrate``,
``.runner``, ``.viz`` and ``.conf``, so that installing it beside a trainer shadows nothing (Hugging Face's
``kernels`` package among them).

An installed wheel holds those packages inside this one. A checkout keeps them as top-level folders; there this
package also searches the checkout's root, so that ``sparsebalance.sim`` is ``sim/`` without any install.
"""
from pathlib import Path

_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "sim" / "__init__.py").is_file():
    __path__.append(str(_checkout))

# The library's front door (after the path above, which it imports through).
from sparsebalance.front_door import Partition, partition  # noqa: E402
from sparsebalance.sim.plan import Budget  # noqa: E402

__all__ = ["Budget", "Partition", "partition"]
