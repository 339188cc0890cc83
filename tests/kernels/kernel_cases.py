"""What the kernel tests share: the device, the tolerances, the kernel options they run under, inputs of odd
shapes (documents of given lengths, their offsets), and the check of the Triton kernels against the reference."""
from __future__ import annotations

import pytest
import torch

from sparsebalance.kernels.sparse_attention import KernelOptions, launch, sparse_attention, sparse_attention_naive

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
    for name, a, b in zip(("dq", "dk", "dv"), g, gr, strict=True):
        assert torch.isfinite(a).all(), f"{name}: missed write"
        torch.testing.assert_close(a.float(), b, atol=atol, rtol=0, msg=name)
    return o, g
