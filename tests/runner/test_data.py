"""The runner's tasks, generated from (seed, sequence id): every answer follows from the sequence's own records,
records never overlap one another or the prompts, and the same inputs give the same tokens."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsebalance.runner.task import ANS, BOS, KEY, N_SPECIAL, QUERY, RECORD, VAL, TaskConfig, TaskKind, make_example
from sparsebalance.sim.core import ConfigError

VOCAB = 160
TASKS = st.builds(
    TaskConfig,
    kind=st.sampled_from(list(TaskKind)),
    n_keys=st.just(32),
    n_values=st.integers(1, 64),
    max_pairs=st.integers(1, 16),
    n_queries=st.integers(1, 6),
)


@st.composite
def examples(draw):
    task = draw(TASKS)
    sensitivity = draw(st.floats(0.0, 1.0))
    length = draw(st.integers(task.min_length(sensitivity), 600))
    seed, seq_id = draw(st.integers(0, 2**31)), draw(st.integers(0, 10**6))
    return task, sensitivity, length, make_example(task, VOCAB, seed, seq_id, length, sensitivity)


def records_of(tokens: np.ndarray) -> dict[int, int]:
    """key token -> the token after its VAL, for every KEY record in the haystack."""
    starts = np.flatnonzero(tokens == KEY)
    assert (tokens[starts + 2] == VAL).all()
    return dict(zip(tokens[starts + 1].tolist(), tokens[starts + 3].tolist(), strict=True))


@settings(max_examples=200)
@given(examples())
def test_answers_follow_from_the_records(case):
    task, sensitivity, length, ex = case
    tokens = ex.tokens
    assert tokens.shape == (length,) and tokens[0] == BOS
    records = records_of(tokens)
    assert len(records) == task.n_records(sensitivity)  # distinct keys: no record lost to a duplicate
    assert len(ex.answers) == task.queries(sensitivity)
    assert (tokens[ex.answer_positions] == ANS).all() and (tokens[ex.answer_positions - 2] == QUERY).all()
    assert (tokens[ex.answer_positions + 1] == ex.answers).all()  # the answer is the next token
    assert len(set(tokens[ex.answer_positions - 1].tolist())) == len(ex.answers)  # distinct items asked
    values = range(N_SPECIAL + task.n_keys, N_SPECIAL + task.n_keys + task.n_values)
    for key, answer in zip(tokens[ex.answer_positions - 1].tolist(), ex.answers.tolist(), strict=True):
        found = records[key]
        if task.kind is TaskKind.multihop:
            assert found not in values  # the first hop reads a key ...
            found = records[found]  # ... whose record holds the answer
        assert found == answer and answer in values


@settings(max_examples=200)
@given(examples())
def test_records_and_prompts_never_overlap(case):
    task, sensitivity, length, ex = case
    tokens = ex.tokens
    special = np.flatnonzero(tokens < N_SPECIAL)
    starts = np.flatnonzero(np.isin(tokens, (KEY, QUERY)))
    # Every special token belongs to exactly one whole record or prompt: BOS, then 4-token cells.
    spans = np.concatenate([[0], (starts[:, None] + [0, 2]).ravel()])
    assert sorted(spans.tolist()) == special.tolist()
    assert (np.diff(starts) >= RECORD).all()
    assert starts[-1] == length - RECORD
    prompts = np.flatnonzero(tokens == QUERY)
    assert (prompts == length - RECORD * np.arange(len(ex.answers), 0, -1)).all()  # all at the very end


@settings(max_examples=50)
@given(TASKS, st.integers(0, 2**31), st.integers(0, 10**6), st.floats(0.0, 1.0))
def test_content_is_a_function_of_seed_and_sequence_id(task, seed, seq_id, sensitivity):
    length = task.min_length(sensitivity) + 64
    a = make_example(task, VOCAB, seed, seq_id, length, sensitivity)
    b = make_example(task, VOCAB, seed, seq_id, length, sensitivity)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.answers, b.answers)
    other = make_example(task, VOCAB, seed + 1, seq_id, length, sensitivity)
    assert not np.array_equal(a.tokens, other.tokens)


def test_the_most_sensitive_sequences_hold_the_most_records():
    task = TaskConfig(kind=TaskKind.multihop, n_keys=32, max_pairs=8, n_queries=8)
    assert [task.n_records(s) for s in (0.0, 0.5, 1.0)] == [2, 10, 16]
    assert task.min_length(1.0) == 1 + 4 * (16 + 8)
    assert TaskConfig(n_keys=32, max_pairs=8).min_length(1.0) == 1 + 4 * (8 + 2)


def test_a_chains_records_sit_in_either_order():
    """The grid would otherwise put every first hop before every second one."""
    task = TaskConfig(kind=TaskKind.multihop, n_keys=16, n_values=16, max_pairs=1, n_queries=1)
    first_hop_first = set()
    for seq_id in range(40):
        tokens = make_example(task, VOCAB, 0, seq_id, 64, 0.0).tokens
        starts = np.flatnonzero(tokens == KEY)
        first_hop_first.add(bool(tokens[starts[0] + 1] == tokens[-3]))  # the earlier record is keyed by the query
    assert first_hop_first == {True, False}


def test_a_sequence_too_short_for_its_task_is_refused():
    task = TaskConfig(kind=TaskKind.multihop, n_keys=16, max_pairs=4)
    with pytest.raises(ValueError, match=r"sequence 7 of length 40 is too short for the multihop task \(needs 41"):
        make_example(task, VOCAB, 0, 7, 40, 1.0)


def test_the_retrieval_data_is_unchanged():
    """Pinned tokens: the retrieval task's draws (and so every earlier run's data) stay as they were."""
    ex = make_example(TaskConfig(n_keys=16, n_values=16, max_pairs=4), 64, 3, 11, 32, 1.0)
    assert ex.tokens.tolist() == PINNED_TOKENS
    assert ex.answers.tolist() == PINNED_ANSWERS


def test_multihop_needs_two_keys_per_chain():
    with pytest.raises(ConfigError, match=r"max_pairs=9 \(18 distinct keys for the multihop task\) exceeds "
                                          r"n_keys=16; allowed: 2 \* max_pairs <= n_keys"):
        TaskConfig(kind=TaskKind.multihop, n_keys=16, max_pairs=9).check("")
    TaskConfig(kind=TaskKind.multihop, n_keys=16, max_pairs=8).check("")


# Written by the retrieval generator before the multi-hop kind existed (seed 3, sequence 11, 32 tokens).
PINNED_TOKENS = [1, 56, 49, 42, 55, 2, 17, 3, 34, 2, 15, 3, 31, 2, 19, 3, 33, 2, 23, 3, 29, 48, 48, 47,
                 4, 15, 5, 31, 4, 17, 5, 34]
PINNED_ANSWERS = [31, 34]
