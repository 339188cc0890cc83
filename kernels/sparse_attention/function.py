"""The autograd Function over the Triton forward and backward."""
from __future__ import annotations

import torch

from .backward import sparse_attn_bwd
from .forward import sparse_attn_fwd
from .options import DEFAULT_OPTIONS


class SparseAttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, selection, sm_scale, options)``: o; gradients for q, k, v (not the selection)."""

    @staticmethod
    def forward(ctx, q, k, v, sel, sm_scale, options=DEFAULT_OPTIONS):
        # kernels take any token/head strides but need a unit stride along D
        q, k, v = [x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v)]
        o, lse = sparse_attn_fwd(q, k, v, sel, sm_scale, options)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.sel = sel
        ctx.sm_scale = sm_scale
        ctx.options = options
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = sparse_attn_bwd(do, q, k, v, o, lse, ctx.sel, ctx.sm_scale, ctx.options)
        return dq, dk, dv, None, None, None
