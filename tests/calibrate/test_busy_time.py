"""The GPU busy clock's reading of a profiler trace: per repetition between two markers, the union of the
activities' intervals (two streams at once count once; host gaps count not at all)."""
import pytest

from sparsebalance.calibrate.timing import MARKER, busy_ms

NS = 1_000_000  # ns per ms


def mark(at):
    return (f"at::cuda::(anonymous namespace)::{MARKER}(long)", at, at + 2)


def test_overlapping_streams_count_once_and_gaps_not_at_all():
    trace = [
        ("flush", 0, 50), mark(60),
        ("dq", 70, 100), ("dkdv", 80, 120),  # two streams at once: 70..120
        ("reduce", 130, 140),  # after a 10 ns host gap
        mark(150), ("flush", 160, 200), mark(210),
        ("fwd", 220, 230), mark(240),
    ]
    assert busy_ms(trace) == pytest.approx([60 / NS, 10 / NS])


def test_order_of_the_trace_does_not_matter():
    trace = [mark(0), ("a", 10, 20), ("b", 15, 40), ("c", 12, 18), mark(50)]
    assert busy_ms(trace[::-1]) == busy_ms(trace) == pytest.approx([30 / NS])


def test_an_activity_inside_another_adds_nothing():
    trace = [mark(0), ("long", 10, 100), ("inside", 20, 30), ("tail", 90, 110), mark(120)]
    assert busy_ms(trace) == pytest.approx([100 / NS])


def test_no_markers_no_repetitions():
    assert busy_ms([("a", 0, 10)]) == []
