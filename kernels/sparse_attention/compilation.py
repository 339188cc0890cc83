"""How many Triton kernel variants this process has compiled: ``compile_count()`` before and after a training
step tells whether the step compiled (a compile costs seconds, and a batch-dependent one would make the step
slower than any cost model predicts).

Triton compiles a kernel once per variant: per set of constexpr values and launch options, and per
specialisation of its other arguments (an integer equal to 1, or divisible by 16; a pointer aligned to 16
bytes). The kernels never specialise their data-dependent integers (``do_not_specialize``), take their
constexprs from a few buckets, and compile every variant a batch of the same shapes can pick at their first
launch (:func:`launch.launch`), so that after one step of each selection mode nothing compiles again.
"""
from __future__ import annotations

import sys

__all__ = ["compile_count", "compiled_variants"]

_KERNEL_MODULES = ("forward", "backward", "select_kernels")


def compiled_variants() -> dict[str, int]:
    """Compiled variants per kernel of this package in this process (a variant loaded from Triton's disk
    cache counts as compiled here). All zero under the interpreter, and before any kernel was imported."""
    package = __name__.rsplit(".", 1)[0]
    if not any(f"{package}.{name}" in sys.modules for name in _KERNEL_MODULES):
        return {}  # nothing launched yet: importing the kernels here would import Triton for nothing
    from . import backward, forward, select_kernels
    from .launch import cached_variants

    kernels = {"fwd": forward._fwd_kernel, "dq": backward._bwd_dq_kernel, "dkdv": backward._bwd_dkdv_kernel,
               "delta": backward._delta_kernel, "pool": select_kernels._pool_kernel,
               "select": select_kernels._select_kernel, "reverse": select_kernels._reverse_kernel,
               "doc_stats": select_kernels._doc_stats_kernel}
    return {name: cached_variants(kernel) for name, kernel in kernels.items()}


def compile_count() -> int:
    """Kernel variants compiled in this process so far, over every kernel of this package: call it before
    and after a step; a difference is that step's compilations."""
    return sum(compiled_variants().values())
