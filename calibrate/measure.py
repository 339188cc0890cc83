"""Timing the terms of one grid point with the real kernel and the runner's transformer layer.

``kernel`` is anything with the pinned API of ``kernels.sparse_attention`` (``select_blocks``,
``sparse_attention``) and ``attention`` the runner's attention callable (``runner.attention.make_attention``)
that whole layers use; ``backends`` the peer attention backends (``kernels.backends``, by name, dense or
sparse) whose points the grid has; tests pass CPU stand-ins. Features are fitted on the kept fractions the kernel
actually realised (the diagonal block is always kept, counts round), so those are what the rows record.

Inputs are handed over as the runner does: the documents once per micro-batch (``VarlenBatch``), budgets
on the host.
"""
from __future__ import annotations

from typing import Callable

import torch

from sparsebalance.calibrate.grid import GridPoint, estimate_term_ms
from sparsebalance.calibrate.timing import Timing
from sparsebalance.model import Block, packed_positions, rope_angles
from sparsebalance.sim.backends import OURS
from sparsebalance.sim.shapes import ModelShape

Bench = Callable[..., Timing]


class Measurer:
    def __init__(
        self,
        shapes: list[ModelShape],
        kernel,
        attention: Callable,
        bench: Bench,
        device: str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        block_size: int = 64,
        seed: int = 0,
        backends: dict | None = None,
    ):
        self.shapes = {s.name: s for s in shapes}
        self.kernel = kernel
        self.attention = attention
        self.bench = bench
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.seed = seed
        self.backends = backends or {}
        self._blocks: dict[str, Block] = {}

    def measure(self, point: GridPoint) -> list[dict]:
        """Rows for the store, one per term of the point."""
        by_kind = {"attn": self._attention, "layer": self._layer, "layer_full": self._layer_full}
        timings, kept = (by_kind[point.kind] if point.backend == OURS else self._peer)(point)
        return [_row(point, term, timings[term], kept) for term in point.terms]

    # -- inputs -------------------------------------------------------------------------------------
    def _randn(self, *shape: int) -> torch.Tensor:
        # Random data, never zeros: zeros run measurably faster on the tensor cores than real data.
        return torch.randn(*shape, device=self.device, dtype=self.dtype)

    # cu_seqlens and budgets on the host, as the runner hands them to the attention (runner/data.py): the
    # kernel reads their values there, and device copies would add syncs that training does not have
    def _cu_seqlens(self, lengths: tuple[int, ...]) -> torch.Tensor:
        ends = torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return torch.cat([ends.new_zeros(1), ends])

    def _host(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)

    def _kept(self, point: GridPoint) -> torch.Tensor:
        return self._host(point.kept_fractions)

    def _expected(self, term: str, point: GridPoint) -> float:
        return estimate_term_ms(term, point, self.shapes[point.model])

    def _backward(self, out, grad_out, expected_ms: float, leaves) -> Timing:
        """The backward of ``out`` alone, its graph kept for the next repetition."""
        return self.bench(lambda: out.backward(grad_out, retain_graph=True), expected_ms, grad_to_none=leaves)

    # -- terms --------------------------------------------------------------------------------------
    def _attention(self, point: GridPoint) -> tuple[dict[str, Timing], tuple[float, ...]]:
        s = self.shapes[point.model]
        torch.manual_seed(self.seed)
        q = self._randn(point.tokens, s.heads, s.head_dim).requires_grad_()
        k = self._randn(point.tokens, s.kv_heads, s.head_dim).requires_grad_()
        v = self._randn(point.tokens, s.kv_heads, s.head_dim).requires_grad_()
        docs, kept = self.kernel.VarlenBatch.from_cu_seqlens(self._cu_seqlens(point.lengths)), self._kept(point)
        bs, K = self.block_size, self.kernel

        def select():
            with torch.no_grad():
                return K.select_blocks(q, k, docs, kept_fraction=kept, block_size=bs)

        sel = select()

        def forward():
            return K.sparse_attention(q, k, v, docs, selection=sel)

        out = forward()
        grad_out = torch.randn_like(out)
        timings = {"select": self.bench(select, self._expected("select", point)),
                   "attn_fwd": self.bench(forward, self._expected("attn_fwd", point))}
        timings["attn_bwd"] = self._backward(out, grad_out, self._expected("attn_bwd", point), [q, k, v])
        return timings, tuple(sel.kept_fraction.tolist())

    def _peer(self, point: GridPoint) -> tuple[dict[str, Timing], tuple[float, ...]]:
        """A peer's forward and backward over the point's documents, handed over once as for every layer of a
        micro-batch: a dense peer's over every causal block; a sparse peer's over the blocks its selection (ours,
        at the point's kept fractions) keeps, selected once and not timed (ours' ``select`` term prices it), and
        the kept fractions it realised are what the rows record.

        A compiled peer (``fa4_sparse``) would donate its saved buffers to a single backward, which the timing
        runs again and again on one graph (``retain_graph``); so it compiles here without donation, which
        changes its memory, not its kernels."""
        import torch._functorch.config

        with torch._functorch.config.patch(donated_buffer=False):
            return self._peer_timings(point)

    def _peer_timings(self, point: GridPoint) -> tuple[dict[str, Timing], tuple[float, ...]]:
        s, backend = self.shapes[point.model], self.backends[point.backend]
        torch.manual_seed(self.seed)
        q = self._randn(point.tokens, s.heads, s.head_dim).requires_grad_()
        k = self._randn(point.tokens, s.kv_heads, s.head_dim).requires_grad_()
        v = self._randn(point.tokens, s.kv_heads, s.head_dim).requires_grad_()
        docs = backend.documents(point.lengths, self.device)
        selection, kept = {}, point.kept_fractions
        if backend.sparse:
            if backend.block_size != self.block_size:
                raise ValueError(f"backend {point.backend}: block size {backend.block_size}, the calibration's "
                                 f"{self.block_size}")
            with torch.no_grad():
                selection = {"selection": backend.select(q, k, docs, kept_fraction=self._kept(point))}
            kept = tuple(selection["selection"].kept_fraction.tolist())

        def forward():
            return backend.attention(q, k, v, docs, **selection)

        out = forward()
        grad_out = torch.randn_like(out)
        timings = {"attn_fwd": self.bench(forward, self._expected("attn_fwd", point))}
        timings["attn_bwd"] = self._backward(out, grad_out, self._expected("attn_bwd", point), [q, k, v])
        return timings, kept

    def _layer(self, point: GridPoint) -> tuple[dict[str, Timing], tuple[float, ...]]:
        """The layer's non-attention work: the runner's Block with a pass-through in place of attention; its
        forward and backward timed apart (the fitted terms) and in one call (``layer_step``), as a whole layer
        runs them, so that a whole layer's gap to its parts splits into this work's and the attention's."""
        block, x, cu, rotary = self._block_inputs(point)
        budgets = (self._host([1.0] * len(point.lengths)), None)
        leaves = [x, *block.parameters()]

        def forward():
            return block(x, rotary, cu, budgets, _pass_through)[0]

        y = forward()
        grad_y = torch.randn_like(y)

        def step():
            forward().backward(grad_y)

        timings = {"layer_fwd": self.bench(forward, self._expected("layer_fwd", point))}
        timings["layer_bwd"] = self._backward(y, grad_y, self._expected("layer_bwd", point), leaves)
        timings["layer_step"] = self.bench(step, self._expected("layer_step", point), grad_to_none=leaves)
        return timings, point.kept_fractions

    def _layer_full(self, point: GridPoint) -> tuple[dict[str, Timing], tuple[float, ...]]:
        """Forward and backward of a whole layer through the runner's attention path (selection included).

        The kept fractions are read after timing: a device-to-host read inside the timed step would add
        a synchronisation that training does not have.
        """
        block, x, cu, rotary = self._block_inputs(point)
        budgets = (self._host([1.0] * len(point.lengths)), self._kept(point))
        y, kept, _ = block(x, rotary, cu, budgets, self.attention)
        grad_y = torch.randn_like(y)

        def step():
            block(x, rotary, cu, budgets, self.attention)[0].backward(grad_y)

        timing = self.bench(step, self._expected("layer_full", point), grad_to_none=[x, *block.parameters()])
        return {"layer_full": timing}, tuple(kept.tolist())

    def _block_inputs(self, point: GridPoint):
        """The model's Block (built once per model), a random input and the RoPE angles.

        RoPE angles are computed once per model forward and shared by all layers, so they stay outside
        the timed call, as in the runner.
        """
        shape = self.shapes[point.model]
        if point.model not in self._blocks:
            torch.manual_seed(self.seed)
            block = Block(shape).to(device=self.device, dtype=self.dtype)
            self._blocks[point.model] = block
        torch.manual_seed(self.seed)
        x = self._randn(point.tokens, shape.hidden).requires_grad_()
        cu = self._cu_seqlens(point.lengths)
        rotary = rope_angles(packed_positions(cu.to(self.device), point.tokens), shape.head_dim, shape.rope_theta)
        return self._blocks[point.model], x, self.kernel.VarlenBatch.from_cu_seqlens(cu), rotary


class _PassThrough(torch.autograd.Function):
    """Attention stand-in: returns a copy of q, sends the gradient back to q and none to k and v."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _pass_through(q, k, v, cu_seqlens, budgets):
    """The runner's attention signature; the copy is the only work, so the layer times exclude attention."""
    ones = torch.ones(len(budgets[0]), device=q.device)
    return _PassThrough.apply(q, k, v), ones, ones


def _row(point: GridPoint, term: str, t: Timing, kept: tuple[float, ...]) -> dict:
    return {
        "key": point.key,
        "term": term,
        "split": point.split,
        "model": point.model,
        "lengths": ";".join(map(str, point.lengths)),
        "kept_fractions": ";".join(f"{f:.6g}" for f in kept),
        "median_ms": f"{t.median_ms:.6g}",
        "p20_ms": f"{t.p20_ms:.6g}",
        "p80_ms": f"{t.p80_ms:.6g}",
        "reps": t.reps,
    }
