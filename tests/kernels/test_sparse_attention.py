"""kernels.sparse_attention: Triton kernels (interpreter on CPU) against the PyTorch reference.

Tolerances (absolute, on unit-normal inputs, outputs and gradients of order 1):
  float32: 2e-5 — interpreter dots are numpy fp32; the only differences are summation order and the
           online-softmax rescaling (observed ~1e-6).
  float16: 5e-3 — inputs and P/dS are rounded to fp16 (eps 1e-3) before each dot; accumulation is fp32.
bf16 is not testable in the interpreter (tl.dot on bf16 reads raw bits, triton#11584) and is checked on the
GPU by ``python -m benchmarks.attention --check`` (results in results/attention/attention_h200_check.csv).
"""
from __future__ import annotations

import math
import threading
import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from triton.runtime.errors import OutOfResources

from sparsebalance.kernels.sparse_attention import (BlockSelection, KernelOptions, SelectionFallbackWarning,
                                                    VarlenBatch, dense_causal_varlen, select_blocks,
                                                    select_blocks_naive, selection_from_mask, sparse_attention,
                                                    sparse_attention_naive)
from sparsebalance.kernels.sparse_attention import backward, forward, launch, selection

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 2e-5, torch.float16: 5e-3}
# kernel outputs start as NaN: a row or head the kernel forgets to write fails the comparison; each test
# compiles only what it launches (precompile=False), test_compilation the variants of a whole training run
POISON = KernelOptions(poison_outputs=True, precompile=False)
TORCH_SELECTION = KernelOptions(selection="torch", precompile=False)
TRITON_SELECTION = KernelOptions(selection="triton", precompile=False)


def poisoned(tiles=None) -> KernelOptions:
    """Poisoned outputs with the launch-config overrides ``tiles`` ({(block, D): {kind: {...}}})."""
    return KernelOptions(tiles=tiles or {}, poison_outputs=True, precompile=False)


@pytest.fixture(autouse=True)
def _tma_on_small_launches(monkeypatch):
    """The shapes here are far below TMA_MIN_PAIRS: without lowering it no test would launch TMA tiles."""
    monkeypatch.setattr(launch, "TMA_MIN_PAIRS", 0)


def cu_of(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)


def qkv(lens, Hq, Hkv, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    mk = lambda h: torch.randn(T, h, D, generator=g).to(DEV, dtype).requires_grad_()  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


def check_against_naive(q, k, v, cu, sel, atol, options=POISON):
    o = sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=options)
    assert torch.isfinite(o).all(), "missed write (NaN poison survived) or overflow"
    do = torch.randn_like(o)
    g = torch.autograd.grad(o, (q, k, v), do)
    qf, kf, vf = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = sparse_attention_naive(qf, kf, vf, cu, sel)
    gr = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    torch.testing.assert_close(o.float(), ref, atol=atol, rtol=0, msg="output")
    for name, a, b in zip(("dq", "dk", "dv"), g, gr):
        assert torch.isfinite(a).all(), f"{name}: missed write"
        torch.testing.assert_close(a.float(), b, atol=atol, rtol=0, msg=name)
    return o, g


# id, doc lengths, Hq, Hkv, D, block, budget, dtype, config override
CASES = [
    ("odd-lengths-mha-p0.5", [37, 70, 5], 2, 2, 16, 16, dict(p=0.5), torch.float32, None),
    ("single-token-docs-p0.9", [1, 1, 33, 1, 20, 1], 2, 1, 16, 16, dict(p=0.9), torch.float32, None),
    ("gqa4to1-p0.9", [50, 81], 4, 1, 16, 16, dict(p=0.9), torch.float32, None),
    ("gqa8to1-p1.0", [40, 3, 66], 8, 1, 16, 16, dict(p=1.0), torch.float32, None),
    ("gqa4to1-kf0.1", [130, 17], 8, 2, 16, 16, dict(kept_fraction=0.1), torch.float32, None),
    ("mha-kf0.5", [99, 64, 1], 2, 2, 32, 16, dict(kept_fraction=0.5), torch.float32, None),
    ("mixed-p-per-doc", [60, 45, 80], 2, 1, 16, 16, dict(p=torch.tensor([0.5, 1.0, 0.9])), torch.float32, None),
    ("block64-d64-gqa4to1", [150, 1, 64], 4, 1, 64, 64, dict(p=0.9), torch.float32, None),
    # program tiles smaller than the selection block (what the GPU defaults do at block 128)
    ("subtiles-block32-tile16", [77, 32, 9], 2, 1, 16, 32, dict(kept_fraction=0.5), torch.float32,
     {"fwd": dict(BM=16, BN=16), "dq": dict(BM=16, BN=16), "dkdv": dict(BM=16, BN=16)}),
    # head on grid axis 1, short-row configs (what the tuned GPU defaults may pick)
    ("head-outer-short-rows", [77, 32, 9], 4, 2, 16, 32, dict(kept_fraction=0.5), torch.float32,
     {k: dict(BM=16, BN=16, HEAD_OUTER=True) for k in ("fwd_short", "dq_short", "dkdv_short")}),
    ("fp16-gqa2to1-p0.9", [45, 70], 4, 2, 16, 16, dict(p=0.9), torch.float16, None),
    # pointer tiles instead of TMA descriptors (pre-Hopper GPUs, fp32)
    ("pointer-tiles-gqa-subtiles", [77, 32, 9], 4, 2, 16, 32, dict(kept_fraction=0.5), torch.float32,
     {k: dict(BM=16, BN=16, TMA=False) for k in ("fwd", "dq", "dkdv")}),
]


@pytest.mark.parametrize("lens,Hq,Hkv,D,B,budget,dtype,cfg", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_naive(lens, Hq, Hkv, D, B, budget, dtype, cfg):
    options = poisoned({(B, D): cfg} if cfg else None)
    q, k, v = qkv(lens, Hq, Hkv, D, dtype)
    cu = cu_of(lens)
    budget = {n: (x.to(DEV) if isinstance(x, torch.Tensor) else x) for n, x in budget.items()}
    sel = select_blocks(q, k, cu, block_size=B, **budget)
    if cfg and "fwd_short" in cfg:  # the case exercises the short-row configs
        assert launch.get_config("fwd", B, D, row_blocks=sel.row_blocks, options=options)["HEAD_OUTER"]
    check_against_naive(q, k, v, cu, sel, ATOL[dtype], options)


def test_tma_and_pointer_tiles_agree():
    """The forward and dQ load K/V tiles, dK/dV its Q/dO tiles, through TMA descriptors by default (the
    interpreter runs them); with TMA off, and where K/V or Q have no ``[T, H*D]`` view (heads not D apart),
    through pointer tiles: same results."""
    # 16-bit: what TMA takes on a GPU, where it also needs D 64 or 128 (small shapes for the interpreter)
    lens, D, B = ([300, 129, 1], 64, 64) if DEV == "cuda" else ([40, 23, 1], 16, 16)
    q, k, v = qkv(lens, 4, 2, D, torch.float16)
    cu = cu_of(lens)
    sel = select_blocks(q, k, cu, kept_fraction=0.5, block_size=B)
    kh, vh, qh = [x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for x in (k, v, q)]
    pairs = launch.kept_pairs(q, k, sel)
    for kind in ("fwd", "dq"):
        cfg = launch.get_config(kind, B, D, row_blocks=sel.row_blocks)
        assert launch.descriptors(cfg, cfg["BN"], pairs, k, v)[0] is not None
        assert launch.descriptors(cfg, cfg["BN"], pairs, kh, vh) == (None, None)
    cfg = launch.get_config("dkdv", B, D, row_blocks=sel.row_blocks)
    assert launch.descriptors(cfg, cfg["BM"], pairs, q, q)[0] is not None
    assert launch.descriptors(cfg, cfg["BM"], pairs, qh, q) == (None, None)
    do = torch.randn_like(q)
    runs = [(q, k, v, {}), (q, kh, vh, {}), (qh, k, v, {}),
            (q, k, v, {kind: dict(TMA=False) for kind in ("fwd", "dq", "dkdv")})]
    out = []
    for qq, kk, vv, over in runs:
        o = sparse_attention(qq, kk, vv, cu, selection=sel, backend="triton", options=poisoned({(B, D): over}))
        out.append((o, *torch.autograd.grad(o, (qq, kk, vv), do)))
    for other in out[1:]:
        for a, b in zip(out[0], other):
            torch.testing.assert_close(a, b, atol=ATOL[torch.float16], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_documents_never_read_each_other(dtype):
    """NaN in one document's Q, K, V and dO leaves every other document's output and gradients as they were:
    no tile (TMA boxes included, which cannot stop at a document's end) reads across documents. The first
    document's last block is partial, so a TMA box over it would reach into the second. The interpreter takes
    TMA in both dtypes; a GPU takes it in fp16 (D 64) and pointer tiles in fp32."""
    lens, D, B = ([300, 129, 200], 64, 64) if DEV == "cuda" else ([40, 23, 30], 16, 16)
    q, k, v = qkv(lens, 4, 2, D, dtype)
    cu = cu_of(lens)
    sel = select_blocks(q, k, cu, block_size=B)
    do = torch.randn_like(q)
    clean = sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=POISON)
    g_clean = torch.autograd.grad(clean, (q, k, v), do)
    bad = slice(lens[0], lens[0] + lens[1])
    qn, kn, vn = [x.detach().clone() for x in (q, k, v)]
    don = do.clone()
    for x in (qn, kn, vn, don):
        x[bad] = float("nan")
    qn, kn, vn = [x.requires_grad_() for x in (qn, kn, vn)]
    o = sparse_attention(qn, kn, vn, cu, selection=sel, backend="triton", options=POISON)
    g = torch.autograd.grad(o, (qn, kn, vn), don)
    keep = torch.ones(sum(lens), dtype=torch.bool, device=DEV)
    keep[bad] = False
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *g), (clean, *g_clean)):
        torch.testing.assert_close(a[keep], b[keep], atol=0, rtol=0, msg=name)


@pytest.mark.skipif(DEV != "cuda", reason="CUDA contexts and TMA descriptors exist on a GPU only")
def test_fwd_bwd_as_the_first_cuda_work_of_a_thread():
    """Forward and backward run on a thread whose first CUDA work they are (as autograd's device thread is when
    this kernel's backward comes first): the TMA descriptors need the thread's CUDA context bound first. The
    outputs are not poisoned here and the allocator already holds blocks of their sizes (from the reference
    run), so that no allocation or fill binds the context before the first launch does."""
    lens = [300, 129, 1]
    q, k, v = qkv(lens, 4, 2, 64, torch.float16)
    cu = cu_of(lens)
    sel = select_blocks(q, k, cu, kept_fraction=0.5, block_size=64)
    do = torch.randn_like(q)
    ref = torch.autograd.grad(sparse_attention(q, k, v, cu, selection=sel), (q, k, v), do)
    torch.cuda.synchronize()
    result = {}

    def work():
        try:
            result["grads"] = torch.autograd.grad(sparse_attention(q, k, v, cu, selection=sel), (q, k, v), do)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (re-raised on the test's thread)
            result["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in result, result.get("error")
    for a, b in zip(result["grads"], ref):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_small_launches_take_pointer_tiles(monkeypatch):
    """TMA only from TMA_MIN_PAIRS kept token pairs on (its descriptors cost more host time than they save
    on a small launch); the pairs count whole kept blocks over all query heads."""
    lens, D, B = ([300, 129, 1], 64, 64) if DEV == "cuda" else ([40, 23, 1], 16, 16)
    q, k, v = qkv(lens, 4, 2, D, torch.float16)
    sel = select_blocks(q, k, cu_of(lens), block_size=B)
    blocks = sum(n * (n + 1) // 2 for n in ((x + B - 1) // B for x in lens))
    pairs = launch.kept_pairs(q, k, sel)
    # dense: every causal block of each document, for each of the 2 KV heads and the 2 query heads of each
    assert pairs == 2 * blocks * B * B * 2
    cfg = launch.get_config("fwd", B, D, row_blocks=sel.row_blocks)
    monkeypatch.setattr(launch, "TMA_MIN_PAIRS", pairs)
    assert launch.descriptors(cfg, cfg["BN"], pairs, k, v)[0] is not None
    assert launch.descriptors(cfg, cfg["BN"], pairs - 1, k, v) == (None, None)


@pytest.mark.parametrize("cfg,tma,stages", [
    (dict(num_stages=2, TMA=True, FALLBACK_STAGES=3), True, 2),
    (dict(num_stages=2, TMA=True, FALLBACK_STAGES=3), False, 3),
    (dict(num_stages=2, TMA=False, FALLBACK_STAGES=3), False, 2),
    (dict(num_stages=2), False, 2),
], ids=["tma-runs", "tma-cannot-run", "tma-off-by-config", "no-tma-key"])
def test_pointer_fallback_takes_its_own_stages(cfg, tma, stages):
    assert launch.pipeline_stages(cfg, tma) == stages


@pytest.mark.parametrize("cfg,tma,maxnreg", [
    (dict(num_warps=4, num_stages=2, maxnreg=128), True, 128),
    (dict(num_warps=4, num_stages=2, maxnreg=128), False, None),
    (dict(num_warps=4, num_stages=2), True, None),
], ids=["tma", "pointer-tiles", "no-cap"])
def test_register_cap_holds_for_tma_tiles_only(cfg, tma, maxnreg):
    """Pointer tiles keep their addresses in registers and would spill under the cap."""
    assert launch.compile_options(cfg, tma).get("maxnreg") == maxnreg


def test_gqa_short_rows_run_a_rows_heads_together():
    """Where query heads share K/V, the short-row forward and dQ put the head on grid axis 0 (the programs
    of one row's heads run together and share the group's K/V tiles); MHA and the long-row configs keep
    their order."""
    for kind in ("fwd", "dq"):
        assert launch.get_config(kind, 128, 128, row_blocks=1)["HEAD_OUTER"]
        assert not launch.get_config(kind, 128, 128, row_blocks=1, group=8)["HEAD_OUTER"]
        assert launch.get_config(kind, 128, 128, group=8)["HEAD_OUTER"] == launch.get_config(kind, 128, 128)[
            "HEAD_OUTER"]
        assert launch.grid(launch.get_config(kind, 128, 128, row_blocks=1, group=8), 32, 10) == (32, 10)


def test_p1_equals_dense_sdpa():
    lens = [1, 47, 16, 90]
    q, k, v = qkv(lens, 4, 2, 32)
    cu = cu_of(lens)
    o, sel = sparse_attention(q, k, v, cu, p=1.0, block_size=16, return_selection=True, backend="triton",
                              options=POISON)
    torch.testing.assert_close(sel.kept_fraction, torch.ones(len(lens), device=DEV))
    torch.testing.assert_close(o, dense_causal_varlen(q, k, v, cu), atol=ATOL[torch.float32], rtol=0)


def test_naive_backend_and_default_dense():
    lens = [20, 33]
    q, k, v = qkv(lens, 2, 1, 16)
    cu = cu_of(lens)
    a = sparse_attention(q, k, v, cu, block_size=16, backend="naive")  # no budget: dense
    b = sparse_attention(q, k, v, cu, block_size=16, backend="triton", options=POISON)
    torch.testing.assert_close(a, b, atol=ATOL[torch.float32], rtol=0)
    torch.testing.assert_close(a, dense_causal_varlen(q, k, v, cu), atol=ATOL[torch.float32], rtol=0)


def test_explicit_selection_from_mask_and_determinism():
    lens = [70, 40]
    q, k, v = qkv(lens, 2, 2, 16)
    cu = cu_of(lens)
    nb = sum((n + 15) // 16 for n in lens)
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(2, nb, nb, generator=g) < 0.4).to(DEV)
    sel = selection_from_mask(mask, cu, block_size=16)
    dense = sel.to_dense_mask()
    assert dense.diagonal(dim1=1, dim2=2).all()
    check_against_naive(q, k, v, cu, sel, ATOL[torch.float32])
    o = sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=POISON)
    g2 = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    g3 = torch.autograd.grad(sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=POISON),
                             (q, k, v), torch.ones_like(o))
    assert all(torch.equal(a, b) for a, b in zip(g2, g3)), "backward is not deterministic"


@settings(max_examples=6, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=4), p=st.sampled_from([0.3, 0.7, 1.0]),
       seed=st.integers(0, 1000))
def test_random_document_splits(lens, p, seed):
    q, k, v = qkv(lens, 2, 1, 16, seed=seed)
    cu = cu_of(lens)
    sel = select_blocks(q, k, cu, p=p, block_size=16)
    check_against_naive(q, k, v, cu, sel, ATOL[torch.float32])


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
    for (h, g), lst in rows.items():
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


def test_strided_inputs():
    """Views with token/head strides (e.g. split from a fused QKV projection) and a non-unit D stride."""
    lens = [30, 19]
    T, H, D = sum(lens), 2, 16
    g = torch.Generator().manual_seed(7)
    qkv_ = torch.randn(T, 3, H, D, generator=g).to(DEV)
    q, k = qkv_[:, 0], qkv_[:, 1]
    v = torch.randn(T, D, H, generator=g).to(DEV).transpose(1, 2)  # stride(-1) != 1
    q, k, v = [x.requires_grad_() if x.is_leaf else x for x in (q, k, v)]
    cu = cu_of(lens)
    sel = select_blocks(q, k, cu, p=0.8, block_size=16)
    a = sparse_attention(q, k, v, cu, selection=sel, backend="triton", options=POISON)
    b = sparse_attention_naive(q, k, v, cu, sel)
    torch.testing.assert_close(a, b, atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("lens,Hq,Hkv", [([37, 70, 5], 2, 2), ([50, 1, 81], 4, 1)], ids=["mha-odd", "gqa4to1"])
def test_delta_prepass_matches_delta_from_dq(lens, Hq, Hkv):
    """The overlapped backward's pieces: the delta pre-pass equals the delta the dQ kernel stores, and dQ
    given that delta equals dQ computing its own, bit for bit."""
    q, k, v = [x.detach() for x in qkv(lens, Hq, Hkv, 16)]
    sel = select_blocks(q, k, cu_of(lens), p=0.7, block_size=16)
    o, lse = forward.sparse_attn_fwd(q, k, v, sel, 0.25, POISON)
    do = torch.randn_like(o)
    dq, delta = backward.sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, 0.25, options=POISON)
    pre = backward.sparse_attn_bwd_delta(o, do, POISON)
    torch.testing.assert_close(pre, delta, atol=ATOL[torch.float32], rtol=0)
    dq2, same = backward.sparse_attn_bwd_dq(do, q, k, v, o, lse, sel, 0.25, delta=delta, options=POISON)
    assert same is delta and torch.equal(dq2, dq)


# dK/dV programs (per (KV head, 64-key tile)) of a case measured on an H200 or H100 (132 SMs), block 128, and
# whether the overlap paid there (H200 unless marked H100)
@pytest.mark.parametrize("programs,pays", [
    (16 * 64 * 2, True),  # 8K dense: +6%; at kept 0.1 even (-1%, host-bound; H100 +0.8%)
    (16 * 256 * 2, False),  # 32K dense, 62 programs per SM: +1.9%, then +0.2%; kept 0.25: -1.3%
    (4 * 256 * 2, True),  # 32K kept 0.1, GQA 4:1: +2%; H100, GQA 32:4: +1-2%
    (16 * 1024 * 2, False),  # 128K kept 0.25: -0.3%
    (16 * 560 * 2, False),  # packed 64K kept 0.1: -3%
    (4 * 512 * 2, False),  # H100, packed 64K GQA 32:4, kept 0.5 / 0.1 / 0.05: -1% / -7% / -9%
    (4 * 64 * 2, True),  # H100, 8K GQA 32:4 kept 0.1 / 0.05: +22% / +21%; 16:2 (half the programs): +19%
    (4 * 16 * 2, True),  # H100, 2K GQA 32:4 dense: +28%
], ids=["8k", "32k", "32k-gqa", "128k", "packed64k", "packed64k-gqa8-h100", "8k-gqa8-h100", "2k-gqa8-h100"])
def test_overlap_rule_on_the_measured_cases(programs, pays):
    assert launch.overlap_pays(programs, 132) == pays


@pytest.mark.skipif(DEV != "cuda", reason="the side stream exists on a GPU only; CPU takes the sequential path")
def test_overlapped_backward_matches_sequential(monkeypatch):
    lens = [300, 129, 1]
    q, k, v = qkv(lens, 4, 2, 64, torch.float16)
    cu = cu_of(lens)
    sel = select_blocks(q, k, cu, p=0.9, block_size=64)
    do = torch.randn(q.shape, device=DEV, dtype=q.dtype)
    grads = {}
    for name, limit in (("sequential", 0), ("overlap", 1 << 30)):
        monkeypatch.setattr(launch, "OVERLAP_MAX_PROGRAMS_PER_SM", limit)
        assert backward.overlap_backward(q, k, sel) == (name == "overlap")
        grads[name] = torch.autograd.grad(sparse_attention(q, k, v, cu, selection=sel, options=POISON), (q, k, v),
                                          do)
    for a, b in zip(grads["sequential"], grads["overlap"]):
        torch.testing.assert_close(a, b, atol=ATOL[torch.float16], rtol=0)


SYNC_BUDGETS = [dict(kept_fraction=0.3), dict(kept_fraction=torch.tensor([0.3, 0.6, 1.0])), dict(p=0.9),
                dict(p=torch.tensor([0.5, 0.9, 1.0])), dict(p=1.0), dict()]


@pytest.mark.skipif(DEV != "cuda", reason="device syncs exist on a GPU only")
@pytest.mark.parametrize("budget", SYNC_BUDGETS, ids=["kf-float", "kf-host-tensor", "p-float", "p-host-tensor",
                                                      "p1-dense", "no-budget"])
@pytest.mark.parametrize("lens", [[300, 129, 1], [8000, 6000, 2384]], ids=["short-rows", "long-rows"])
def test_layers_never_sync(budget, lens):
    """In steady state a micro-batch's layers never wait for the GPU: its documents handed over once (a
    VarlenBatch, here from a GPU ``cu_seqlens``: its one device->host copy comes before), budgets on the host,
    then per layer select_blocks + sparse_attention forward and backward, and sparse_attention with the
    budget itself, under ``torch.cuda.set_sync_debug_mode("error")``. The runner calls it so in every layer; a
    sync per layer would stall the host's run-ahead. TMA tiles and the overlapped backward join in where
    their thresholds are met (the long-row case)."""
    T = sum(lens)
    q, k, v = qkv(lens, 8, 2, 128, torch.bfloat16)
    do = torch.randn_like(q)

    def layers(docs):
        for _ in range(2):
            sel = select_blocks(q, k, docs, block_size=128, **budget)
            torch.autograd.grad(sparse_attention(q, k, v, docs, selection=sel), (q, k, v), do)
            torch.autograd.grad(sparse_attention(q, k, v, docs, block_size=128, **budget), (q, k, v), do)

    layers(VarlenBatch.from_cu_seqlens(cu_of(lens)))  # compiles the kernels
    shifted = [lens[0] - 1, *lens[1:-1], lens[-1] + 1]  # another micro-batch: a layout never seen
    docs = VarlenBatch.from_cu_seqlens(cu_of(shifted))
    assert docs.total_tokens == T
    torch.cuda.set_sync_debug_mode("error")
    try:
        layers(docs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
