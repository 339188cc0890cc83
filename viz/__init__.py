"""Figures from Results directories, calibration data and kernel benchmarks: the top of the stack.

Nothing below (``sim``, ``policies``, ``kernels``, ``calibrate``, ``runner``) imports this package; it reads
their outputs and calls into them. Importing the package loads no plotting library: ``viz.callbacks`` is
instantiated by every ``python -m sim.run`` and imports matplotlib only when it draws.
Nor does it import torch: runner runs are compared through ``runner.compare``, which reads a run directory
with the simulator's dependencies alone (the run config's task is ``runner.task``'s, numpy only), so the figures
of simulated runs need only what the simulator needs.
"""
