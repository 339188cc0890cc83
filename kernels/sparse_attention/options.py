"""Per-call options of the Triton path, passed explicitly from ``sparse_attention(..., options=...)`` and
``select_blocks(..., options=...)`` down to the launchers (no module state: two callers in one process, e.g.
a tuning sweep and a test, never see each other's settings)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["KernelOptions", "DEFAULT_OPTIONS", "SELECTION_PATHS"]

SELECTION_PATHS = ("auto", "triton", "torch")


def _frozen(tiles: Mapping) -> Mapping:
    """A read-only copy of ``{(block, D): {kind: {key: value}}}``."""
    return MappingProxyType({tuple(shape): MappingProxyType({kind: MappingProxyType(dict(cfg))
                                                             for kind, cfg in kinds.items()})
                             for shape, kinds in tiles.items()})


@dataclass(frozen=True)
class KernelOptions:
    """How the Triton kernels run; the defaults are what training uses.

    ``tiles``: launch-config overrides ``{(block_size, head_dim): {kind: {key: value}}}`` over
    :data:`launch.DEFAULT_CONFIG` (tuning sweeps, tests); an override of ``"fwd"``, ``"dq"`` or ``"dkdv"``
    applies to that kernel's long- and short-row configs, one of ``"fwd_short"`` etc. to the short-row one.
    ``poison_outputs``: outputs start as NaN instead of uninitialised memory, so that a missed write shows
    (tests, GPU checks).
    ``compiled``: a dict that each launch records its compiled kernel in, by kind (``"fwd"``, ``"dq"``,
    ``"dkdv"``): registers, spills and PTX for diagnostics.
    ``precompile``: a kernel's first compile for a set of argument types also compiles, without launching,
    every variant that another batch of the same shapes may take (the other row class, TMA or pointer tiles,
    the other selection mode; :func:`launch.launch`), so that a training run compiles in its first step and
    never again; off (tests, tuning sweeps), only what is launched compiles.
    ``selection``: ``"auto"`` runs the fused Triton selection on CUDA tensors (falling back to the torch
    path, with a warning, where Triton cannot build it for the GPU) and the torch path elsewhere;
    ``"triton"`` forces the fused selection (also on CPU under the interpreter; no fallback); ``"torch"``
    forces the torch path.
    """

    tiles: Mapping[tuple[int, int], Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)
    poison_outputs: bool = False
    compiled: dict | None = None
    selection: str = "auto"
    precompile: bool = True

    def __post_init__(self):
        if self.selection not in SELECTION_PATHS:
            raise ValueError(f"selection={self.selection!r}: use one of {', '.join(SELECTION_PATHS)}")
        object.__setattr__(self, "tiles", _frozen(self.tiles))

    def tile_overrides(self, block: int, head_dim: int) -> Mapping[str, Mapping[str, Any]]:
        """The overrides of one (block size, head dim); empty where none are given."""
        return self.tiles.get((block, head_dim), {})


DEFAULT_OPTIONS = KernelOptions()
