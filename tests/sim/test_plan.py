"""sim.plan: the columnar Plan against its Assignment view, its copies (budgets, placement), its read-only
columns and its JSON, pinned byte for byte."""
import numpy as np
import pytest

from sparsebalance.sim.plan import Assignment, Budget, BudgetArrays, Plan

ROWS = (Assignment(5, 4096, 1, 0, Budget(p=0.9)), Assignment(2, 512, 0, 1, Budget(top_k=32, p_floor=0.8)),
        Assignment(9, 1000, 0, 1, Budget(kept_fraction=0.25)), Assignment(3, 8192, 1, 1, Budget(top_k=4)),
        Assignment(7, 100, 0, 0))
# ROWS as the Plan of tuples of Assignments wrote them: the files written before stay byte for byte the same.
ROWS_JSON = (
    '{"assignments":[{"budget":{"kept_fraction":null,"p":0.9},"dp_rank":1,"length":4096,"micro_batch":0,"seq_id":5},'
    '{"budget":{"kept_fraction":null,"p":1.0,"p_floor":0.8,"top_k":32},"dp_rank":0,"length":512,"micro_batch":1,'
    '"seq_id":2},{"budget":{"kept_fraction":0.25,"p":1.0},"dp_rank":0,"length":1000,"micro_batch":1,"seq_id":9},'
    '{"budget":{"kept_fraction":null,"p":1.0,"top_k":4},"dp_rank":1,"length":8192,"micro_batch":1,"seq_id":3},'
    '{"budget":{"kept_fraction":null,"p":1.0},"dp_rank":0,"length":100,"micro_batch":0,"seq_id":7}],"dp":2,'
    '"micro_batches":2,"step":6}')


def plan() -> Plan:
    return Plan.of(6, 2, 2, ROWS)


def test_the_columns_hold_the_assignments_in_plan_order():
    p = plan()
    assert p.seq_ids.tolist() == [5, 2, 9, 3, 7] and p.lengths.tolist() == [4096, 512, 1000, 8192, 100]
    assert p.dp_ranks.tolist() == [1, 0, 0, 1, 0] and p.micro_batch_ids.tolist() == [0, 1, 1, 1, 0]
    assert p.budgets == BudgetArrays.of(a.budget for a in ROWS) and len(p) == 5
    assert p.assignments == ROWS
    assert p.micro_batch(0, 1) == ROWS[1:3] and p.micro_batch(1, 1) == (ROWS[3],) and p.micro_batch(1, 2) == ()


def test_json_is_byte_stable_and_reads_back():
    assert plan().to_json() == ROWS_JSON
    assert Plan.from_json(ROWS_JSON) == plan()
    assert Plan.of(0, 1, 1, ()).to_json() == '{"assignments":[],"dp":1,"micro_batches":1,"step":0}'


def test_columns_are_read_only_copies():
    lengths = np.array([10, 20])
    p = Plan(0, 1, 1, [1, 2], lengths, [0, 0], [0, 0], BudgetArrays.uniform(Budget(p=0.5), 2))
    lengths[0] = 99  # the caller's array is not the plan's
    assert p.lengths.tolist() == [10, 20]
    for column in (p.seq_ids, p.lengths, p.dp_ranks, p.micro_batch_ids, p.budgets.p, p.budgets.top_k):
        with pytest.raises(ValueError, match="read-only"):
            column[0] = 3
    with pytest.raises(ValueError, match="plan columns of different sizes"):
        Plan(0, 1, 1, [1, 2], [10], [0, 0], [0, 0], BudgetArrays.uniform(Budget(), 2))


def test_with_budgets_replaces_only_the_named_sequences():
    p = plan()
    changed = p.with_budgets({9: Budget(p=0.5), 7: Budget(top_k=2), 11: Budget(p=0.1)})  # 11 is not planned
    assert [a.budget for a in changed.assignments] == [ROWS[0].budget, ROWS[1].budget, Budget(p=0.5),
                                                       ROWS[3].budget, Budget(top_k=2)]
    assert p.assignments == ROWS and changed != p
    assert changed.with_budgets({9: ROWS[2].budget, 7: ROWS[4].budget}) == p


def test_placed_lists_by_rank_and_micro_batch_keeping_each_micro_batch_in_order():
    moved = plan().placed([1, 1, 0, 1, 0], [1, 0, 1, 1, 0])
    assert [(a.seq_id, a.dp_rank, a.micro_batch) for a in moved.assignments] == [
        (7, 0, 0), (9, 0, 1), (2, 1, 0), (5, 1, 1), (3, 1, 1)]
    assert [a.budget for a in moved.assignments] == [ROWS[i].budget for i in (4, 2, 1, 0, 3)]
