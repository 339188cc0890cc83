"""FlexAttention BlockMasks built from our selection: one sequence, and a packed batch under a token-level
document mask (whole-block documents given exactly the kept blocks: kernels.backends.flash_sparse)."""
from __future__ import annotations

from sparsebalance.kernels.backends.flash_sparse import diagonal_partial_mask


def flex_block_mask_single(sel, H, L, B):
    """BlockMask for one sequence (blocks aligned with Flex's): diagonal = partial (causal mask_mod),
    other kept blocks = full."""
    dense = sel.to_dense_mask()[None]  # [1, H, NB, NB]
    assert dense.shape[1] == H
    sel_dense = dense[0]

    def mask_mod(b, h, q_idx, kv_idx):  # only evaluated on partial (diagonal) blocks by the fused kernel
        return (q_idx >= kv_idx) & sel_dense[h, q_idx // B, kv_idx // B]

    return diagonal_partial_mask(dense, mask_mod, L, B)


def flex_block_mask_packed(sel, H, T, B):
    from torch.nn.attention.flex_attention import create_block_mask

    lay = sel.layout
    dense = sel.to_dense_mask()  # [H, NB, NB]
    tok_doc = lay.block_doc[lay.token_block]
    tok_blk = lay.token_block

    def mask_mod(b, h, q_idx, kv_idx):
        same = tok_doc[q_idx] == tok_doc[kv_idx]
        return same & (kv_idx <= q_idx) & dense[h, tok_blk[q_idx], tok_blk[kv_idx]]

    dev = sel.q2k_idx.device
    return create_block_mask(mask_mod, 1, H, T, T, device=dev, BLOCK_SIZE=B, _compile=dev.type == "cuda")
