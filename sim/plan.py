"""The Plan: what the simulator and the runner both consume for one global batch.

Plain data (numpy columns, no tensors); serialised with sorted keys and fixed float formatting so that
the same inputs and seed give the same bytes (the runner test compares Plans byte for byte).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property

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


@dataclass(frozen=True, eq=False)
class BudgetArrays:
    """Budgets as columns, NaN where a field is unset (what CostModel.kept_fractions takes). The columns are
    read-only float64 copies, so a Plan that holds them stays as it was built."""

    p: np.ndarray
    kept_fraction: np.ndarray
    top_k: np.ndarray
    p_floor: np.ndarray

    def __post_init__(self) -> None:
        for f in fields(self):
            column = np.array(getattr(self, f.name), dtype=np.float64)
            column.setflags(write=False)
            object.__setattr__(self, f.name, column)

    @classmethod
    def of(cls, budgets) -> BudgetArrays:
        rows = np.array([(b.p, np.nan if b.kept_fraction is None else b.kept_fraction,
                          np.nan if b.top_k is None else b.top_k, np.nan if b.p_floor is None else b.p_floor)
                         for b in budgets], dtype=np.float64).reshape(-1, 4)
        return cls(*rows.T)

    @classmethod
    def uniform(cls, budget: Budget, n: int) -> BudgetArrays:
        """``n`` rows of one budget."""
        return cls.of([budget]).take(np.zeros(n, dtype=np.int64))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BudgetArrays):
            return NotImplemented
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name), equal_nan=True)
                   for f in fields(self))

    def __len__(self) -> int:
        return self.p.size

    def take(self, index) -> BudgetArrays:
        """The rows at ``index`` (an index array: reordered, repeated or a subset)."""
        return BudgetArrays(*(getattr(self, f.name)[index] for f in fields(self)))

    def put(self, index, rows: BudgetArrays) -> BudgetArrays:
        """A copy with the rows at ``index`` replaced by ``rows``."""
        columns = [getattr(self, f.name).copy() for f in fields(self)]
        for column, f in zip(columns, fields(self), strict=True):
            column[index] = getattr(rows, f.name)
        return BudgetArrays(*columns)

    def budgets(self) -> list[Budget]:
        """One Budget per row (rows alike share one object)."""
        top_k = [None if k != k else int(k) for k in self.top_k.tolist()]  # k != k: NaN, unset
        kept, p_floor = ([None if x != x else x for x in column.tolist()] for column in (self.kept_fraction,
                                                                                         self.p_floor))
        made: dict[tuple, Budget] = {}
        out = []
        for row in zip(self.p.tolist(), kept, top_k, p_floor, strict=True):
            budget = made.get(row)
            if budget is None:
                budget = made[row] = Budget(*row)
            out.append(budget)
        return out

    @property
    def fixes_blocks(self) -> np.ndarray:
        """Where the budget fixes the kept blocks from the length (kept fraction, top-k without a floor): the
        kernel sizes its selection from the budget there (sim.memory.selection_bytes)."""
        return ~np.isnan(self.kept_fraction) | (~np.isnan(self.top_k) & np.isnan(self.p_floor))

    def kept(self, cost, lengths, sensitivities) -> np.ndarray:
        """The kept fractions these budgets give sequences of these lengths and sensitivities (broadcast)."""
        return cost.kept_fractions(lengths, sensitivities, self.p, self.kept_fraction, self.top_k, self.p_floor)


@dataclass(frozen=True, slots=True)
class Assignment:
    """One sequence placed on (dp_rank, micro_batch) with its budget (every CP shard of it runs under it): one
    row of a Plan.

    A Plan holds what a trainer knows before the step: ids, lengths, placement and budgets; never how a
    sequence's attention will spread (its sensitivity, the data's truth)."""

    seq_id: int
    length: int
    dp_rank: int
    micro_batch: int
    budget: Budget = Budget()
    # Dynamic CP: the CP group the sequence runs on, its consecutive ranks of the dp x cp domain (domain rank
    # cp_rank + cp * dp_rank); None: its DP rank's whole CP group (static CP).
    cp_ranks: tuple[int, ...] | None = None


@dataclass(frozen=True, eq=False)
class Plan:
    """Assignment of one global batch: sequence -> (dp_rank, micro_batch) and a budget each, as columns in plan
    order (one row per sequence, listed by (rank, micro-batch); inside a micro-batch, in execution order).

    The columns are read-only int64 copies (``budgets``: float64, NaN where a field is unset); ``assignments``
    gives the same rows as Assignment objects, for code that iterates them.

    ``cp_first``/``cp_size`` (dynamic CP, both or neither): each sequence's CP group, ranks ``cp_first`` to
    ``cp_first + cp_size - 1`` of the dp x cp domain, ``cp_size`` a power of two that divides ``cp_first``;
    None: every sequence on its DP rank's whole CP group (static CP)."""

    step: int
    dp: int
    micro_batches: int
    seq_ids: np.ndarray
    lengths: np.ndarray
    dp_ranks: np.ndarray
    micro_batch_ids: np.ndarray
    budgets: BudgetArrays
    cp_first: np.ndarray | None = None
    cp_size: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.cp_first is None) != (self.cp_size is None):
            raise ValueError("a plan sets both cp_first and cp_size (dynamic CP) or neither (static CP)")
        for name in self.columns:
            column = np.array(getattr(self, name), dtype=np.int64).reshape(-1)
            column.setflags(write=False)
            object.__setattr__(self, name, column)
        sizes = {getattr(self, name).size for name in self.columns} | {len(self.budgets)}
        if len(sizes) > 1:
            raise ValueError(f"plan columns of different sizes {sorted(sizes)}: "
                             f"{', '.join(self.columns)} and budgets need one row per sequence")
        if self.dynamic_cp:
            size, first = self.cp_size, self.cp_first
            bad = np.flatnonzero((size < 1) | (size & (size - 1) != 0) | (first < 0)
                                 | (first % np.maximum(size, 1) != 0))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"sequence {int(self.seq_ids[i])} has the CP group of {int(size[i])} ranks from "
                                 f"domain rank {int(first[i])}; allowed: a power of two of ranks from a rank it "
                                 "divides")

    @property
    def dynamic_cp(self) -> bool:
        return self.cp_first is not None

    @property
    def columns(self) -> tuple[str, ...]:
        """The int64 columns this plan has."""
        return COLUMNS + CP_COLUMNS if self.dynamic_cp else COLUMNS

    @classmethod
    def of(cls, step: int, dp: int, micro_batches: int, assignments) -> Plan:
        """A Plan from its Assignments, in plan order."""
        rows = tuple(assignments)
        n = len(rows)
        groups = {a.cp_ranks is None for a in rows}
        if len(groups) > 1:
            raise ValueError("some assignments carry cp_ranks and some do not; a plan is static or dynamic CP")
        cp_first = cp_size = None
        if groups == {False}:
            cp_first, cp_size = (np.array(column, dtype=np.int64).reshape(-1)
                                 for column in zip(*(group_span(a) for a in rows), strict=True))
        return cls(step, dp, micro_batches,
                   np.fromiter((a.seq_id for a in rows), dtype=np.int64, count=n),
                   np.fromiter((a.length for a in rows), dtype=np.int64, count=n),
                   np.fromiter((a.dp_rank for a in rows), dtype=np.int64, count=n),
                   np.fromiter((a.micro_batch for a in rows), dtype=np.int64, count=n),
                   BudgetArrays.of(a.budget for a in rows), cp_first, cp_size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return ((self.step, self.dp, self.micro_batches) == (other.step, other.dp, other.micro_batches)
                and self.columns == other.columns
                and all(np.array_equal(getattr(self, name), getattr(other, name)) for name in self.columns)
                and self.budgets == other.budgets)

    def __len__(self) -> int:
        return self.seq_ids.size

    @cached_property
    def assignments(self) -> tuple[Assignment, ...]:
        """The rows as Assignments, in plan order (built once, on first use)."""
        groups = ([tuple(range(f, f + c)) for f, c in zip(self.cp_first.tolist(), self.cp_size.tolist(), strict=True)]
                  if self.dynamic_cp else [None] * len(self))
        return tuple(map(Assignment, self.seq_ids.tolist(), self.lengths.tolist(), self.dp_ranks.tolist(),
                         self.micro_batch_ids.tolist(), self.budgets.budgets(), groups))

    def micro_batch(self, dp_rank: int, micro_batch: int) -> tuple[Assignment, ...]:
        """Assignments of one (rank, micro-batch), in plan order."""
        rows = self.assignments
        return tuple(rows[i] for i in np.flatnonzero((self.dp_ranks == dp_rank)
                                                      & (self.micro_batch_ids == micro_batch)).tolist())

    def partitions(self) -> list[list[list[int]]]:
        """The sequence ids of each (rank, micro-batch), ``[rank][micro_batch]``, in execution order: what
        verl-style trainers take (with plain lengths planned at step 0, an id is the length's index)."""
        out: list[list[list[int]]] = [[[] for _ in range(self.micro_batches)] for _ in range(self.dp)]
        for seq_id, rank, mb in zip(self.seq_ids.tolist(), self.dp_ranks.tolist(), self.micro_batch_ids.tolist(),
                                    strict=True):
            out[rank][mb].append(seq_id)
        return out

    def with_budgets(self, budgets: dict[int, Budget]) -> Plan:
        """A copy with the budgets of the given sequence ids replaced."""
        ids = self.seq_ids.tolist()
        rows = [i for i, seq_id in enumerate(ids) if seq_id in budgets]
        return replace(self, budgets=self.budgets.put(rows, BudgetArrays.of(budgets[ids[i]] for i in rows)))

    def placed(self, dp_ranks: np.ndarray, micro_batch_ids: np.ndarray) -> Plan:
        """The plan with its i-th sequence on (dp_ranks[i], micro_batch_ids[i]), listed by (rank, micro-batch);
        sequences that share a micro-batch keep their order (a stable sort)."""
        dp_ranks = np.asarray(dp_ranks, dtype=np.int64)
        micro_batch_ids = np.asarray(micro_batch_ids, dtype=np.int64)
        order = np.lexsort((micro_batch_ids, dp_ranks))
        cp = (self.cp_first[order], self.cp_size[order]) if self.dynamic_cp else (None, None)
        return Plan(self.step, self.dp, self.micro_batches, self.seq_ids[order], self.lengths[order],
                    dp_ranks[order], micro_batch_ids[order], self.budgets.take(order), *cp)

    def to_json(self) -> str:
        """Sorted keys, no spaces; unset budget fields stay out (except ``kept_fraction``, null), so top-p plans
        read as before; a dynamic-CP plan's rows carry ``cp_ranks``, the domain ranks of their CP group."""
        rows = [{"budget": budget, "dp_rank": rank, "length": length, "micro_batch": mb, "seq_id": seq_id}
                for seq_id, length, rank, mb, budget in zip(
                    self.seq_ids.tolist(), self.lengths.tolist(), self.dp_ranks.tolist(),
                    self.micro_batch_ids.tolist(), _budget_objects(self.budgets), strict=True)]
        if self.dynamic_cp:
            for row, first, size in zip(rows, self.cp_first.tolist(), self.cp_size.tolist(), strict=True):
                row["cp_ranks"] = list(range(first, first + size))
        raw = {"assignments": rows, "dp": self.dp, "micro_batches": self.micro_batches, "step": self.step}
        return json.dumps(raw, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        raw = json.loads(text)
        assignments = tuple(_assignment_from_json(a) for a in raw["assignments"])
        return cls.of(raw["step"], raw["dp"], raw["micro_batches"], assignments)


COLUMNS = ("seq_ids", "lengths", "dp_ranks", "micro_batch_ids")  # Plan's int64 columns
CP_COLUMNS = ("cp_first", "cp_size")  # and a dynamic-CP plan's


def group_span(a: Assignment) -> tuple[int, int]:
    """(first domain rank, ranks) of an assignment's CP group; its ranks must be consecutive."""
    ranks = list(a.cp_ranks)
    if not ranks or ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        raise ValueError(f"assignment of sequence {a.seq_id} has cp_ranks={ranks!r}; allowed: consecutive domain "
                         "ranks")
    return ranks[0], len(ranks)


def _budget_objects(budgets: BudgetArrays) -> list[dict]:
    """Each row's budget as its JSON object (rows alike share one)."""
    made: dict[Budget, dict] = {}
    out = []
    for budget in budgets.budgets():
        raw = made.get(budget)
        if raw is None:
            raw = made[budget] = {k: v for k, v in asdict(budget).items() if v is not None or k == "kept_fraction"}
        out.append(raw)
    return out


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
    ranks = fields_.pop("cp_ranks", None)
    return Assignment(**{**fields_, "budget": Budget(**fields_["budget"])},
                      cp_ranks=None if ranks is None else tuple(ranks))
