"""restrict_rows: the query blocks outside the given rows keep only their diagonal, the others keep their
selection, and the kept rows attend (forward and backward) exactly as under the whole selection."""
import pytest
import torch

from sparsebalance.kernels.sparse_attention import restrict_rows, select_blocks, sparse_attention

# (document lengths, block size, budget); odd lengths, a partial last block, one-block documents
CASES = [
    ((300, 400), 64, {"kept_fraction": 0.3}),
    ((37, 61, 18, 129), 16, {"p": 0.6}),
    ((1, 65, 200), 32, {"p": 1.0}),
    ((513,), 64, {"kept_fraction": 0.1}),
]


def inputs(lengths, hq=4, hkv=2, d=16):
    gen = torch.Generator().manual_seed(sum(lengths))
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=gen, requires_grad=True) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("lengths, block, budget", CASES)
def test_rows_outside_keep_their_diagonal_and_kept_rows_attend_as_before(lengths, block, budget):
    q, k, v, cu = inputs(lengths)
    sel = select_blocks(q.detach(), k.detach(), cu, block_size=block,
                        **{m: torch.full((len(lengths),), x) for m, x in budget.items()})
    nb = sel.num_blocks
    rows = torch.arange(nb) % 3 == 1
    cut = restrict_rows(sel, rows)
    whole, part = sel.to_dense_mask(), cut.to_dense_mask()
    assert torch.equal(part[:, rows], whole[:, rows])
    assert torch.equal(part[:, ~rows], torch.eye(nb, dtype=torch.bool)[~rows].expand(part.shape[0], -1, -1))
    assert torch.equal(cut.kept_fraction, sel.kept_fraction) and torch.equal(cut.coverage, sel.coverage)

    mine = rows[sel.layout.token_block]  # tokens whose block row is kept
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)) * mine[:, None, None]
    want = [sparse_attention(q, k, v, cu, selection=sel)]
    want += torch.autograd.grad(want[0], (q, k, v), grad)
    got = [sparse_attention(q, k, v, cu, selection=cut)]
    got += torch.autograd.grad(got[0], (q, k, v), grad)
    torch.testing.assert_close(got[0][mine], want[0][mine], rtol=0, atol=1e-6)
    for g, w in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_unwritten_slots_past_a_rows_count_are_never_looked_up():
    """The fused GPU selection leaves the slots past each row's count unwritten; here they hold an index far
    out of range, which a lookup of every slot would trip over."""
    q, k, v, cu = inputs((300, 400))
    sel = select_blocks(q.detach(), k.detach(), cu, block_size=64, kept_fraction=torch.tensor([0.3, 0.3]))
    slot = torch.arange(sel.q2k_idx.shape[-1])
    sel.q2k_idx = torch.where(slot < sel.q2k_cnt[..., None], sel.q2k_idx, 10**6).to(torch.int32)
    rows = torch.arange(sel.num_blocks) % 2 == 0
    cut = restrict_rows(sel, rows)
    assert int(cut.q2k_idx.max()) < sel.num_blocks
    mine = rows[sel.layout.token_block]
    torch.testing.assert_close(sparse_attention(q, k, v, cu, selection=cut)[mine],
                               sparse_attention(q, k, v, cu, selection=restrict_rows(sel, torch.ones_like(rows)))[mine])
