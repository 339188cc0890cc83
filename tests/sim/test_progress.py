"""sim.progress.with_progress: a tqdm bar on a terminal, plain lines elsewhere (never a bar's carriage returns)."""
from __future__ import annotations

import io
import sys

from sparsebalance.sim.progress import with_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_plain_line_per_interval_and_none_after_the_last(capsys):
    items = list(with_progress(range(3), "kk", interval_s=0.0, status=lambda: "loss 1.000"))
    err = capsys.readouterr().err
    assert items == [0, 1, 2] and "\r" not in err
    assert [line.split(" after ")[0] for line in err.splitlines()] == ["kk: step 1/3", "kk: step 2/3"]
    assert all(line.endswith(" s, loss 1.000") for line in err.splitlines())


def test_a_resumed_loop_counts_from_where_it_starts(capsys):
    assert list(with_progress(range(2, 5), "run", total=5, initial=2, unit="point", interval_s=0.0)) == [2, 3, 4]
    assert [line.split(" after ")[0] for line in capsys.readouterr().err.splitlines()] == ["run: point 3/5",
                                                                                          "run: point 4/5"]


def test_a_short_loop_off_a_terminal_or_a_disabled_one_is_silent(capsys):
    assert list(with_progress(range(3), "kk")) == [0, 1, 2]  # well inside the 5 s interval
    assert list(with_progress(range(3), "kk", enabled=False, interval_s=0.0)) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_on_a_terminal_a_bar_with_the_status(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(with_progress(range(3), "kk", status=lambda: "loss 2.5")) == [0, 1, 2]
    assert "\r" in terminal.getvalue() and "kk:" in terminal.getvalue()
