"""The Plan: what the simulator and the runner both consume for one global batch.

Plain data, no tensors; serialised with sorted keys and fixed float formatting so that
the same inputs and seed give the same bytes (the runner test compares Plans byte for byte).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True, slots=True)
class Budget:
    """How much attention one sequence gets.

    ``p`` is the coverage target in (0, 1]: per query block keep the fewest KV blocks whose
    routing-score mass reaches ``p`` (``p == 1`` is dense). ``kept_fraction``, when set,
    fixes the fraction of causal KV blocks kept instead and ``p`` is then ignored.
    """

    p: float = 1.0
    kept_fraction: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"budget p={self.p!r} is outside the allowed range (0, 1]")
        if self.kept_fraction is not None and not 0.0 < self.kept_fraction <= 1.0:
            raise ValueError(
                f"budget kept_fraction={self.kept_fraction!r} is outside the allowed range (0, 1]"
            )


@dataclass(frozen=True, slots=True, init=False)
class Assignment:
    """One sequence placed on (dp_rank, micro_batch) with its budget (every CP shard of it runs under it)."""

    seq_id: int
    length: int
    sensitivity: float
    dp_rank: int
    micro_batch: int
    budget: Budget = Budget()

    def __init__(self, seq_id: int, length: int, sensitivity: float, dp_rank: int, micro_batch: int,
                 budget: Budget = Budget()) -> None:
        # Written out instead of generated: a frozen dataclass's __init__ stores every field through
        # object.__setattr__, and every step builds two Assignments per sequence (batching, then the
        # budgets). Storing through the slot descriptors is ~40% cheaper and the class stays frozen.
        seq_id_, length_, sensitivity_, dp_rank_, micro_batch_, budget_ = _ASSIGNMENT_SLOTS
        seq_id_(self, seq_id)
        length_(self, length)
        sensitivity_(self, sensitivity)
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
                Assignment(a.seq_id, a.length, a.sensitivity, a.dp_rank, a.micro_batch,
                           budgets.get(a.seq_id, a.budget))
                for a in self.assignments
            ),
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

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
    ignored, since every shard runs under the one ``budget``."""
    fields_ = dict(a)
    legacy = fields_.pop("cp_budgets", [])
    if legacy:
        raise ValueError(f"assignment of sequence {fields_.get('seq_id')!r} has cp_budgets={legacy!r}; "
                         "per-CP-shard budgets are not supported (every shard runs under the one budget)")
    return Assignment(**{**fields_, "budget": Budget(**fields_["budget"])})
