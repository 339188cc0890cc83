"""Attention backends: our block-sparse kernel and the peers a user runs instead, behind one Protocol.

Every backend computes causal attention within each document of a packed micro-batch (``q [T, Hq, D]``,
``k``/``v`` ``[T, Hkv, D]``, GQA where Hq > Hkv), differentiable for q, k and v::

    backend = load("fa4")                      # BackendAbsent (one line) where its package or GPU is missing
    docs = backend.documents(lengths, device)  # once per micro-batch, as the runner hands documents over
    o = backend.attention(q, k, v, docs)       # dense causal; a sparse one also takes kept_fraction=
    sel = backend.select(q, k, docs, p=0.9)    # a sparse backend (ours, fa4_sparse): our selection, any budget
    o = backend.attention(q, k, v, docs, selection=sel)

Registered: ``ours`` (:mod:`kernels.sparse_attention`), ``cudnn`` (torch SDPA on cuDNN, one
call per document), ``fa4`` (FlashAttention-4, ``flash_attn.cute``, dense varlen), ``fa3`` (FlashAttention-3,
``flash_attn_interface``), ``fa4_sparse`` (FlashAttention-4's block-sparse form, through FlexAttention's FLASH
backend, on our selection). The peers come with the ``peers`` extra (GPU machines only) and are imported only
by :func:`load`, so a machine without them imports this package as any other; nothing here imports torch
before a backend is loaded (calibrate.run's dry run lists the backends on machines without it).
"""
from .base import (BACKENDS, AttentionBackend, BackendAbsent, cu_seqlens, has_host_work, is_sparse_backend, load,
                   load_all, register, require_cuda)
from . import ours, cudnn, flash, flash_sparse  # noqa: E402,F401,I001  (registers the backends, ours first)

__all__ = ["BACKENDS", "AttentionBackend", "BackendAbsent", "cu_seqlens", "has_host_work", "is_sparse_backend",
           "load", "load_all", "register", "require_cuda"]
