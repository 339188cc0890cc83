"""Context parallelism (runner/cp.py, runner/cp_kernel.py): both CP attentions alone (the ring of PyTorch
pieces and the kernel over all-gathered keys), in spawned gloo processes, against the whole micro-batch's
attention in one process; then the runner's CP layouts end to end against one process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp

from cp_worlds import run_cp_cases
from equivalence import (
    ALL_LAYOUTS, CP_LAYOUTS, ROOT, check_compare, check_loss_and_gradients, check_plans, check_rows,
    first_step_selection, launch, layout_overrides, one_process, plans_of, RUNNER, truth_of_run,
)
from sparsebalance.kernels.sparse_attention import sparse_attention
from sparsebalance.runner.cp import Shards, attention_piece, make_cp_attention, merge_pieces, shard_bounds
from sparsebalance.runner.cp_kernel import make_cp_kernel_attention
from sparsebalance.runner.dist import World
from sparsebalance.runner.train import check_inputs
from sparsebalance.sim.core import ConfigError

pytestmark = pytest.mark.slow

BLOCK = 16
HQ, HKV, D = 4, 2, 16
# name: (cp, sequence lengths, p, kept fraction); odd lengths, several documents, a block split over ranks
CASES = {
    "cp2-dense": (2, (37, 61, 18), 1.0, None),
    "cp2-top-p": (2, (37, 61, 18), 0.6, None),
    "cp3-top-p": (3, (83, 29, 45), 0.5, None),
    "cp4-top-k": (4, (101, 40, 9 * 4 - 1), None, 0.4),
    "cp3-mixed-p": (3, (70, 33), (1.0, 0.3), None),
}
ATOL = 2e-6  # fp32: the pieces and the merge sum in another order than one softmax over every key


def _inputs(lengths):
    """q, k, v, the output gradient and cu_seqlens of one micro-batch, the same on every rank."""
    gen = torch.Generator().manual_seed(sum(lengths))
    t = sum(lengths)
    q, k, v, g = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV, HQ))
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    return q, k, v, g, cu


def _budgets(p, kf, n):
    def per_seq(x):
        return None if x is None else torch.tensor(x if isinstance(x, tuple) else (x,) * n, dtype=torch.float32)
    return per_seq(p), per_seq(kf)


IMPLEMENTATIONS = {
    "ring": lambda ring: make_cp_attention(BLOCK, ring),
    "kernel": lambda ring: make_cp_kernel_attention(BLOCK, ring, "auto"),  # the kernel's reference on the CPU
}


def _worker(rank: int, out: str) -> None:
    """Every case with every implementation (cp_worlds.run_cp_cases)."""
    cases = {case: (cp, lambda lengths=lengths, p=p, kf=kf: (*_inputs(lengths), _budgets(p, kf, len(lengths))))
             for case, (cp, lengths, p, kf) in CASES.items()}
    run_cp_cases(rank, out, cases, IMPLEMENTATIONS)


@pytest.fixture(scope="module")
def cp_outputs(once) -> Path:
    """Every case's CP outputs, each implementation's, from one spawn of as many processes as the widest case
    has ranks, once per session (the cases' tests may run on different xdist workers)."""
    widest = max(cp for cp, *_ in CASES.values())
    return once("cp-attention", lambda out: mp.spawn(_worker, args=(str(out),), nprocs=widest, join=True))


def _reference(case: str):
    _, lengths, p, kf = CASES[case]
    q, k, v, g, cu = _inputs(lengths)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    pp, kk = _budgets(p, kf, len(lengths))
    o, sel = sparse_attention(q, k, v, cu, p=pp if kk is None else None, kept_fraction=kk, block_size=BLOCK,
                              return_selection=True, backend="naive")
    o.backward(g)
    return o.detach(), q.grad, k.grad, v.grad, sel


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_cp_attention_equals_the_whole_micro_batchs(case, impl, cp_outputs):
    cp = CASES[case][0]
    o, dq, dk, dv, sel = _reference(case)
    seen = torch.zeros(o.shape[0], dtype=torch.bool)
    for rank in range(cp):
        got = torch.load(cp_outputs / f"{case}-{impl}" / f"rank{rank}.pt", weights_only=True)
        i = got["index"]
        seen[i] = True
        for name, want in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
            torch.testing.assert_close(got[name], want[i], rtol=0, atol=ATOL, msg=f"{name} on cp rank {rank}")
        torch.testing.assert_close(got["kept"], sel.kept_fraction, rtol=0, atol=1e-6)
        torch.testing.assert_close(got["coverage"], sel.coverage, rtol=0, atol=1e-6)
    assert seen.all()
    if CASES[case][2] != 1.0:  # the case exercises a selection that drops blocks
        assert float(sel.kept_fraction.min()) < 1.0


def test_zigzag_chunks_are_equal_and_pair_early_with_late():
    assert shard_bounds(10, 2).tolist() == [0, 2, 5, 7, 10]
    shards = Shards.build(torch.tensor([0, 10, 17], dtype=torch.int32), 2, 0)
    assert shards.index[0].tolist() == [0, 1, 7, 8, 9, 10, 15, 16]
    assert shards.index[1].tolist() == [2, 3, 4, 5, 6, 11, 12, 13, 14]
    assert shards.positions(1).tolist() == [2, 3, 4, 5, 6, 1, 2, 3, 4]
    assert shards.offsets[1] == (0, 5, 9)


def test_a_piece_without_keys_is_zero_and_merges_to_the_others():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 16, generator=gen, requires_grad=True) for _ in range(3))
    none = torch.zeros(2, 3, 3, dtype=torch.bool)
    full = torch.ones(2, 3, 3, dtype=torch.bool)
    o0, lse0 = attention_piece(q, k, v, none, 0.25)
    o1, lse1 = attention_piece(q, k, v, full, 0.25)
    assert torch.isinf(lse0).all() and (o0 == 0).all()
    merged = merge_pieces([o0, o1], [lse0, lse1])
    torch.testing.assert_close(merged, o1)
    merged.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


# ---------------------------------------------------------------------- end to end (equivalence.py)
@pytest.fixture(scope="module", params=list(CP_LAYOUTS))
def run(request, once) -> tuple[str, Path]:
    """The layout's one-step run (equivalence.one_step_run), launched once per session: the checks of a
    layout may run on different xdist workers."""
    name = request.param
    return name, once(f"cp-{name}", lambda run_dir: launch(name, run_dir, "runner.checkpoint_every=1"))


def test_cp_trains_what_one_process_trains(run):
    check_loss_and_gradients(run[1])


def test_cp_plans_are_the_simulators(run):
    check_plans(*run)


def test_cp_results_have_a_row_per_replica_micro_batch_and_stage(run):
    check_rows(*run)


def test_compare_replays_the_cp_run(run):
    check_compare(run[1])


def test_cp_records_the_whole_sequences_selection(run):
    """Each sequence once, with the kept fraction and coverage the whole sequence's selection has, as a cp = 1
    run of the same Plan records them."""
    name, run_dir = run
    plan = plans_of(run_dir)[0]
    recorded = pd.read_csv(run_dir / "sequences.csv").set_index("seq_id")
    assert sorted(recorded.index) == sorted(a.seq_id for a in plan.assignments)
    expected = first_step_selection(plan, truth_of_run(run_dir))
    assert min(kept for kept, _ in expected.values()) < 1.0  # the baseline's p = 0.9 drops blocks
    for seq_id, (kept, coverage) in expected.items():
        assert recorded.loc[seq_id, "kept_fraction"] == pytest.approx(kept, abs=1e-6), seq_id
        assert recorded.loc[seq_id, "coverage"] == pytest.approx(coverage, abs=1e-6), seq_id
    rows = pd.read_csv(run_dir / "micro_batches.csv")
    assert rows["tokens"].sum() == sum(a.length for a in plan.assignments) * ALL_LAYOUTS[name][1]


@pytest.mark.parametrize("run", ["cp2xdp2-fsdp"], indirect=True)
def test_a_resumed_cp_run_continues_the_single_process_loss_curve(run, tmp_path):
    name, half = run
    resumed = tmp_path / "resumed"
    launch(name, resumed, "steps=3", f"runner.resume={half / 'checkpoint.pt'}")
    losses, _ = one_process(plans_of(resumed), truth_of_run(resumed))
    assert list(pd.read_csv(resumed / "train.csv")["loss"]) == pytest.approx(losses, rel=1e-5)


# ---------------------------------------------------------------------- bad input and failures
@pytest.mark.parametrize("overrides, world, message", [
    # the shortest sequences the task allows (9 tokens: one record, one query) are too short for 2 x 5 chunks
    (["layout.cp=5", "cluster.gpus_per_node=5", "workload.min_len=9", "runner.task.max_pairs=1",
      "runner.task.n_queries=1"], 5, "workload.min_len=9 is shorter than 2 x layout.cp = 10 tokens; allowed: >= 10"),
])
def test_cp_refuses_what_it_cannot_run_in_one_line(overrides, world, message):
    with pytest.raises(ConfigError) as exc:
        check_inputs([*layout_overrides("cp2-ddp"), *RUNNER, *overrides], World(rank=0, size=world, local_rank=0))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_hung_cp_rank_ends_the_job_within_the_timeout(tmp_path):
    """The healthy rank waits in the first layer's ring exchange of the cp group."""
    timeout_s = 5
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "tests/runner/faulty_train.py", f"hydra.run.dir={tmp_path}", *layout_overrides("cp2-ddp"), *RUNNER,
           "steps=3", f"runner.timeout_s={timeout_s}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RUNNER_FAULT": "hang",
           "RUNNER_FAULT_RANK": "1", "RUNNER_FAULT_STEP": "1"}
    # The hung rank sleeps an hour: ending at all, within the bound, is the timeout's doing.
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert lines and lines[0].startswith(f"error: rank 0: step 1 failed or timed out after {timeout_s} s"), lines
    assert lines[0].endswith(f"Ranks 1 failed to pass monitoredBarrier in {2 * timeout_s * 1000} ms"), lines
