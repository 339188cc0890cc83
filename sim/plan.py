"""The Plan: what the simulator and the runner both consume for one global batch.

Plain data, no tensors; serialised with sorted keys and fixed float formatting so that
the same inputs and seed give the same bytes (the runner test compares Plans byte for byte).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

import numpy as np


@dataclass(frozen=True, slots=True)
class Budget:
    """How much attention one sequence gets.

    Three families, one per field (at most one of ``kept_fraction`` and ``top_k`` is set):

    * top-p: ``p`` is the coverage target in (0, 1]: per query block keep the fewest KV blocks whose
      routing-score mass reaches ``p`` (``p == 1`` is dense). The time depends on how the sequence's
      attention spreads, which is known only after it ran.
    * ``kept_fraction``: the fraction of causal KV blocks kept (``p`` is then ignored).
    * top-k (the paper's MoBA-style routing): ``top_k`` KV blocks per query block (every causal block of
      the rows that have fewer), so the kept blocks, and the time, follow from the length alone. With
      ``p_floor`` a row also keeps the blocks that reach routing mass ``p_floor`` (a coverage floor): more
      blocks, and time, where the attention is spread.
    """

    p: float = 1.0
    kept_fraction: float | None = None
    top_k: int | None = None
    p_floor: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"budget p={self.p!r} is outside the allowed range (0, 1]")
        if self.kept_fraction is not None and not 0.0 < self.kept_fraction <= 1.0:
            raise ValueError(
                f"budget kept_fraction={self.kept_fraction!r} is outside the allowed range (0, 1]"
            )
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"budget top_k={self.top_k!r} is not allowed; allowed: a whole number of blocks >= 1")
        if self.top_k is not None and self.kept_fraction is not None:
            raise ValueError("a budget sets kept_fraction or top_k, not both")
        if self.p_floor is not None and (self.top_k is None or not 0.0 < self.p_floor <= 1.0):
            raise ValueError(f"budget p_floor={self.p_floor!r} is not allowed; allowed: a coverage in (0, 1] "
                             "beside top_k")


@dataclass(frozen=True)
class BudgetArrays:
    """Budgets as columns, NaN where a field is unset (what CostModel.kept_fractions takes)."""

    p: np.ndarray
    kept_fraction: np.ndarray
    top_k: np.ndarray
    p_floor: np.ndarray

    @classmethod
    def of(cls, budgets) -> BudgetArrays:
        rows = np.array([(b.p, np.nan if b.kept_fraction is None else b.kept_fraction,
                          np.nan if b.top_k is None else b.top_k, np.nan if b.p_floor is None else b.p_floor)
                         for b in budgets], dtype=np.float64).reshape(-1, 4)
        return cls(*rows.T)

    @property
    def fixes_blocks(self) -> np.ndarray:
        """Where the budget fixes the kept blocks from the length (kept fraction, top-k without a floor): the
        kernel sizes its selection from the budget there (sim.memory.selection_bytes)."""
        return ~np.isnan(self.kept_fraction) | (~np.isnan(self.top_k) & np.isnan(self.p_floor))

    def kept(self, cost, lengths, sensitivities) -> np.ndarray:
        """The kept fractions these budgets give sequences of these lengths and sensitivities (broadcast)."""
        return cost.kept_fractions(lengths, sensitivities, self.p, self.kept_fraction, self.top_k, self.p_floor)


@dataclass(frozen=True, slots=True, init=False)
class Assignment:
    """One sequence placed on (dp_rank, micro_batch) with its budget (every CP shard of it runs under it).

    A Plan holds what a trainer knows before the step: ids, lengths, placement and budgets; never how a
    sequence's attention will spread (its sensitivity, the data's truth)."""

    seq_id: int
    length: int
    dp_rank: int
    micro_batch: int
    budget: Budget = Budget()

    def __init__(self, seq_id: int, length: int, dp_rank: int, micro_batch: int, budget: Budget = Budget()) -> None:
        # Written out instead of generated: a frozen dataclass's __init__ stores every field through
        # object.__setattr__, and every step builds two Assignments per sequence (batching, then the
        # budgets). Storing through the slot descriptors is ~40% cheaper and the class stays frozen.
        seq_id_, length_, dp_rank_, micro_batch_, budget_ = _ASSIGNMENT_SLOTS
        seq_id_(self, seq_id)
        length_(self, length)
        dp_rank_(self, dp_rank)
        micro_batch_(self, micro_batch)
        budget_(self, budget)


# The slot descriptors' setters in field order (the test suite checks that __init__ takes exactly these fields).
_ASSIGNMENT_SLOTS = tuple(Assignment.__dict__[f.name].__set__ for f in fields(Assignment))


@dataclass(frozen=True, slots=True)
class Plan:
    """Assignment of one global batch: sequence -> (dp_rank, micro_batch) and a budget each."""

    step: int
    dp: int
    micro_batches: int
    assignments: tuple[Assignment, ...]

    def micro_batch(self, dp_rank: int, micro_batch: int) -> tuple[Assignment, ...]:
        """Assignments of one (rank, micro-batch), in plan order."""
        return tuple(
            a for a in self.assignments if a.dp_rank == dp_rank and a.micro_batch == micro_batch
        )

    def with_budgets(self, budgets: dict[int, Budget]) -> Plan:
        """A copy with the budgets of the given sequence ids replaced."""
        # Direct construction: dataclasses.replace is ~8x slower and this runs for every sequence of every step.
        return replace(
            self,
            assignments=tuple(
                Assignment(a.seq_id, a.length, a.dp_rank, a.micro_batch,
                           budgets.get(a.seq_id, a.budget))
                for a in self.assignments
            ),
        )

    def to_json(self) -> str:
        raw = asdict(self)
        for a in raw["assignments"]:  # unset budget fields stay out, so top-p plans read as before
            a["budget"] = {k: v for k, v in a["budget"].items() if v is not None or k == "kept_fraction"}
        return json.dumps(raw, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        raw = json.loads(text)
        assignments = tuple(_assignment_from_json(a) for a in raw["assignments"])
        return cls(
            step=raw["step"],
            dp=raw["dp"],
            micro_batches=raw["micro_batches"],
            assignments=assignments,
        )


def _assignment_from_json(a: dict) -> Assignment:
    """An Assignment from its JSON object. Plans of earlier versions carry an empty ``cp_budgets`` list (a
    per-CP-shard budget that no policy set), which reads as nothing; a non-empty one is rejected rather than
    ignored, since every shard runs under the one ``budget``. Their ``sensitivity`` (the data's truth, which
    plans no longer carry) is dropped."""
    fields_ = dict(a)
    fields_.pop("sensitivity", None)
    legacy = fields_.pop("cp_budgets", [])
    if legacy:
        raise ValueError(f"assignment of sequence {fields_.get('seq_id')!r} has cp_budgets={legacy!r}; "
                         "per-CP-shard budgets are not supported (every shard runs under the one budget)")
    return Assignment(**{**fields_, "budget": Budget(**fields_["budget"])})
