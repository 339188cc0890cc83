"""``token_cap``: micro-batches filled up to a token cap, their number varying with the rank's tokens.

What verl's dynamic batch size (``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``) and Megatron's
sequence packing (``max_seqlen_per_dp_cp_rank``) do instead of a fixed micro-batch size: a rank runs
``ceil(tokens / (max_tokens_per_rank x cp))`` micro-batches (a CP group of cp GPUs holds cp times the
per-GPU cap), the same count on every DP rank when ``same_count_in_dp`` (verl's default, which keeps the
ranks in step), at least ``min_micro_batches`` (default: the pipeline depth, so the pipeline can fill)
and at most the layout's ``micro_batches``, which here is the number of slots: slots a rank does not fill
stay empty and take no time. Ranks and micro-batches are cut as ``verl`` cuts them (equal-count, then
free-count Karmarkar-Karp over verl's workload estimate) and ordered by verl's rule.

A rank whose tokens need more micro-batches than the layout has slots gets all the slots and exceeds
the cap (raise ``layout.micro_batches`` for a tight cap); a sequence longer than the cap runs alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sparsebalance.policies.base import batch_arrays
from sparsebalance.policies.verl import Verl
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.policy import register_batching
from sparsebalance.sim.workload import Request


@register_batching("token_cap")
class TokenCap(Verl):
    @dataclass(frozen=True)
    class Params(Verl.Params):
        # tokens per GPU and micro-batch (verl max_token_len, Megatron max_seqlen_per_dp_cp_rank)
        max_tokens_per_rank: int = 32768
        min_micro_batches: Optional[int] = None  # None: the pipeline depth (capped at the layout's micro-batches)
        same_count_in_dp: bool = True  # every DP rank runs the largest count any of them needs

    def __init__(self, params: Params) -> None:
        if params.max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank={params.max_tokens_per_rank} must be >= 1")
        if params.min_micro_batches is not None and params.min_micro_batches < 1:
            raise ValueError(f"min_micro_batches={params.min_micro_batches} must be >= 1")
        super().__init__(params)

    def micro_batch_counts(self, batch: list[Request], ranks: list[list[int]], layout: Layout) -> list[int]:
        lengths = batch_arrays(batch)[1]
        cap = self.params.max_tokens_per_rank * layout.cp
        need = [-(-int(lengths[members].sum()) // cap) for members in ranks]
        if self.params.same_count_in_dp:
            need = [max(need)] * len(ranks)
        least = layout.pp if self.params.min_micro_batches is None else self.params.min_micro_batches
        return [max(1, min(layout.micro_batches, max(n, least), len(members)))
                for n, members in zip(need, ranks, strict=True)]
