"""Block-sparse causal attention over packed variable-length documents (Triton, forward and backward).

Shapes (as ``flash_attn_varlen_func``)::

    q [T, Hq, D], k/v [T, Hkv, D]   fp16 / bf16 (fp32 also accepted: CPU interpreter and tests)
    cu_seqlens int32 [n+1]          0 = cu[0] < cu[1] < ... < cu[n] = T; causal within each document
    Hq % Hkv == 0 (GQA: a KV group shares its selection); D in {16, 32, 64, 128}
    block_size in {16, 32, 64, 128} (64 and 128 are the tuned sizes; 16/32 exist for small CPU tests)

Usage::

    sel = select_blocks(q, k, cu, p=0.9)                    # or kept_fraction=0.1, or a [n] tensor each
    sel = select_blocks(q, k, cu, top_k=8, p=0.5)           # 8 blocks per query block, top-p 0.5 floor (optional)
    o = sparse_attention(q, k, v, cu, selection=sel)        # reuse a selection (calibration, tests)
    o, sel = sparse_attention(q, k, v, cu, p=p_per_seq, return_selection=True)
    sel.kept_fraction, sel.coverage                         # [n] per-sequence stats
    docs = VarlenBatch.from_cu_seqlens(cu)                  # once per micro-batch, for every layer's calls
    compile_count()                                         # Triton variants compiled so far (per step: 0)
    rule = row_rule(n, device, top_k=8, p=0.5)              # the rule rows keep blocks by, for a caller that
    rule.at(docs_index).keep(prob, rows, cols, isdiag, valid)  # scores rows itself (runner/cp.py)
    keeps_every_block(doc_nblocks, p=p)                     # a budget that keeps every causal block: no scoring

Backends: ``backend="triton"`` runs the Triton kernels (GPU; on CPU only under ``TRITON_INTERPRET=1``, slow,
for tests); ``backend="naive"`` is the pure-PyTorch reference (:mod:`.naive`), differentiable by autograd,
O(L^2) memory per document; use it for CPU training. ``"auto"`` (default) = triton on CUDA tensors, naive on
CPU tensors. Both take the same selection and agree to the tolerances in ``tests/kernels``. ``options=``
(:class:`KernelOptions`) carries per-call settings: tile overrides, NaN-poisoned outputs, a sink for the
compiled kernels, the selection path.

Modules: :mod:`.interface` (these entry points and their input checks), :mod:`.batch` (a micro-batch's
checked documents), :mod:`.compilation` (compile counts), :mod:`.selection` (block selection),
:mod:`.rules` (what a row keeps under each budget), :mod:`.layout` (per-document blocks), :mod:`.naive`
(PyTorch reference), and the Triton side,
:mod:`.forward`, :mod:`.backward`, :mod:`.select_kernels` (kernels and launchers), :mod:`.launch` (tile tables
and launch rules), :mod:`.tiles` (the program -> tile mapping), :mod:`.function` (the autograd Function),
imported only when used: ``TRITON_INTERPRET`` must be set before Triton is.
"""
from __future__ import annotations

from .batch import VarlenBatch
from .compilation import compile_count, compiled_variants
from .interface import BLOCK_SIZES, select_blocks, sparse_attention, validate_inputs
from .layout import BlockLayout, block_layout
from .naive import dense_causal_varlen, select_blocks_naive, sparse_attention_naive
from .options import KernelOptions
from .rules import RowRule, keeps_every_block, row_rule
from .selection import BlockSelection, SelectionFallbackWarning, restrict_rows, selection_from_mask

__all__ = ["BLOCK_SIZES", "sparse_attention", "select_blocks", "BlockSelection", "BlockLayout", "block_layout",
           "selection_from_mask", "restrict_rows", "sparse_attention_naive", "dense_causal_varlen",
           "select_blocks_naive",
           "validate_inputs", "KernelOptions", "SelectionFallbackWarning", "VarlenBatch", "compile_count",
           "compiled_variants", "RowRule", "row_rule", "keeps_every_block"]
