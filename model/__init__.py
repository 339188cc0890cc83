"""The decoder that the runner trains and replays and that calibration times: a small LLaMA-style model
(RMSNorm, RoPE, GQA, SwiGLU) over packed varlen micro-batches, whole or one pipeline stage of it.

Its sizes and parameter counts are ``sim.shapes.ModelShape``'s and its pipeline split is ``sim.shapes.StageSpan``
(pure Python, which the simulator prices); this package holds the torch modules. :mod:`.layer`: one layer
(``Block``) and the positions and rotary tables its forward shares; :mod:`.decoder`: the decoder (``TinyLlama``)
and ``make_model``, the one way to build it.
"""
from __future__ import annotations

from .decoder import ForwardOut, RunLayer, TinyLlama, make_model
from .layer import AttentionFn, Block, packed_positions, rope, rope_angles

__all__ = ["AttentionFn", "Block", "ForwardOut", "RunLayer", "TinyLlama", "make_model", "packed_positions", "rope",
           "rope_angles"]
