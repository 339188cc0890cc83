"""``cudnn``: torch's scaled_dot_product_attention on its cuDNN backend, dense causal, one call per document.

torch 2.11 runs cuDNN attention on nested (jagged) tensors too, but that path made an illegal memory access on
an H200 on a packed 64K batch, which poisons the CUDA context for every later call; one call per document is
what runs. cuDNN refuses a key length of 1 ("cudnn SDPA does not support key/value sequence length 1"), so a
one-token document goes to whichever SDPA backend torch picks for it.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

from .base import register, require_cuda


def per_document(q, k, v, spans: Sequence[int], sdpa_backend):
    """Causal SDPA over each document ``q[s:e]`` (``spans`` = cumulative offsets on the host) on
    ``sdpa_backend`` (a torch.nn.attention.SDPBackend; a one-token document on torch's choice), concatenated."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    sizes = [e - s for s, e in zip(spans, spans[1:], strict=False)]
    outs = []
    # split, not slices: its backward concatenates the documents' gradients once, where each slice's backward
    # would write a whole-batch gradient per document (documents x tokens of memory traffic)
    for n, qd, kd, vd in zip(sizes, *(x.split(sizes) for x in (q, k, v)), strict=True):
        qd, kd, vd = (x.transpose(0, 1)[None] for x in (qd, kd, vd))
        with sdpa_kernel(sdpa_backend) if n > 1 else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@register("cudnn")
class Cudnn:
    sparse = False
    host_work = False  # a launch per document, ahead of the GPU

    def check(self) -> None:
        import torch

        require_cuda()
        if not torch.backends.cudnn.is_available():
            raise RuntimeError("torch was built without cuDNN")

    def version(self) -> str:
        import torch

        return f"torch {torch.__version__} SDPA on cuDNN {torch.backends.cudnn.version()}, a call per document"

    def documents(self, lengths: Sequence[int], device) -> list[int]:
        spans = [0]
        for n in lengths:
            spans.append(spans[-1] + int(n))
        return spans

    def attention(self, q, k, v, docs: list[int]):
        from torch.nn.attention import SDPBackend

        return per_document(q, k, v, docs, SDPBackend.CUDNN_ATTENTION)
