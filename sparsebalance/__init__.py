"""sparsebalance-sim under one import name: ``sparsebalance.sim``, ``.policies``, ``.kernels``, ``.calibrate``,
``.model``, ``.runner``, ``.viz`` and ``.conf``, so that installing it beside a trainer shadows nothing (Hugging
Face's ``kernels`` package among them).

An installed wheel holds those packages inside this one. A checkout keeps them as top-level folders, and this
folder holds a committed symbolic link to each (``sparsebalance/sim -> ../sim``), so that ``sparsebalance.sim``
is ``sim/`` without any install, and editors and type checkers resolve the names without running code.
"""
from sparsebalance.front_door import Partition, partition
from sparsebalance.sim.plan import Budget

__all__ = ["Budget", "Partition", "partition"]
