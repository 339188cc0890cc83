"""Public entry points with their input checks: :func:`sparse_attention` and :func:`select_blocks`."""
from __future__ import annotations

import math
import numbers

import torch

from .batch import VarlenBatch, check_cu_type
from .naive import sparse_attention_naive
from .options import DEFAULT_OPTIONS, KernelOptions
from .selection import BlockSelection, select_blocks as _select_blocks

__all__ = ["BLOCK_SIZES", "sparse_attention", "select_blocks", "validate_inputs"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SIZES = (16, 32, 64, 128)
BLOCK_SIZES = _SIZES  # the block sizes the kernels take (head dims too)


def _check_tensor(name, x, rank=3):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name} dtype must be float16/bfloat16/float32, got {x.dtype}")


def _check_budget(name, value):
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() is False or value.dim() > 1:
            raise ValueError(f"{name} must be a float or a 1-D float tensor, got {value.dtype} {tuple(value.shape)}")
        vals = value.detach().float().cpu()
        bad = (vals <= 0) | (vals > 1) | torch.isnan(vals)
        if bool(bad.any()):
            raise ValueError(f"{name} must be in (0, 1], got {vals[bad][0].item()!r}")
    else:
        v = float(value)
        if not (0.0 < v <= 1.0):
            raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def _check_top_k(value):
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or value.dim() > 1:
            raise ValueError(f"top_k must be an int or a 1-D integer tensor, got {value.dtype} {tuple(value.shape)}")
        vals = value.detach().cpu()
        if bool((vals < 1).any()):
            raise ValueError(f"top_k must be a whole number of blocks >= 1, got {vals[vals < 1][0].item()!r}")
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"top_k must be a whole number of blocks >= 1, got {value!r}")


def validate_inputs(q, k, v, cu_seqlens, p=None, kept_fraction=None, block_size=64, check_cu_values=True,
                    top_k=None):
    """Raise a one-line ValueError naming the first bad input; return the documents as a
    :class:`VarlenBatch`. ``cu_seqlens`` may be one already (checked when it was built: no offsets are read
    here). ``check_cu_values=False`` skips the device->host copy of a ``cu_seqlens`` tensor's values and
    the budgets' checks (when a prebuilt selection already fixes the documents) and returns None."""
    _check_tensor("q", q)
    _check_tensor("k", k)
    if v is not None:
        _check_tensor("v", v)
        if v.shape != k.shape:
            raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
        if v.dtype != q.dtype:
            raise ValueError(f"v dtype {v.dtype} must equal q dtype {q.dtype}")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} must equal q dtype {q.dtype}")
    T, Hq, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} (T, D)")
    if D not in _SIZES:
        raise ValueError(f"head dim D={D} not supported, use one of {_SIZES}")
    if k.shape[1] == 0 or Hq % k.shape[1] != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={k.shape[1]}")
    if block_size not in _SIZES:
        raise ValueError(f"block_size={block_size} not supported, use one of {_SIZES}")
    if not isinstance(cu_seqlens, VarlenBatch):
        check_cu_type(cu_seqlens)
    if q.device != k.device or (v is not None and v.device != q.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device if v is not None else None}")
    if p is not None and kept_fraction is not None:
        raise ValueError("give p or kept_fraction, not both")
    if top_k is not None and kept_fraction is not None:
        raise ValueError("give top_k or kept_fraction, not both")
    if isinstance(cu_seqlens, VarlenBatch):
        docs = cu_seqlens
    elif check_cu_values:
        docs = VarlenBatch.from_cu_seqlens(cu_seqlens)
    else:
        return None
    if docs.total_tokens != T:
        raise ValueError(f"cu_seqlens must end at T={T}, got {docs.total_tokens}")
    if not check_cu_values:
        return docs
    _check_budget("p", p)
    _check_budget("kept_fraction", kept_fraction)
    _check_top_k(top_k)
    n = docs.num_docs
    for name, val in (("p", p), ("kept_fraction", kept_fraction), ("top_k", top_k)):
        if isinstance(val, torch.Tensor) and val.numel() not in (1, n):
            raise ValueError(f"{name} has {val.numel()} entries, expected one per sequence ({n})")
    return docs


def _checked(options) -> KernelOptions:
    if not isinstance(options, KernelOptions):
        raise ValueError(f"options must be a KernelOptions, got {type(options).__name__}")
    return options


def select_blocks(q, k, cu_seqlens, p=None, kept_fraction=None, top_k=None, block_size: int = 64,
                  softmax_scale=None, *, options: KernelOptions = DEFAULT_OPTIONS) -> BlockSelection:
    """Validated block selection; see :mod:`.selection`. No budget: dense. ``top_k`` (blocks per query
    block, int or ``[n]`` integer tensor) takes ``p`` as its optional coverage floor."""
    docs = validate_inputs(q, k, None, cu_seqlens, p, kept_fraction, block_size, top_k=top_k)
    return _select_blocks(q, k, docs, p=p, kept_fraction=kept_fraction, top_k=top_k, block_size=block_size,
                          softmax_scale=softmax_scale, options=_checked(options))


def sparse_attention(q, k, v, cu_seqlens, p=None, kept_fraction=None, top_k=None, block_size: int = 64,
                     selection=None, *, return_selection: bool = False, softmax_scale=None, backend: str = "auto",
                     options: KernelOptions = DEFAULT_OPTIONS):
    """Block-sparse causal varlen attention. Returns ``o [T, Hq, D]`` (and the selection if asked).

    Give a ``selection`` (from :func:`select_blocks` or :func:`selection_from_mask`) or a budget (``p``,
    ``kept_fraction``, or ``top_k`` with ``p`` as its optional floor; none means dense). Gradients flow to q,
    k, v; the selection is not differentiated. ``options`` (:class:`KernelOptions`) reach the selection and
    the Triton launchers.
    """
    options = _checked(options)
    if selection is not None and not isinstance(selection, BlockSelection):
        raise ValueError(f"selection must be a BlockSelection, got {type(selection).__name__}")
    # with a prebuilt selection the documents come from its layout: no device->host copy of cu_seqlens here
    docs = validate_inputs(q, k, v, cu_seqlens, p, kept_fraction,
                           block_size if selection is None else selection.block_size,
                           check_cu_values=selection is None, top_k=top_k)
    if selection is None:
        selection = _select_blocks(q, k, docs, p=p, kept_fraction=kept_fraction, top_k=top_k,
                                   block_size=block_size, softmax_scale=softmax_scale, options=options)
    else:
        _check_selection(selection, q, k, cu_seqlens, p, kept_fraction, top_k)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    o = _attend(q, k, v, cu_seqlens, selection, scale, backend, options)
    return (o, selection) if return_selection else o


def _check_selection(selection: BlockSelection, q, k, cu_seqlens, p, kept_fraction, top_k):
    """A prebuilt selection must fit the inputs, and comes instead of a budget."""
    if p is not None or kept_fraction is not None or top_k is not None:
        raise ValueError("give a selection or a budget (p / kept_fraction / top_k), not both")
    lay = selection.layout
    n = cu_seqlens.num_docs if isinstance(cu_seqlens, VarlenBatch) else cu_seqlens.numel() - 1
    if lay.total_tokens != q.shape[0] or lay.num_docs != n:
        raise ValueError(f"selection was built for T={lay.total_tokens}, n={lay.num_docs}; got "
                         f"T={q.shape[0]}, n={n}")
    if selection.num_kv_heads != k.shape[1]:
        raise ValueError(f"selection has {selection.num_kv_heads} KV heads, k has {k.shape[1]}")


def _attend(q, k, v, cu_seqlens, sel: BlockSelection, scale: float, backend: str, options: KernelOptions):
    if backend == "auto":
        backend = "triton" if q.is_cuda else "naive"
    if backend == "triton":
        from .function import SparseAttentionFunction

        return SparseAttentionFunction.apply(q, k, v, sel, scale, options)
    if backend == "naive":
        return sparse_attention_naive(q, k, v, cu_seqlens, sel, softmax_scale=scale)
    raise ValueError(f"backend must be 'auto', 'triton' or 'naive', got {backend!r}")
