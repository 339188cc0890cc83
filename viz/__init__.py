"""Figures from Results directories, calibration data and kernel benchmarks: the top of the stack.

Nothing below (``sim``, ``policies``, ``kernels``, ``calibrate``, ``runner``) imports this package; it reads
their outputs and calls into them. Importing the package loads no plotting library: ``viz.callbacks`` is
instantiated by every ``python -m sim.run`` and imports matplotlib only when it draws.
"""
