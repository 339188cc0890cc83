"""kernels.sparse_attention's block selection: the lists' invariants against the reference, budgets and their
monotonicity, memory bounds, bad input, and the fused Triton selection against the torch one."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from triton.runtime.errors import OutOfResources

from sparsebalance.kernels.sparse_attention import (BlockSelection, KernelOptions, SelectionFallbackWarning,
                                                    select_blocks, select_blocks_naive, sparse_attention)
from sparsebalance.kernels.sparse_attention import forward, launch, selection

from kernel_cases import ATOL, DEV, POISON, TORCH_SELECTION, TRITON_SELECTION, check_against_naive, cu_of, qkv
from kernel_cases import _tma_on_small_launches  # noqa: F401  (autouse)


# ------------------------------------------------------------------------------------ selection
def _rows(sel: BlockSelection):
    H, NB, W = sel.q2k_idx.shape
    out = {}
    for h in range(H):
        for g in range(NB):
            c = int(sel.q2k_cnt[h, g])
            out[(h, g)] = sel.q2k_idx[h, g, :c].tolist()
    return out


def _check_lists(sel: BlockSelection) -> dict:
    """The selection's structural invariants; returns its forward rows."""
    rows = _rows(sel)
    doc = sel.layout.block_doc.tolist()
    for (_h, g), lst in rows.items():
        assert lst == sorted(lst) and len(set(lst)) == len(lst), "ascending, no duplicates"
        assert lst[-1] == g, "diagonal kept, and last"
        assert all(c <= g and doc[c] == doc[g] for c in lst), "causal, within the document"
    # reverse lists are the transpose of the forward lists
    H, NB, _ = sel.q2k_idx.shape
    ptr = sel.k2q_ptr.tolist()
    for h in range(H):
        for c in range(NB):
            got = sel.k2q_idx[ptr[h * NB + c]:ptr[h * NB + c + 1]].tolist()
            assert got == sorted(g for g in range(NB) if c in rows[(h, g)])
    return rows


SEL_LENS = [1, 200, 37, 129, 64, 300]


@pytest.mark.parametrize("mode,budget", [("p", 0.5), ("p", 0.9), ("p", 1.0), ("kept_fraction", 0.1),
                                         ("kept_fraction", 0.5)],
                         ids=["p0.5", "p0.9", "p1.0", "kf0.1", "kf0.5"])
def test_selection_invariants_and_reference(mode, budget):
    q, k, _ = qkv(SEL_LENS, 4, 2, 16, seed=1)
    q, k = q.detach() * 3, k.detach() * 3  # sharper routing scores than unit noise
    cu = cu_of(SEL_LENS)
    B = 32
    sel = select_blocks(q, k, cu, block_size=B, **{mode: budget})
    lay = sel.layout
    doc = lay.block_doc.tolist()
    ref, mass = select_blocks_naive(q, k, cu, block_size=B, **{mode: budget})
    rows = _check_lists(sel)
    for (h, g), lst in rows.items():
        assert set(lst) == ref[(h, g)], f"row {(h, g)} differs from the loop reference"
        if mode == "p":
            assert mass[(h, g)] >= budget - 1e-5, "coverage reaches p"
    H, NB, _ = sel.q2k_idx.shape
    # stats
    causal = torch.tensor([n * (n + 1) / 2 for n in lay.doc_nblocks]) * H
    kept = torch.tensor([sum(len(rows[(h, g)]) for h in range(H) for g in range(NB) if doc[g] == d)
                         for d in range(lay.num_docs)])
    torch.testing.assert_close(sel.kept_fraction.cpu(), (kept / causal).float())
    if mode == "p":
        assert (sel.coverage.cpu() >= budget - 1e-5).all()
    if budget == 1.0:
        assert (sel.kept_fraction == 1).all()


def test_kept_fraction_monotone_in_p_and_nested():
    q, k, _ = qkv(SEL_LENS, 2, 2, 16, seed=2)
    q, k = q.detach() * 3, k.detach() * 3
    cu = cu_of(SEL_LENS)
    prev, prev_rows = None, None
    for p in (0.2, 0.4, 0.6, 0.8, 0.95, 1.0):
        sel = select_blocks(q, k, cu, p=p, block_size=32)
        rows = _rows(sel)
        if prev is not None:
            assert (sel.kept_fraction >= prev - 1e-7).all()
            assert all(set(prev_rows[key]) <= set(rows[key]) for key in rows)
        prev, prev_rows = sel.kept_fraction, rows


def test_kept_fraction_mode_hits_target_and_mixes_per_sequence():
    lens = [512, 512, 256]
    q, k, _ = qkv(lens, 2, 1, 16, seed=4)
    cu = cu_of(lens)
    kf = torch.tensor([0.1, 0.5, 1.0], device=DEV)
    sel = select_blocks(q.detach(), k.detach(), cu, kept_fraction=kf, block_size=16)
    # per-row rounding of round(kf * n_causal) (at least the diagonal) keeps the total within a few %
    assert (sel.kept_fraction - kf).abs().max() < 0.05
    assert sel.kept_fraction[2] == 1.0 and sel.coverage[2] > 0.999


@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_selection_memory_is_bounded_by_kept_blocks(path):
    # 64 blocks: a row list as wide as NB is 3x over the fused path's bound below and 12x over the torch
    # path's; the interpreter's time grows with the square of NB, so more blocks add time, not strength
    lens = [1024]
    q, k, _ = qkv(lens, 2, 2, 16, seed=5)
    sel = select_blocks(q.detach(), k.detach(), cu_of(lens), kept_fraction=0.05, block_size=16,
                        options=KernelOptions(selection=path))
    NB = 64
    # the forward lists are [Hkv, NB, W] with W the largest row, about 5% of NB here, not NB; the fused
    # top-k sizes W on the host, with 16 spare slots for exact score ties
    spare = 16 if path == "triton" else 0
    assert sel.q2k_idx.shape[-1] <= math.ceil(0.05 * NB) + 1 + spare
    assert sel.k2q_idx.numel() <= sel.q2k_idx.numel()
    assert int(sel.k2q_ptr[-1]) == int(sel.q2k_cnt.sum())


# ------------------------------------------------------------------------------------ bad input
def _good():
    q, k, v = qkv([10, 6], 4, 2, 16)
    return dict(q=q, k=k, v=v, cu_seqlens=cu_of([10, 6]))


BAD = [
    ("q-dtype-int", lambda a: a.update(q=a["q"].long()), "q dtype"),
    ("k-dtype-mismatch", lambda a: a.update(k=a["k"].double()), "k dtype"),
    ("q-rank-2", lambda a: a.update(q=a["q"][:, 0]), "q must have rank 3"),
    ("hq-not-multiple", lambda a: a.update(k=a["k"].repeat(1, 2, 1)[:, :3], v=a["v"].repeat(1, 2, 1)[:, :3]),
     "multiple of Hkv=3"),
    ("cu-not-int32", lambda a: a.update(cu_seqlens=a["cu_seqlens"].long()), "cu_seqlens must be an int32"),
    ("cu-not-increasing", lambda a: a.update(cu_seqlens=torch.tensor([0, 10, 10, 16], dtype=torch.int32)),
     "strictly increasing"),
    ("cu-not-ending-at-T", lambda a: a.update(cu_seqlens=torch.tensor([0, 10, 15], dtype=torch.int32)),
     "end at T=16"),
    ("cu-not-starting-at-0", lambda a: a.update(cu_seqlens=torch.tensor([1, 10, 16], dtype=torch.int32)),
     "start at 0"),
    ("p-zero", lambda a: a.update(p=0.0), r"p must be in \(0, 1\], got 0.0"),
    ("p-above-one", lambda a: a.update(p=1.5), r"p must be in \(0, 1\], got 1.5"),
    ("p-tensor-bad-entry", lambda a: a.update(p=torch.tensor([0.5, -0.1])), r"p must be in \(0, 1\]"),
    ("p-tensor-wrong-length", lambda a: a.update(p=torch.tensor([0.5, 0.5, 0.5])), "one per sequence"),
    ("kept-fraction-zero", lambda a: a.update(kept_fraction=0.0), r"kept_fraction must be in \(0, 1\]"),
    ("p-and-kept-fraction", lambda a: a.update(p=0.5, kept_fraction=0.5), "not both"),
    ("block-size-48", lambda a: a.update(block_size=48), "block_size=48"),
    ("head-dim-24", lambda a: a.update(q=a["q"][..., :12].repeat(1, 1, 2), k=a["k"][..., :12].repeat(1, 1, 2),
                                       v=a["v"][..., :12].repeat(1, 1, 2)), "head dim D=24"),
]


@pytest.mark.parametrize("mutate,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_value_error(mutate, match):
    args = _good()
    mutate(args)
    with pytest.raises(ValueError, match=match) as info:
        sparse_attention(**args, backend="naive")
    assert "\n" not in str(info.value), "one-line message"


@pytest.mark.parametrize("lens,budget", [
    ([1, 40, 37, 60], dict(p=0.7)), ([1, 40, 37, 60], dict(p=1.0)),
    ([1, 40, 37, 60], dict(kept_fraction=torch.tensor([0.3, 0.6, 1.0, 0.1]))),
    # a float budget: the fused top-k sizes its lists on the host (no sync), with padding past nnz
    ([1, 40, 37, 60], dict(kept_fraction=0.3)),
    # 70 blocks: the reverse-list kernel scans a KV block's rows in several 64-row chunks
    pytest.param([1, 1100, 37, 3], dict(kept_fraction=torch.tensor([1.0, 0.2, 0.5, 1.0])), marks=pytest.mark.slow),
], ids=["p0.7", "p1.0", "kf-per-doc", "kf0.3", "long-doc-kf0.2"])
def test_fused_triton_selection_equals_torch_selection(lens, budget):
    """The fused Triton selection (used on CUDA) picks exactly the blocks of the torch path and builds the
    same reverse lists and per-document stats."""
    q, k, _ = qkv(lens, 4, 2, 16, seed=6)
    q, k = q.detach() * 3, k.detach() * 3
    cu = cu_of(lens)
    budget = {n: (x.to(DEV) if isinstance(x, torch.Tensor) else x) for n, x in budget.items()}
    a = select_blocks(q, k, cu, block_size=16, **budget, options=TORCH_SELECTION)
    b = select_blocks(q, k, cu, block_size=16, **budget, options=TRITON_SELECTION)
    assert torch.equal(a.q2k_cnt, b.q2k_cnt)
    w = int(a.q2k_cnt.max())  # slots past a row's count are unused (and the fused lists may be wider)
    assert a.row_blocks == w
    if b.row_blocks is None:  # only the device knows the widest row (top-p; top-k budgets on a GPU)
        assert_row_class(b, w)
    else:
        assert b.row_blocks == w
    used = torch.arange(w, device=DEV) < a.q2k_cnt[..., None]
    assert torch.equal(a.q2k_idx[..., :w][used], b.q2k_idx[..., :w][used])
    assert torch.equal(a.q2k_start[..., :w][used], b.q2k_start[..., :w][used])
    nnz = int(a.k2q_ptr[-1])  # the sort-built lists carry padding past nnz
    assert torch.equal(a.k2q_ptr, b.k2q_ptr)
    for name in ("k2q_idx", "k2q_start", "k2q_end"):
        assert torch.equal(getattr(a, name)[:nnz], getattr(b, name)[:nnz]), name
    torch.testing.assert_close(a.kept_fraction, b.kept_fraction)
    torch.testing.assert_close(a.coverage, b.coverage)


def assert_row_class(sel: BlockSelection, widest: int):
    """A selection whose widest row only the device knows gives the layout's block ends to the launches of
    that row's class and zeros (nothing to do) to the other class's."""
    short = widest * sel.block_size < launch.SHORT_ROW_TOKENS
    ends_short, ends_long = sel.row_class_end
    active, idle = (ends_short, ends_long) if short else (ends_long, ends_short)
    assert torch.equal(active, sel.layout.block_end) and not idle.any()


@pytest.mark.parametrize("short_row_tokens", [1 << 20, 16], ids=["short-rows", "long-rows"])
def test_rows_only_the_device_knows_take_their_row_class(monkeypatch, short_row_tokens):
    """A top-p selection leaves its widest row on the device (no sync): forward and dQ launch both row
    classes' configs, of which only the one of the widest row's class has work; the results match the
    reference with either class active."""
    monkeypatch.setattr(launch, "SHORT_ROW_TOKENS", short_row_tokens)
    lens = [77, 32, 9]
    q, k, v = qkv(lens, 4, 2, 16)
    cu = cu_of(lens)
    sel = select_blocks(q, k, cu, p=0.9, block_size=16, options=TRITON_SELECTION)
    assert sel.row_blocks is None
    assert_row_class(sel, int(sel.q2k_cnt.max()))
    compiled = {}
    check_against_naive(q, k, v, cu, sel, ATOL[torch.float32],
                        KernelOptions(poison_outputs=True, compiled=compiled, precompile=False))
    assert {"fwd", "fwd_short", "dq", "dq_short", "dkdv"} <= set(compiled)


def _fused_raising(exc):
    def fused(*args):
        raise exc
    return fused


SHARED_MEMORY = OutOfResources(300_000, 232_448, "shared memory")


def test_selection_falls_back_where_triton_cannot_build_it(monkeypatch):
    """Triton failing to build the fused selection for the GPU (out of shared memory) gives None and a
    warning naming the reason, on every call: nothing is remembered between calls."""
    monkeypatch.setattr(selection, "_select_fused", _fused_raising(SHARED_MEMORY))
    for _ in range(2):
        with pytest.warns(SelectionFallbackWarning, match="OutOfResources: out of resource: shared memory"):
            assert selection._select_fused_where_it_builds(*[None] * 7) is None


def test_a_bug_in_the_fused_selection_propagates(monkeypatch):
    monkeypatch.setattr(selection, "_select_fused", _fused_raising(TypeError("a bug")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(TypeError, match="a bug"):
            selection._select_fused_where_it_builds(*[None] * 7)


def test_forced_fused_selection_never_falls_back(monkeypatch):
    monkeypatch.setattr(selection, "_select_fused", _fused_raising(SHARED_MEMORY))
    q, k, _ = qkv([40, 23], 2, 1, 16)
    with pytest.raises(OutOfResources):
        select_blocks(q.detach(), k.detach(), cu_of([40, 23]), kept_fraction=0.5, block_size=16,
                      options=TRITON_SELECTION)


@pytest.mark.skipif(DEV != "cuda", reason="the default selection tries the fused path on CUDA tensors only")
def test_default_selection_on_cuda_falls_back_per_call(monkeypatch):
    """On CUDA the default selection falls back to the torch path where the fused one cannot be built, and
    propagates anything else; once the fused path builds again, the next call takes it."""
    lens = [300, 129, 1]
    q, k, _ = [x.detach() for x in qkv(lens, 4, 2, 64, torch.float16)]
    cu = cu_of(lens).cpu()
    args = dict(kept_fraction=0.1, block_size=64)
    torch_sel = select_blocks(q, k, cu, **args, options=TORCH_SELECTION)
    fused_sel = select_blocks(q, k, cu, **args)
    # the fused top-k sizes its lists from the host budget, with spare slots: the two paths differ in width
    assert fused_sel.q2k_idx.shape[-1] != torch_sel.q2k_idx.shape[-1]
    with monkeypatch.context() as m:
        m.setattr(selection, "_select_fused", _fused_raising(SHARED_MEMORY))
        with pytest.warns(SelectionFallbackWarning):
            fallback = select_blocks(q, k, cu, **args)
        m.setattr(selection, "_select_fused", _fused_raising(TypeError("a bug")))
        with pytest.raises(TypeError, match="a bug"):
            select_blocks(q, k, cu, **args)
    assert torch.equal(fallback.q2k_idx, torch_sel.q2k_idx) and torch.equal(fallback.k2q_idx, torch_sel.k2q_idx)
    assert select_blocks(q, k, cu, **args).q2k_idx.shape == fused_sel.q2k_idx.shape


def test_options_are_checked():
    with pytest.raises(ValueError, match="selection='fused': use one of auto, triton, torch"):
        KernelOptions(selection="fused")
    args = _good()
    with pytest.raises(ValueError, match="options must be a KernelOptions, got dict"):
        sparse_attention(**args, backend="naive", options={"poison_outputs": True})


def test_options_reach_the_launchers(monkeypatch):
    """Each call launches with its own options' tiles, and the compiled-kernel sink records each launch."""
    grids = []

    def spy(cfg, heads, rows):
        grids.append((cfg["BM"], rows))
        return launch.grid(cfg, heads, rows)

    monkeypatch.setattr(forward, "grid", spy)
    lens = [77, 32, 9]
    q, k, v = qkv(lens, 2, 1, 16)
    cu = cu_of(lens)
    sel = select_blocks(q, k, cu, kept_fraction=0.5, block_size=32)
    compiled = {}
    small = KernelOptions(tiles={(32, 16): {"fwd": dict(BM=16, BN=16)}}, poison_outputs=True, compiled=compiled,
                          precompile=False)
    o = sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=small)
    assert set(compiled) == {"fwd"}
    o.sum().backward()
    assert set(compiled) == {"fwd", "dq", "dkdv"}
    sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=POISON)
    NB = sel.num_blocks
    assert grids == [(16, 2 * NB), (32, NB)]


@pytest.mark.slow
@settings(max_examples=8, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 120), min_size=1, max_size=4), kf=st.floats(0.01, 1.0),
       ties=st.booleans(), seed=st.integers(0, 1000))
# 44 blocks at kept 0.05: tied rows want all their blocks, more than the 3 + 16 slots (the overflow path)
@example(lens=[700, 5], kf=0.05, ties=True, seed=0)
def test_host_sized_topk_lists_hold_every_kept_block(lens, kf, ties, seed):
    """The fused top-k sizes its lists from the host budgets, without a sync: the lists must hold every kept
    block, also when exact score ties (all-zero routing inputs) keep more than the budget's count."""
    q, k, _ = qkv(lens, 2, 1, 16, seed=seed)
    q, k = (q.detach() * 0, k.detach() * 0) if ties else (q.detach() * 3, k.detach() * 3)
    sel = select_blocks(q, k, cu_of(lens), kept_fraction=kf, block_size=16, options=TRITON_SELECTION)
    assert int(sel.q2k_cnt.max()) <= sel.q2k_idx.shape[-1]
    assert int(sel.k2q_ptr[-1]) == int(sel.q2k_cnt.sum()) <= sel.k2q_idx.numel()
    _check_lists(sel)
    if not ties:
        assert sel.row_blocks == int(sel.q2k_cnt.max())
