"""No recompilation in a training run: after a warm-up, a stream of random long-tail batches (T, documents,
budgets, both selection modes) compiles no new kernel variant.

On a GPU the count is Triton's own (``compile_count()``: its in-process caches). The interpreter compiles
nothing, so ``compile_count()`` stays 0 on a CPU; there the test computes, for every launch and every
ahead-of-time compile (``warmup``), the key under which Triton would cache the kernel compiled for an H200
(sm_90): Triton's own argument binder and cache key over the very same arguments, with the kernels'
``do_not_specialize`` lists, stand in for its in-memory cache. Pointers are specialised on 16-byte alignment
there as on the GPU (CPU and CUDA allocations are both aligned; views keep their offsets).
"""
from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
import triton
import triton.language as tl

from sparsebalance.kernels.sparse_attention import (KernelOptions, VarlenBatch, compile_count, compiled_variants,
                                                    select_blocks, sparse_attention)
from sparsebalance.kernels.sparse_attention import launch

CUDA = torch.cuda.is_available()


@pytest.fixture
def sm90_cache(monkeypatch):
    """Under the interpreter: every launch and warm-up adds the key Triton would compile it under for sm_90
    to a per-kernel set, which ``launch.cached_variants`` (hence ``compile_count()``) reads."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit
    from triton.runtime.interpreter import InterpretedFunction

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders, keys = {}, defaultdict(set)
    interpret = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        binder = binders.get(self.fn)
        if binder is None:
            spec = {k: self.kwargs.get(k) for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
            compiled_fn = jit.JITFunction(self.fn, **spec)
            binder = binders[self.fn] = jit.create_function_from_signature(compiled_fn.signature, compiled_fn.params,
                                                                            backend)
        _, specialization, options = binder(*args, **kwargs)
        keys[self.fn].add(jit.compute_cache_key({}, specialization, options))
        return interpret(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    monkeypatch.setattr(launch, "cached_variants", lambda kernel: len(keys[kernel.fn]))
    return keys


@triton.jit
def _toy(X, N):
    tl.store(X + tl.arange(0, 16), tl.zeros([16], tl.float32) + N)


@triton.jit(do_not_specialize=["N"])
def _toy_unspecialised(X, N):
    tl.store(X + tl.arange(0, 16), tl.zeros([16], tl.float32) + N)


@pytest.mark.skipif(CUDA, reason="the interpreter's stand-in for Triton's cache")
def test_the_stand_in_cache_sees_specialisation(sm90_cache):
    """The stand-in tells the variants apart that Triton compiles: an integer of 1, one divisible by 16 and
    another are three variants, one variant without specialisation; a pointer off 16-byte alignment is a
    fourth."""
    x = torch.zeros(32)
    for n in (1, 16, 17, 33):
        _toy[(1,)](x, n)
        _toy_unspecialised[(1,)](x, n)
    _toy[(1,)](x[1:], 17)
    assert len(sm90_cache[_toy.fn]) == 4 and len(sm90_cache[_toy_unspecialised.fn]) == 1


class _Variant:
    def __init__(self):
        self.loaded = False

    def _init_handles(self):
        self.loaded = True


class _Kernel:
    """A stand-in JIT kernel: a launch compiles once (its first), a warm-up returns a not yet loaded variant."""

    def __init__(self):
        self.launches, self.variants = 0, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches += 1
        return run

    def warmup(self, *args, grid, **kwargs):
        self.variants.append(_Variant())
        return self.variants[-1]


def test_a_precompiled_sibling_is_loaded_with_its_launcher_at_the_first_launch(monkeypatch):
    """The siblings a first launch compiles are also loaded (their launchers built), so that the later step
    that first takes one does not stall; a later launch that compiles nothing precompiles nothing."""
    main, sibling = _Kernel(), _Kernel()
    monkeypatch.setattr(launch, "cached_variants", lambda kernel: min(kernel.launches, 1))
    siblings = lambda: [(sibling, (), {}), (sibling, (), {})]  # noqa: E731
    launch.launch(main, (1,), (), {}, siblings)
    assert [v.loaded for v in sibling.variants] == [True, True]
    launch.launch(main, (1,), (), {}, siblings)
    assert len(sibling.variants) == 2
    launch.load(None)  # the interpreter's warm-up compiles nothing


def long_tail_lengths(g: torch.Generator, tokens: int, longest: int) -> list[int]:
    """Lognormal document lengths in [1, longest] summing to ``tokens``."""
    lens = []
    while sum(lens) < tokens:
        drawn = math.exp(math.log(longest) / 2 + 1.5 * torch.randn(1, generator=g).item())
        lens.append(max(1, min(longest, int(drawn))))
    lens[-1] -= sum(lens) - tokens
    return [n for n in lens if n > 0]


def random_budget(g: torch.Generator, n: int) -> dict:
    """Top-k or top-p, a float or one per document (on the host, as the runner hands them over), now and
    then dense."""
    mode = ("kept_fraction", "p")[int(torch.randint(2, (1,), generator=g))]
    low = 0.05 if mode == "kept_fraction" else 0.3
    kind = int(torch.randint(4, (1,), generator=g))
    if kind == 0:
        return {mode: 1.0}
    if kind == 1:
        return {mode: low + (1 - low) * torch.rand(1, generator=g).item()}
    return {mode: low + (1 - low) * torch.rand(n, generator=g)}


def train_step(g, tokens: int, longest: int, heads: tuple, D: int, B: int, dtype, options: KernelOptions,
               layers: int = 1, budget=None):
    """One micro-batch: its documents handed over once, then per layer a selection, forward and backward."""
    dev = "cuda" if CUDA else "cpu"
    data = torch.Generator(dev).manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    lens = long_tail_lengths(g, tokens, longest)
    docs = VarlenBatch.from_cu_seqlens(torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32))
    budget = random_budget(g, len(lens)) if budget is None else budget
    Hq, Hkv = heads
    for _ in range(layers):
        q, k, v = [torch.randn(tokens, h, D, generator=data, device=dev).to(dtype).requires_grad_()
                   for h in (Hq, Hkv, Hkv)]
        sel = select_blocks(q, k, docs, block_size=B, **budget, options=options)
        o = sparse_attention(q, k, v, docs, selection=sel, backend="triton", options=options)
        torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    return budget


def assert_no_compiles(before: dict, after: dict, what: str):
    new = {name: after.get(name, 0) - before.get(name, 0)
           for name in after if after.get(name, 0) != before.get(name, 0)}
    assert not new, f"{what} compiled new kernel variants: {new}"


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="the GPU test below counts Triton's real compilations")
def test_random_batches_compile_nothing_after_warm_up_interpreted(sm90_cache, monkeypatch):
    """Warm-up: one top-k and one top-p batch. Then random batches, whose row classes, tile paths (TMA or
    pointers) and budgets vary (the thresholds are lowered to the interpreter's sizes so that they do), add
    no key. The interpreter's speed limits the stream to a dozen batches; the GPU test runs 200."""
    monkeypatch.setattr(launch, "TMA_MIN_PAIRS", 30_000)
    monkeypatch.setattr(launch, "SHORT_ROW_TOKENS", 80)
    g = torch.Generator().manual_seed(0)
    fused = KernelOptions(selection="triton")
    shape = dict(heads=(4, 2), D=16, B=16, dtype=torch.float16, options=fused)
    train_step(g, 160, 120, budget={"kept_fraction": 0.3}, **shape)
    train_step(g, 96, 40, budget={"p": 0.8}, **shape)
    warm = compiled_variants()
    assert compile_count() > 0 and {"fwd", "dq", "dkdv", "select", "reverse", "doc_stats", "pool"} <= set(warm)
    seen = set()
    for _ in range(12):
        tokens = int(torch.randint(8, 240, (1,), generator=g))
        budget = train_step(g, tokens, int(torch.randint(1, tokens + 1, (1,), generator=g)), **shape)
        seen.add(next(iter(budget)))
    assert seen == {"kept_fraction", "p"}
    assert_no_compiles(warm, compiled_variants(), "a random interpreted batch")


@pytest.mark.skipif(not CUDA, reason="counts Triton's compilations on a GPU")
@pytest.mark.parametrize("heads,D,B", [((8, 2), 128, 128), ((16, 16), 64, 64)], ids=["gqa4-d128-b128", "mha-d64-b64"])
def test_random_batches_compile_nothing_after_warm_up(heads, D, B):
    """Warm-up: a few batches; then 200 random long-tail batches (256 to 16K tokens, documents of 1 token to
    the whole batch, top-k and top-p, float and per-document budgets, dense now and then), whose row classes,
    tile paths (TMA from TMA_MIN_PAIRS) and backward overlap vary: no new compilation."""
    g = torch.Generator().manual_seed(1)
    shape = dict(heads=heads, D=D, B=B, dtype=torch.bfloat16, options=KernelOptions())
    for budget in ({"kept_fraction": 0.1}, {"p": 0.9}, {"p": 1.0}):
        train_step(g, 4096, 4096, budget=budget, **shape)
    warm = compiled_variants()
    for i in range(200):
        tokens = int(torch.randint(256, 16384, (1,), generator=g))
        train_step(g, tokens, int(torch.randint(1, tokens + 1, (1,), generator=g)), **shape)
        assert_no_compiles(warm, compiled_variants(), f"random batch {i}")
