"""kernels.backends on a machine without a GPU or the peers: the registry, one line per absent backend, and each
backend's varlen plumbing against the dense causal reference (cuDNN's per-document split on torch's math
backend, FlashAttention's call through a stand-in with its signature)."""
from __future__ import annotations

import types

import pytest
import torch

from benchmarks.attention import fair
from sparsebalance.kernels import backends
from sparsebalance.kernels.backends import BackendAbsent, load, load_all
from sparsebalance.kernels.backends.cudnn import Cudnn, per_document
from sparsebalance.kernels.backends.flash import FlashAttention4
from sparsebalance.kernels.sparse_attention import dense_causal_varlen

LENGTHS = [5, 17, 1, 33]


def qkv(hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    return [torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv)]


def test_registry_lists_ours_first_and_the_peers():
    assert list(backends.BACKENDS) == ["ours", "cudnn", "fa4", "fa3", "fa4_sparse"]
    assert [backends.BACKENDS[n].sparse for n in backends.BACKENDS] == [True, False, False, False, True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the absent lines of a machine without a GPU")
def test_absent_backends_are_one_line_each():
    loaded, absent = load_all()
    assert list(loaded) == ["ours"]
    assert absent[0] == "cudnn: absent (RuntimeError: no CUDA GPU here)"
    assert absent[1].startswith("fa4: absent (ModuleNotFoundError: No module named 'flash_attn")
    assert absent[2] == "fa3: absent (ModuleNotFoundError: No module named 'flash_attn_interface')"
    assert absent[3].startswith("fa4_sparse: absent (ModuleNotFoundError: No module named 'flash_attn")
    assert all("\n" not in line for line in absent)
    with pytest.raises(BackendAbsent, match=r"^fa4: absent \(ModuleNotFoundError"):
        load("fa4")
    with pytest.raises(BackendAbsent, match=r"^fa4: absent"):  # the fair benchmark's column records this line
        fair.peer_fns({}, "fa4", (*qkv(), None, None, LENGTHS), None)


def test_unknown_backend_names_the_allowed_ones():
    with pytest.raises(ValueError, match="'flash' is unknown; allowed: ours, cudnn, fa4, fa3, fa4_sparse"):
        load("flash")


def test_ours_dense_is_causal_attention_per_document():
    q, k, v = qkv()
    ours = load("ours")
    ours.block_size = 16  # small documents; the calibrated size is 128
    docs = ours.documents(LENGTHS, "cpu")
    expected = dense_causal_varlen(q, k, v, backends.cu_seqlens(LENGTHS))
    torch.testing.assert_close(ours.attention(q, k, v, docs), expected, rtol=1e-5, atol=1e-5)
    assert "triton" in ours.version()


def test_ours_selects_and_attends_on_a_selection():
    q, k, v = qkv()
    ours = load("ours")
    ours.block_size = 16
    docs = ours.documents(LENGTHS, "cpu")
    sel = ours.select(q, k, docs, kept_fraction=0.5)
    assert sel.block_size == 16 and float(sel.kept_fraction[-1]) < 1.0
    torch.testing.assert_close(ours.attention(q, k, v, docs, selection=sel),
                               ours.attention(q, k, v, docs, kept_fraction=0.5), rtol=1e-6, atol=1e-6)


def test_cudnn_splits_documents_and_groups_heads_as_the_reference():
    """The per-document split on torch's math backend (cuDNN needs a GPU): the same function the backend runs,
    GQA included, a one-token document included, gradients to every input."""
    from torch.nn.attention import SDPBackend

    q, k, v = (x.requires_grad_() for x in qkv())
    spans = Cudnn().documents(LENGTHS, "cpu")
    assert spans == [0, 5, 22, 23, 56]
    out = per_document(q, k, v, spans, SDPBackend.MATH)
    torch.testing.assert_close(out, dense_causal_varlen(q, k, v, backends.cu_seqlens(LENGTHS)), rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g.abs().sum() > 0 for g in grads)


def test_flash_attention_gets_device_offsets_the_longest_length_and_causal():
    seen = {}

    def varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        seen.update(cu=cu_seqlens_q.tolist(), same=cu_seqlens_q is cu_seqlens_k, dtype=cu_seqlens_q.dtype,
                    longest=(max_seqlen_q, max_seqlen_k), causal=causal)
        return dense_causal_varlen(q, k, v, cu_seqlens_q), torch.zeros(q.shape[1], q.shape[0])  # (out, lse)

    fa4 = FlashAttention4()
    fa4.varlen = varlen  # what check() imports from flash_attn.cute.interface
    q, k, v = qkv()
    out = fa4.attention(q, k, v, fa4.documents(LENGTHS, "cpu"))
    assert seen == dict(cu=[0, 5, 22, 23, 56], same=True, dtype=torch.int32, longest=(33, 33), causal=True)
    torch.testing.assert_close(out, dense_causal_varlen(q, k, v, backends.cu_seqlens(LENGTHS)))
    assert fa4.version().startswith("flash-attn-4 ")


def test_a_backend_whose_package_is_missing_reports_it(monkeypatch):
    missing = types.ModuleType("flash_attn_interface")  # installed without the function: an ImportError too
    monkeypatch.setitem(__import__("sys").modules, "flash_attn_interface", missing)
    with pytest.raises(BackendAbsent, match=r"^fa3: absent \(ImportError: flash_attn_interface has no flash_attn_varl"):
        load("fa3")


def test_cudnn_documents_share_one_gradient_concatenation():
    """The documents come from one split, whose backward concatenates their gradients once; a slice per document
    would write a whole-batch gradient per document (documents x tokens of memory traffic)."""
    from torch.nn.attention import SDPBackend

    q, k, v = (x.requires_grad_() for x in qkv())
    out = per_document(q, k, v, Cudnn().documents(LENGTHS, "cpu"), SDPBackend.MATH)
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_fn for next_fn, _ in node.next_functions)
    names = {type(node).__name__ for node in seen}
    assert any(n.startswith("SplitWithSizesBackward") for n in names)
    assert not any(n.startswith("SliceBackward") for n in names)
