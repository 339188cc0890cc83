"""DP2 under torchrun on the CPU, with DDP and with FSDP2, trains what one process trains (equivalence.py); so
does FSDP2 when one replica has an empty micro-batch that the other has not."""
from __future__ import annotations

from pathlib import Path

import pytest

from equivalence import check_compare, check_loss_and_gradients, check_plans, check_rows, one_step_run

LAYOUTS_HERE = ["dp2-ddp", "dp2-fsdp", "dp2-fsdp-uneven"]


@pytest.fixture(scope="module", params=LAYOUTS_HERE)
def run(request, tmp_path_factory) -> tuple[str, Path]:
    return one_step_run(request.param, tmp_path_factory)


def test_loss_and_gradients_are_the_single_process_ones(run):
    check_loss_and_gradients(run[1])


def test_plans_are_the_simulators(run):
    check_plans(*run)


def test_results_have_a_row_per_replica_micro_batch_and_stage(run):
    check_rows(*run)


def test_compare_replays_the_run(run):
    check_compare(run[1])
