"""Shared by every test directory: ``tests/`` on ``sys.path``, whatever pytest's import mode, so that test
modules can ``from pinned import pinned, PINNED_OVERRIDES`` (the pinned cost profile, ``tests/pinned.py``)."""
import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
