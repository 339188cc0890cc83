"""The cost profile tests price on: ``tests/fixtures/profile_h200.json``, a frozen copy of the measured one
(the memory model's default is first principles, which no measurement replaces).

Tests compose configs with ``pinned([...])`` (or add ``*PINNED_OVERRIDES`` to a subprocess's overrides) so that
a new measurement committed to ``calibrate/profiles/`` cannot change what they check.
``tests/conftest.py`` puts this directory on ``sys.path``, so any test module can import it.
"""
from __future__ import annotations

from pathlib import Path

PINNED_PROFILE = Path(__file__).resolve().parent / "fixtures" / "profile_h200.json"
# The cluster's profile, which cost=calibrated reads (cost.profile defaults to it) and cost=roofline does not.
PINNED_OVERRIDES = (f"cluster.profile={PINNED_PROFILE}",)
# The pinned profile with made-up dense backends (cudnn, fa4) beside it: what dense_best, hybrid and verl_dense price.
BACKENDS_PROFILE = PINNED_PROFILE.with_name("profile_h200_backends.json")
# That profile with a made-up sparse peer (fa4_sparse, "sparse": true) beside its dense backends: what hybrid prices.
SPARSE_PEER_PROFILE = PINNED_PROFILE.with_name("profile_h200_sparse_peer.json")


def pinned(overrides=()) -> list[str]:
    """Overrides with the pinned profile first, so that an explicit ``cost.profile=`` among them still wins."""
    return [*PINNED_OVERRIDES, *overrides]
