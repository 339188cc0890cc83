"""Raw measurements: one CSV row per (grid point, term), appended and flushed as each point finishes.

Appending per point (rather than writing once at the end) is what makes a run resumable: a run killed at
its time limit keeps every point it finished, and the next run skips the keys already present.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

from sparsebalance.sim.core import ConfigError

COLUMNS = (
    "key",          # grid point id (see calibrate.grid.GridPoint.key)
    "term",         # attn_fwd | attn_bwd | select | layer_fwd | layer_bwd | layer_step | layer_full
    "split",        # fit | heldout | validate
    "model",        # conf/model/<name>.yaml
    "lengths",      # ';'-joined sequence lengths of the packed batch
    "kept_fractions",  # ';'-joined kept fractions the kernel actually realised (requested for layer terms)
    "median_ms",
    "p20_ms",
    "p80_ms",
    "reps",         # timed repetitions behind the quantiles
)


def append_rows(path: Path, rows: list[dict], columns: tuple[str, ...] = COLUMNS) -> None:
    """Append rows (a finished point) of a CSV with these columns and force them to disk before the next point
    starts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _drop_partial_tail(path)
    new_file = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="raise")
        if new_file:
            writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())


def _drop_partial_tail(path: Path) -> None:
    """Cut a line left half-written by a kill, so the next row does not get glued onto it."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def read_rows(path: Path) -> list[dict]:
    """All complete rows; a trailing partial line (a kill mid-write) is dropped, not an error, and a file with
    other columns is a ConfigError.

    A point measured twice (killed between its rows, then redone) appears twice; readers keep the last.
    """
    if not path.exists():
        return []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    if reader.fieldnames is not None and set(reader.fieldnames) != set(COLUMNS):
        raise ConfigError(f"{path}: columns {sorted(reader.fieldnames)}; allowed: calibrate.run's, "
                          f"{', '.join(COLUMNS)}")
    return [r for r in rows if all(r.get(c) not in (None, "") for c in COLUMNS)]


def done_keys(path: Path, terms_by_key: dict[str, tuple[str, ...]]) -> set[str]:
    """Keys whose every expected term is already on disk (a half-written point is measured again)."""
    have: dict[str, set[str]] = {}
    for row in read_rows(path):
        have.setdefault(row["key"], set()).add(row["term"])
    return {k for k, terms in terms_by_key.items() if set(terms) <= have.get(k, set())}
