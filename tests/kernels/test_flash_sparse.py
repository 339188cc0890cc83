"""fa4_sparse's plumbing on the CPU: documents padded to whole blocks, our selection as a BlockMask, and the
rows taken back, against our PyTorch reference on the same selection, forward and gradients.

FlexAttention's fused kernels (FLASH among them) need a GPU, and its eager reference evaluates the mask alone
everywhere, so the attention here is a stand-in with the fused kernels' reading of a BlockMask: the kept blocks
only, full ones unmasked, the mask evaluated on the partial ones."""
from __future__ import annotations

import pytest
import torch

from sparsebalance.kernels.backends import BackendAbsent, cu_seqlens, load
from sparsebalance.kernels.backends.flash_sparse import (FlashAttention4Sparse, padded_block_sparse, padded_documents,
                                                         selection_block_mask)
from sparsebalance.kernels.sparse_attention import select_blocks, sparse_attention_naive

# odd shapes: one-token documents, a document of exactly one block, documents a token past a block, GQA and MHA
CASES = [  # (lengths, query heads, KV heads, block size)
    ([5, 40, 1, 33, 16], 4, 2, 16),
    ([1], 2, 2, 16),
    ([17, 16, 15, 64], 4, 1, 16),
    ([100, 3, 70], 2, 2, 32),
]
KEPT = (1.0, 0.5, 0.2)


def ordered_to_dense(counts: torch.Tensor, indices: torch.Tensor, columns: int) -> torch.Tensor:
    """[B, H, rows] counts and [B, H, rows, W] indices -> [B, H, rows, columns] bool."""
    dense = torch.zeros(*counts.shape, columns + 1, dtype=torch.bool)
    valid = torch.arange(indices.shape[-1]) < counts[..., None]
    dense.scatter_(-1, torch.where(valid, indices.long(), columns), True)
    return dense[..., :columns]


def fused_reading(q, k, v, block_mask, enable_gqa, **_):
    """Attention as FlexAttention's fused kernels read ``block_mask``: full blocks kept whole, partial ones
    through its mask_mod, every other block skipped; SDPA's math on [1, H, T, D]."""
    T, (bq, bk) = q.shape[2], block_mask.BLOCK_SIZE
    nb = -(-T // bk)
    full = ordered_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nb)
    partial = ordered_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices, nb)
    tokens = lambda blocks: blocks.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :T, :T]  # noqa: E731
    rows, cols = torch.arange(T)[:, None], torch.arange(T)[None, :]
    keep = tokens(full) | (tokens(partial) & block_mask.mask_mod(0, 0, rows, cols))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=enable_gqa)


def test_padded_documents_put_each_document_at_a_block_start():
    docs = padded_documents([5, 40, 1, 16], 16, "cpu")
    assert docs.padded_tokens == 16 + 48 + 16 + 16
    assert docs.positions.tolist() == [*range(5), *range(16, 56), 64, *range(80, 96)]
    assert docs.kv_end.tolist() == [5] * 16 + [56] * 48 + [65] * 16 + [96] * 16
    assert docs.batch.cu_seqlens.tolist() == [0, 5, 45, 46, 62]


@pytest.mark.parametrize("lengths,hq,hkv,block", CASES)
@pytest.mark.parametrize("kept", KEPT)
def test_the_selection_padded_matches_our_reference(lengths, hq, hkv, block, kept):
    g = torch.Generator().manual_seed(len(lengths) + hq)
    q, k, v = (torch.randn(sum(lengths), h, 16, generator=g).requires_grad_() for h in (hq, hkv, hkv))
    docs = padded_documents(lengths, block, "cpu")
    sel = select_blocks(q, k, docs.batch, kept_fraction=kept, block_size=block)
    out = padded_block_sparse(q, k, v, docs, sel, fused_reading)
    ref = sparse_attention_naive(q, k, v, cu_seqlens(lengths), selection=sel)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), grad_out), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_dropped_block_is_not_attended():
    """Kept fraction below 1 changes the output: the mask carries the selection, not only the documents."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(96, 2, 16, generator=g) for _ in range(3))
    docs = padded_documents([96], 16, "cpu")
    full = padded_block_sparse(q, k, v, docs, select_blocks(q, k, docs.batch, kept_fraction=1.0, block_size=16),
                               fused_reading)
    sparse_sel = select_blocks(q, k, docs.batch, kept_fraction=0.3, block_size=16)
    assert float(sparse_sel.kept_fraction[0]) < 1.0
    assert not torch.allclose(padded_block_sparse(q, k, v, docs, sparse_sel, fused_reading), full)


def test_the_mask_keeps_each_diagonal_block_partial_and_the_rest_full():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(48, 4, 16, generator=g), torch.randn(48, 2, 16, generator=g)
    docs = padded_documents([20, 28], 16, "cpu")
    sel = select_blocks(q, k, docs.batch, block_size=16)  # dense: every causal block
    mask = selection_block_mask(sel, 4, docs.kv_end)
    partial = ordered_to_dense(mask.kv_num_blocks, mask.kv_indices, 4)
    full = ordered_to_dense(mask.full_kv_num_blocks, mask.full_kv_indices, 4)
    assert partial.shape == (1, 4, 4, 4)
    assert (partial == torch.eye(4, dtype=torch.bool)).all()
    # document 0 is blocks 0-1, document 1 blocks 2-3: below the diagonal within each document only
    below = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]], dtype=torch.bool)
    assert (full == below).all()


@pytest.mark.parametrize("lengths,hq,hkv,block", CASES)
def test_the_masks_lists_are_flexattentions_own_for_the_same_blocks(lengths, hq, hkv, block):
    """Every list the kernels read (forward: kept blocks per query block; backward: per key block), partial and
    full, as FlexAttention's from_kv_blocks builds them from the same blocks: the same counts and, within each
    count, the same blocks in ascending order."""
    from torch.nn.attention.flex_attention import BlockMask

    g = torch.Generator().manual_seed(sum(lengths))
    q, k = torch.randn(sum(lengths), hq, 16, generator=g), torch.randn(sum(lengths), hkv, 16, generator=g)
    docs = padded_documents(lengths, block, "cpu")
    mask = selection_block_mask(select_blocks(q, k, docs.batch, kept_fraction=0.4, block_size=block), hq,
                                docs.kv_end)
    theirs = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                      mask.full_kv_indices, BLOCK_SIZE=block, seq_lengths=mask.seq_lengths)
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                            ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        ours_n, theirs_n = getattr(mask, counts), getattr(theirs, counts)
        assert torch.equal(ours_n, theirs_n), counts
        valid = torch.arange(getattr(mask, indices).shape[-1]) < ours_n[..., None]
        ours_i, theirs_i = getattr(mask, indices), getattr(theirs, indices)
        assert torch.equal(torch.where(valid, ours_i, -1), torch.where(valid, theirs_i, -1)), indices
        assert (torch.where(valid, ours_i, 1 << 30).diff(dim=-1)[valid[..., 1:]] > 0).all()  # ascending


def test_the_backend_is_sparse_and_absent_here_in_one_line():
    assert FlashAttention4Sparse.sparse
    if torch.cuda.is_available():
        pytest.skip("a GPU machine may have FlashAttention-4")
    with pytest.raises(BackendAbsent, match=r"^fa4_sparse: absent \((ModuleNotFoundError|RuntimeError)"):
        load("fa4_sparse")


def test_the_backend_selects_then_attends_with_its_flex():
    """select() is our selection at the backend's block size; attention() with a budget selects the same."""
    backend = FlashAttention4Sparse(block_size=16)
    backend.flex = fused_reading  # what check() compiles
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(50, 2, 16, generator=g) for _ in range(3))
    docs = backend.documents([30, 20], "cpu")
    sel = backend.select(q, k, docs, kept_fraction=0.5)
    assert sel.block_size == 16
    ref = sparse_attention_naive(q, k, v, cu_seqlens([30, 20]), selection=sel)
    torch.testing.assert_close(backend.attention(q, k, v, docs, selection=sel), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(backend.attention(q, k, v, docs, kept_fraction=0.5), ref, rtol=1e-5, atol=1e-5)


GPU_CASES = [  # (lengths, query heads, KV heads): padded lengths differ per case (FlexAttention compiles again)
    ([300, 1000, 5, 2048], 16, 16),
    ([129, 128, 4000], 32, 4),
    ([1, 700], 8, 2),
]


@pytest.mark.parametrize("lengths,hq,hkv", GPU_CASES)
@pytest.mark.parametrize("kept", (1.0, 0.3))
def test_fa4_sparse_on_the_gpu_matches_our_kernel(lengths, hq, hkv, kept):
    """FlashAttention-4's kernels against ours on the same selection, bf16, forward and gradients (where
    FlashAttention-4 and a GPU are here: scripts/gpu_env.sh's peers)."""
    try:
        backend = load("fa4_sparse")
    except BackendAbsent as exc:
        pytest.skip(str(exc))
    from sparsebalance.kernels.sparse_attention import sparse_attention

    g = torch.Generator(device="cuda").manual_seed(len(lengths))
    q, k, v = (torch.randn(sum(lengths), h, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (hq, hkv, hkv))
    docs = backend.documents(lengths, "cuda")
    sel = backend.select(q, k, docs, kept_fraction=kept)
    out = backend.attention(q, k, v, docs, selection=sel)
    ref = sparse_attention(q, k, v, docs.batch, selection=sel)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    grad_out = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
