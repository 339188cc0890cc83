"""DP2 and PP2 x DP2 under torchrun on the CPU, with DDP and with FSDP2, train what one process trains
(equivalence.py); so does FSDP2 when one replica has an empty micro-batch that the other has not; and a run
resumed from its checkpoint continues the single process's loss curve."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from equivalence import (
    LAYOUTS, check_compare, check_loss_and_gradients, check_plans, check_rows, launch, one_process, plans_of,
    truth_of_run,
)


pytestmark = pytest.mark.slow  # a torchrun per layout and a resumed one


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, once) -> tuple[str, Path]:
    """The layout's one-step run (equivalence.one_step_run), launched once per session: the four checks of a
    layout may run on different xdist workers."""
    name = request.param
    return name, once(f"parallel-{name}", lambda run_dir: launch(name, run_dir, "runner.checkpoint_every=1"))


def test_loss_and_gradients_are_the_single_process_ones(run):
    check_loss_and_gradients(run[1])


def test_plans_are_the_simulators(run):
    check_plans(*run)


def test_results_have_a_row_per_replica_micro_batch_and_stage(run):
    check_rows(*run)


def test_compare_replays_the_run(run):
    check_compare(run[1])


@pytest.mark.parametrize("run", ["pp2xdp2-fsdp"], indirect=True)  # the most intricate layout's run
def test_a_resumed_run_continues_the_single_process_loss_curve(run, tmp_path):
    """Each stage loads its share of the merged checkpoint (FSDP: its shards): the weights decide the second
    step's loss, the optimiser's moments and step count the third's."""
    name, half = run
    resumed = tmp_path / "resumed"
    launch(name, resumed, "steps=3", f"runner.resume={half / 'checkpoint.pt'}")
    losses, _ = one_process(plans_of(resumed), truth_of_run(resumed))
    assert list(pd.read_csv(resumed / "train.csv")["loss"]) == pytest.approx(losses, rel=1e-5)
