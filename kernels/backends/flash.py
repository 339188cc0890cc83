"""``fa4`` and ``fa3``: FlashAttention's dense varlen kernels, one call per micro-batch.

FlashAttention-4 is the ``flash-attn-4`` package (``flash_attn.cute``, CUTLASS's Python DSL, compiled on first
use); FlashAttention-3 is ``flash_attn_interface``, built from the flash-attention repository's ``hopper``
directory (no wheel). Both take the documents as device ``cu_seqlens`` and the longest length.
"""
from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Sequence

from .base import cu_seqlens, register, require_cuda


class _Varlen:
    sparse = False
    host_work = False
    module = ""  # the peer's module
    packages: tuple[str, ...] = ()  # distributions whose versions a calibration records

    def check(self) -> None:
        module = importlib.import_module(self.module)
        if not hasattr(module, "flash_attn_varlen_func"):
            raise ImportError(f"{self.module} has no flash_attn_varlen_func (a version this wrapper does not know)")
        self.varlen = module.flash_attn_varlen_func
        require_cuda()

    def version(self) -> str:
        return ", ".join(installed(p) for p in self.packages)

    def documents(self, lengths: Sequence[int], device) -> tuple:
        return cu_seqlens(lengths).to(device), int(max(lengths))

    def attention(self, q, k, v, docs: tuple):
        cu, longest = docs
        out = self.varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                          causal=True)
        return out[0] if isinstance(out, tuple) else out  # (out, lse) in flash-attn-4


def installed(package: str) -> str:
    """``<package> <version>``, as a calibration records it."""
    try:
        return f"{package} {version(package)}"
    except PackageNotFoundError:
        return f"{package} (version unknown: not installed as a distribution)"


@register("fa4")
class FlashAttention4(_Varlen):
    module = "flash_attn.cute.interface"
    packages = ("flash-attn-4", "nvidia-cutlass-dsl")


@register("fa3")
class FlashAttention3(_Varlen):
    module = "flash_attn_interface"
    packages = ("flash_attn_3",)
