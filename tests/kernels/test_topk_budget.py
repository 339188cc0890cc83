"""kernels.sparse_attention top-k budgets (``top_k``, with ``p`` as the optional coverage floor): the selection
against the loop reference (the torch path everywhere; the fused Triton selection through the interpreter on
a CPU), kept fractions against the closed form, forward and backward against the PyTorch reference, bad values
in one line. On a CPU the Triton runs go through the interpreter (tests/kernels/conftest.py); the GPU-only
tests hold the fused path on CUDA tensors (sizes, no sync)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsebalance.kernels.sparse_attention import (KernelOptions, VarlenBatch, select_blocks, select_blocks_naive,
                                                    sparse_attention)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 2e-5  # fp32, as tests/kernels/test_sparse_attention.py
TORCH = KernelOptions(selection="torch", precompile=False)
TRITON = KernelOptions(selection="triton", precompile=False)
POISON = KernelOptions(poison_outputs=True, precompile=False)

# id, document lengths, Hq, Hkv, block size, top_k, floor p
CASES = [
    ("odd-lengths-mha-k2", [37, 70, 5], 2, 2, 16, 2, None),
    ("gqa4to1-k1", [50, 81, 1], 4, 1, 16, 1, None),
    ("k-above-every-row", [40, 3, 66], 4, 2, 16, 100, None),
    ("per-doc-k-gqa", [60, 45, 80, 17], 4, 2, 16, [1, 3, 2, 8], None),
    ("single-token-docs-block32", [1, 1, 99, 1, 20], 2, 1, 32, 2, None),
    ("floor-k2-p0.7", [37, 70, 5], 2, 2, 16, 2, 0.7),
    ("per-doc-k-and-floor-gqa", [60, 45, 80], 4, 2, 16, [1, 4, 2], [0.5, 0.9, 0.3]),
    ("k1-floor-p1-dense", [33, 20], 2, 1, 16, 1, 1.0),
]
IDS = [c[0] for c in CASES]


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


def qkv(lens, hq, hkv, d=16, seed=0, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return [(torch.randn(t, h, d, generator=g) * s).to(DEV).requires_grad_() for h, s in
            ((hq, sharp), (hkv, sharp), (hkv, 1.0))]


def budget_of(top_k, floor):
    as_tensor = lambda x, dtype: torch.tensor(x, dtype=dtype) if isinstance(x, list) else x  # noqa: E731
    out = {"top_k": as_tensor(top_k, torch.int64)}
    if floor is not None:
        out["p"] = as_tensor(floor, torch.float32)
    return out


def closed_form(lens, top_k, block):
    """Kept share of each document's causal blocks without a floor: row r keeps min(k, r + 1) blocks."""
    ks = top_k if isinstance(top_k, list) else [top_k] * len(lens)
    out = []
    for length, k in zip(lens, ks, strict=True):
        nb = -(-length // block)
        out.append(sum(min(k, r + 1) for r in range(nb)) / (nb * (nb + 1) / 2))
    return torch.tensor(out)


def rows_of(sel):
    h, nb, _ = sel.q2k_idx.shape
    return {(i, g): sel.q2k_idx[i, g, :int(sel.q2k_cnt[i, g])].tolist() for i in range(h) for g in range(nb)}


def check_selection(sel, q, k, cu, block, budget):
    """Rows equal the loop reference's, lists ascending with the diagonal last, reverse lists the transpose,
    kept fraction and coverage the rows' own."""
    ref, mass = select_blocks_naive(q.detach().cpu(), k.detach().cpu(), cu.cpu(), block_size=block, **budget)
    rows = rows_of(sel)
    assert rows.keys() == ref.keys()
    for key, lst in rows.items():
        assert lst == sorted(set(lst)) and lst[-1] == key[1], f"row {key}: ascending, diagonal last"
        assert set(lst) == ref[key], f"row {key} differs from the loop reference"
    lay = sel.layout
    hkv, nb = sel.q2k_cnt.shape
    ptr = sel.k2q_ptr.tolist()
    for h in range(hkv):
        for c in range(nb):
            assert sel.k2q_idx[ptr[h * nb + c]:ptr[h * nb + c + 1]].tolist() == [
                g for g in range(nb) if c in rows[(h, g)]]
    doc = lay.block_doc.tolist()
    docs = range(lay.num_docs)
    kept = torch.tensor([sum(len(rows[(h, g)]) for h in range(hkv) for g in range(nb) if doc[g] == d) for d in docs])
    cover = torch.tensor([sum(mass[(h, g)] for h in range(hkv) for g in range(nb) if doc[g] == d) for d in docs])
    causal = torch.tensor(lay.causal_blocks_per_doc()) * hkv
    torch.testing.assert_close(sel.kept_fraction.cpu(), (kept / causal).float())
    torch.testing.assert_close(sel.coverage.cpu(), (cover / (torch.tensor(lay.doc_nblocks) * hkv)).float(),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("lens,hq,hkv,block,top_k,floor", [c[1:] for c in CASES], ids=IDS)
def test_selection_matches_the_loop_reference(lens, hq, hkv, block, top_k, floor, path):
    q, k, _ = qkv(lens, hq, hkv)
    cu = cu_of(lens)
    budget = budget_of(top_k, floor)
    if path == "triton" and floor is not None and floor != 1.0:
        with pytest.raises(ValueError, match="selection='triton' cannot select top_k with a floor") as info:
            select_blocks(q.detach(), k.detach(), cu, block_size=block, **budget, options=TRITON)
        assert "\n" not in str(info.value)
        return
    sel = select_blocks(q.detach(), k.detach(), cu, block_size=block, **budget,
                        options=TORCH if path == "torch" else TRITON)
    check_selection(sel, q, k, cu, block, budget)
    if floor is None:
        torch.testing.assert_close(sel.kept_fraction.cpu(), closed_form(lens, top_k, block).float())
    else:  # the floor only adds blocks: never below the top-k rows, never below the floor's own selection
        alone = select_blocks(q.detach(), k.detach(), cu, block_size=block, top_k=budget["top_k"], options=TORCH)
        topp = select_blocks(q.detach(), k.detach(), cu, block_size=block, p=budget["p"], options=TORCH)
        assert (sel.kept_fraction >= torch.maximum(alone.kept_fraction, topp.kept_fraction) - 1e-6).all()
        assert (sel.coverage >= torch.as_tensor(floor, device=sel.coverage.device) - 1e-5).all()


@pytest.mark.slow
def test_fused_selection_sizes_its_lists_from_the_counts():
    """The fused top-k with host counts knows its widest row and kept entries without the GPU: min(k, blocks)
    and the closed form's count, exactly."""
    lens, block = [1, 200, 37, 129], 16
    q, k, _ = qkv(lens, 4, 2, seed=3)
    top_k = torch.tensor([1, 3, 9, 4])
    sel = select_blocks(q.detach(), k.detach(), cu_of(lens), top_k=top_k, block_size=block, options=TRITON)
    nbs = [-(-n // block) for n in lens]
    longest_row = max(min(kk, nb) for kk, nb in zip(top_k.tolist(), nbs, strict=True))
    assert sel.row_blocks == longest_row == int(sel.q2k_cnt.max())
    assert sel.kept_entries == int(sel.q2k_cnt.sum()) == int(sel.k2q_ptr[-1])


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=5), k=st.integers(1, 12),
       block=st.sampled_from([16, 32, 64]), seed=st.integers(0, 1000))
def test_kept_fraction_is_the_closed_form(lens, k, block, seed):
    q, k_, _ = qkv(lens, 2, 1, seed=seed)
    sel = select_blocks(q.detach(), k_.detach(), cu_of(lens), top_k=k, block_size=block, options=TORCH)
    torch.testing.assert_close(sel.kept_fraction.cpu(), closed_form(lens, k, block).float())
    assert (sel.q2k_cnt <= k).all()


def reference_attention(q, k, v, cu, block, budget):
    """Attention under the loop reference's kept blocks, from a token mask: nothing of the kernel's selection."""
    sets, _ = select_blocks_naive(q.detach().cpu(), k.detach().cpu(), cu.cpu(), block_size=block, **budget)
    hq, hkv = q.shape[1], k.shape[1]
    outs, first = [], 0
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        tb = torch.arange(e - s) // block
        nb = int(tb[-1]) + 1
        mask = torch.zeros(hkv, nb, nb, dtype=torch.bool)
        for h in range(hkv):
            for g in range(nb):
                mask[h, g, [c - first for c in sets[(h, first + g)]]] = True
        tm = mask[:, tb][:, :, tb] & torch.ones(e - s, e - s, dtype=torch.bool).tril()
        tm = tm.repeat_interleave(hq // hkv, 0).to(q.device)
        kd, vd = (x[s:e].repeat_interleave(hq // hkv, 1).transpose(0, 1) for x in (k, v))
        sc = (q[s:e].transpose(0, 1) @ kd.transpose(-1, -2)) / q.shape[-1] ** 0.5
        outs.append((torch.softmax(sc.masked_fill(~tm, float("-inf")), -1) @ vd).transpose(0, 1))
        first += nb
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["naive", pytest.param("triton", marks=pytest.mark.slow)])  # triton: interpreted
@pytest.mark.parametrize("lens,hq,hkv,block,top_k,floor", [c[1:] for c in CASES if c[0] in (
    "odd-lengths-mha-k2", "gqa4to1-k1", "per-doc-k-gqa", "per-doc-k-and-floor-gqa")],
    ids=["odd-lengths-mha-k2", "gqa4to1-k1", "per-doc-k-gqa", "per-doc-k-and-floor-gqa"])
def test_forward_and_backward_match_the_reference(lens, hq, hkv, block, top_k, floor, backend):
    """sparse_attention with a top-k budget (the Triton kernels, under the interpreter on a CPU, and the PyTorch
    reference) against attention under the loop reference's blocks: output and dq, dk, dv."""
    q, k, v = qkv(lens, hq, hkv, seed=7)
    cu = cu_of(lens)
    budget = budget_of(top_k, floor)
    o = sparse_attention(q, k, v, cu, block_size=block, **budget, backend=backend,
                         options=POISON if backend == "triton" else TORCH)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    ref = reference_attention(q, k, v, cu, block, budget)
    want = torch.autograd.grad(ref, (q, k, v), do)
    torch.testing.assert_close(o, ref, atol=ATOL, rtol=0, msg="output")
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=name)


def test_naive_reference_keeps_min_k_blocks_diagonal_first():
    """The loop reference itself, on scores built by hand: one document of 4 blocks and one KV head, whose
    query blocks all prefer key block 0, then 1: top_k=2 keeps {diagonal, 0} in every row past the first, and a
    floor of 0.99 adds the rest of the mass."""
    block, d = 16, 16
    kb = torch.zeros(4, d)
    kb[0, 0], kb[1, 0] = 8.0, 4.0  # block 0 scores highest, block 1 second
    k = kb.repeat_interleave(block, 0)[:, None, :]
    q = torch.zeros(4 * block, 1, d)
    q[:, 0, 0] = 4.0
    cu = torch.tensor([0, 4 * block], dtype=torch.int32)
    rows, _ = select_blocks_naive(q, k, cu, top_k=2, block_size=block)
    assert rows == {(0, 0): {0}, (0, 1): {0, 1}, (0, 2): {0, 2}, (0, 3): {0, 3}}
    floored, mass = select_blocks_naive(q, k, cu, top_k=2, p=0.99, block_size=block)
    assert floored[(0, 3)] == {0, 1, 3} and mass[(0, 3)] >= 0.99


def _good():
    q, k, v = qkv([10, 6], 4, 2)
    return dict(q=q, k=k, v=v, cu_seqlens=cu_of([10, 6]))


BAD = [
    ("k-zero", dict(top_k=0), "top_k must be a whole number of blocks >= 1, got 0"),
    ("k-negative", dict(top_k=-2), "top_k must be a whole number of blocks >= 1, got -2"),
    ("k-float", dict(top_k=1.5), "top_k must be a whole number of blocks >= 1, got 1.5"),
    ("k-bool", dict(top_k=True), "top_k must be a whole number of blocks >= 1, got True"),
    ("k-float-tensor", dict(top_k=torch.tensor([1.0, 2.0])), "top_k must be an int or a 1-D integer tensor"),
    ("k-2d-tensor", dict(top_k=torch.ones(2, 1, dtype=torch.int64)), "top_k must be an int or a 1-D integer tensor"),
    ("k-tensor-zero-entry", dict(top_k=torch.tensor([3, 0])), "top_k must be a whole number of blocks >= 1, got 0"),
    ("k-tensor-wrong-length", dict(top_k=torch.tensor([1, 2, 3])), "top_k has 3 entries, expected one per sequence"),
    ("k-and-kept-fraction", dict(top_k=2, kept_fraction=0.5), "give top_k or kept_fraction, not both"),
    ("floor-zero", dict(top_k=2, p=0.0), r"p must be in \(0, 1\], got 0.0"),
    ("floor-above-one", dict(top_k=2, p=torch.tensor([0.5, 1.5])), r"p must be in \(0, 1\], got 1.5"),
]


@pytest.mark.parametrize("budget,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_values_are_one_line(budget, match):
    for call in (lambda a: sparse_attention(**a, **budget, backend="naive"),
                 lambda a: select_blocks(a["q"], a["k"], a["cu_seqlens"], **budget)):
        with pytest.raises(ValueError, match=match) as info:
            call(_good())
        assert "\n" not in str(info.value), "one-line message"


def test_a_selection_and_top_k_are_one_line():
    args = _good()
    sel = select_blocks(args["q"], args["k"], args["cu_seqlens"], top_k=1)
    with pytest.raises(ValueError, match=r"give a selection or a budget \(p / kept_fraction / top_k\), not both"):
        sparse_attention(**args, selection=sel, top_k=1)


# ---------------------------------------------------------------------------------- GPU only
@pytest.mark.skipif(DEV != "cuda", reason="the default selection takes the fused path on CUDA tensors only")
@pytest.mark.parametrize("lens,hq,hkv,block,top_k,floor", [c[1:] for c in CASES], ids=IDS)
def test_default_selection_on_cuda_matches_the_reference(lens, hq, hkv, block, top_k, floor):
    """On a GPU the default options run the fused top-k (the torch selection where a floor is given): the
    same rows as the loop reference; the fused path's lists are sized on the host (16 slots for ties past the
    widest row), the torch path's to the widest row."""
    q, k, _ = qkv(lens, hq, hkv)
    budget = budget_of(top_k, floor)
    sel = select_blocks(q.detach(), k.detach(), cu_of(lens), block_size=block, **budget)
    check_selection(sel, q, k, cu_of(lens), block, budget)
    widest, longest = int(sel.q2k_cnt.max()), sel.layout.max_doc_blocks
    if widest < longest:  # not dense
        assert sel.q2k_idx.shape[-1] == (widest if floor is not None else min(longest, widest + 16))


@pytest.mark.skipif(DEV != "cuda", reason="device syncs exist on a GPU only")
@pytest.mark.parametrize("top_k", [8, torch.tensor([8, 2, 1])], ids=["k-int", "k-host-tensor"])
def test_top_k_layers_never_sync(top_k):
    """Top-k with host counts is sized on the host: select_blocks and sparse_attention, forward and backward,
    never wait for the GPU (as test_sparse_attention.test_layers_never_sync for the other modes)."""
    lens = [8000, 6000, 2384]
    q, k, v = (x.detach().to(torch.bfloat16).requires_grad_() for x in qkv(lens, 8, 2, d=128))
    do = torch.randn_like(q)

    def layers(docs):
        for _ in range(2):
            sel = select_blocks(q, k, docs, top_k=top_k, block_size=128)
            torch.autograd.grad(sparse_attention(q, k, v, docs, selection=sel), (q, k, v), do)
            torch.autograd.grad(sparse_attention(q, k, v, docs, top_k=top_k, block_size=128), (q, k, v), do)

    layers(VarlenBatch.from_cu_seqlens(cu_of(lens)))  # compiles the kernels
    docs = VarlenBatch.from_cu_seqlens(cu_of([lens[0] - 1, lens[1], lens[2] + 1]))
    torch.cuda.set_sync_debug_mode("error")
    try:
        layers(docs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
