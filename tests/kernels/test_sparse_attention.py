"""kernels.sparse_attention: Triton kernels (interpreter on CPU) against the PyTorch reference.

Tolerances (absolute, on unit-normal inputs, outputs and gradients of order 1):
  float32: 2e-5 — interpreter dots are numpy fp32; the only differences are summation order and the
           online-softmax rescaling (observed ~1e-6).
  float16: 5e-3 — inputs and P/dS are rounded to fp16 (eps 1e-3) before each dot; accumulation is fp32.
bf16 is not testable in the interpreter (tl.dot on bf16 reads raw bits, triton#11584) and is checked on the
GPU by ``python -m benchmarks.attention --check`` (results in results/attention/attention_h200_check.csv).
"""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsebalance.kernels.sparse_attention import (VarlenBatch, dense_causal_varlen, select_blocks,
                                                    selection_from_mask, sparse_attention, sparse_attention_naive)
from sparsebalance.kernels.sparse_attention import backward, forward, launch

from kernel_cases import ATOL, DEV, POISON, check_against_naive, cu_of, poisoned, qkv
from kernel_cases import _tma_on_small_launches  # noqa: F401  (autouse)


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
        for a, b in zip(out[0], other, strict=True):
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
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *g), (clean, *g_clean), strict=True):
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
    for a, b in zip(result["grads"], ref, strict=True):
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
    assert all(torch.equal(a, b) for a, b in zip(g2, g3, strict=True)), "backward is not deterministic"


@settings(max_examples=6, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=4), p=st.sampled_from([0.3, 0.7, 1.0]),
       seed=st.integers(0, 1000))
def test_random_document_splits(lens, p, seed):
    q, k, v = qkv(lens, 2, 1, 16, seed=seed)
    cu = cu_of(lens)
    sel = select_blocks(q, k, cu, p=p, block_size=16)
    check_against_naive(q, k, v, cu, sel, ATOL[torch.float32])


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
    for a, b in zip(grads["sequential"], grads["overlap"], strict=True):
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
