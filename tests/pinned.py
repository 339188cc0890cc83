"""The cost profile tests price on: ``tests/fixtures/profile_h200.json``, a frozen copy of the measured one.

Tests compose configs with ``pinned([...])`` (or add ``PROFILE_OVERRIDE`` to a subprocess's overrides) so that
a new measurement committed as ``calibrate/profiles/h200.json`` cannot change what they check.
``tests/conftest.py`` puts this directory on ``sys.path``, so any test module can import it.
"""
from __future__ import annotations

from pathlib import Path

PINNED_PROFILE = Path(__file__).resolve().parent / "fixtures" / "profile_h200.json"
PROFILE_OVERRIDE = f"cost.profile={PINNED_PROFILE}"


def pinned(overrides=()) -> list[str]:
    """Overrides with the pinned profile first, so that an explicit ``cost.profile=`` among them still wins."""
    return [PROFILE_OVERRIDE, *overrides]
