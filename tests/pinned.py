"""The profiles tests price on: ``tests/fixtures/profile_h200.json`` and ``tests/fixtures/memory_h200.json``,
frozen copies of the measured cost and memory profiles.

Tests compose configs with ``pinned([...])`` (or add ``*PINNED_OVERRIDES`` to a subprocess's overrides) so that
a new measurement committed to ``calibrate/profiles/`` cannot change what they check.
``tests/conftest.py`` puts this directory on ``sys.path``, so any test module can import it.
"""
from __future__ import annotations

from pathlib import Path

PINNED_PROFILE = Path(__file__).resolve().parent / "fixtures" / "profile_h200.json"
PINNED_MEMORY = Path(__file__).resolve().parent / "fixtures" / "memory_h200.json"
PINNED_OVERRIDES = (f"cost.profile={PINNED_PROFILE}", f"memory.profile={PINNED_MEMORY}")


def pinned(overrides=()) -> list[str]:
    """Overrides with the pinned profiles first, so that an explicit ``cost.profile=`` among them still wins."""
    return [*PINNED_OVERRIDES, *overrides]
