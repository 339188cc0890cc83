"""``cost.attention_backend`` in the runner: each micro-batch's attention runs on the backend the cost model picks
for it, the simulator's decision (sim.backends.choose), and micro_batches.csv records which one ran.

No dense backend of the project runs on the CPU (cuDNN and FlashAttention need a GPU), so the runner refuses the
dense modes here in one line; the decision and the records are checked with ``reference`` (dense_train.py), a
dense backend that runs on the CPU, priced by a profile made for it: its attention costs a fixed time per token,
so that it beats our kernel on the small micro-batches and loses on the large ones. A sparse peer is checked alike
with ``naive_sparse`` (tests/sparse_peer.py: our selection, the PyTorch reference on the kept blocks), priced
beside ``reference`` so that hybrid runs both."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from dense_train import NAME, Reference
from pinned import BACKENDS_PROFILE
from sparse_peer import NAME as SPARSE, NaiveSparse
from sparsebalance.kernels.backends import BACKENDS
from sparsebalance.kernels.sparse_attention import sparse_attention
from sparsebalance.runner.attention import PeerRun, make_attention, warm_peers
from sparsebalance.runner.dist import World
from sparsebalance.runner.train import build_planner, compose
from sparsebalance.sim.backends import DENSE_FEATURES
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.run import simulate
from tiny import ONE_RANK, TINY_ONE_RANK

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
# the tiny model under the calibrated cost model (its attention costs ~0.5 ms a layer, mostly fixed), 8 sequences
# of 64-512 tokens in 2 micro-batches a step, every sequence at a fixed kept fraction: what the kernel keeps, and
# so each micro-batch's price, does not depend on the data, and the runner decides as the simulator does
TINY = [o for o in TINY_ONE_RANK if not o.startswith(("cost", "workload.global_batch"))] + [
    "cost=calibrated", "workload.global_batch=8", f"steps={STEPS}", "+policy.sparsity.params.kept_fraction=0.5"]
PER_TOKEN_MS = 2.3e-4  # reference's forward per token (its backward twice that): ~700 tokens cost ours' time


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    """The pinned profile with ``reference`` as its only dense backend."""
    priced = json.loads(BACKENDS_PROFILE.read_text())
    zero = dict.fromkeys(DENSE_FEATURES, 0.0)
    priced["backends"] = {NAME: {"version": Reference().version(), "terms": {
        "attn_fwd": zero | {"tokens": PER_TOKEN_MS}, "attn_bwd": zero | {"tokens": 2 * PER_TOKEN_MS}}}}
    path = tmp_path_factory.mktemp("profile") / "reference.json"
    path.write_text(json.dumps(priced))
    return path


@pytest.fixture(scope="module")
def sparse_profile(tmp_path_factory) -> Path:
    """The pinned profile with ``reference`` and the sparse peer ``naive_sparse``: a fixed cost per call and
    kept FLOP, which beats ``reference`` on the larger micro-batches and our kernel on all of them."""
    priced = json.loads(BACKENDS_PROFILE.read_text())
    zero = dict.fromkeys(DENSE_FEATURES, 0.0)
    priced["backends"] = {
        NAME: {"version": Reference().version(), "terms": {
            "attn_fwd": zero | {"tokens": PER_TOKEN_MS}, "attn_bwd": zero | {"tokens": 2 * PER_TOKEN_MS}}},
        SPARSE: {"version": NaiveSparse().version(), "sparse": True, "terms": {
            "attn_fwd": zero | {"const": 0.05, "flops": 1e-12}, "attn_bwd": zero | {"const": 0.1, "flops": 2e-12}}}}
    path = tmp_path_factory.mktemp("profile") / "sparse_peer.json"
    path.write_text(json.dumps(priced))
    return path


@pytest.fixture
def reference(monkeypatch):
    """``reference`` and ``naive_sparse`` in the registry for one test (dense_train.py registers them in the
    runs it starts)."""
    monkeypatch.setitem(BACKENDS, NAME, Reference)
    monkeypatch.setitem(BACKENDS, SPARSE, NaiveSparse)


def overrides(profile: Path, mode: str) -> list[str]:
    return [*TINY, f"cost.profile={profile}", f"cost.attention_backend={mode}"]


def simulated_backends(profile: Path, mode: str) -> list[list[str]]:
    """Per step, the backend of each micro-batch as sim.run's engine records it."""
    sim = [o for o in overrides(profile, mode) if not o.startswith("runner.")]
    rows = simulate(compose_config([*sim, "memory.activation_checkpointing=false"])).results.micro_batches()
    return [g.sort_values("micro_batch").attention_backend.tolist() for _, g in rows.groupby("step")]


def planned_backends(profile: Path, mode: str) -> list[list[str]]:
    """Per step, the backend the runner picks for each micro-batch of its one replica."""
    planner, _ = build_planner(compose(overrides(profile, mode)), ONE_RANK)
    return [planner.backends(planner.plan(step)[0])[0].tolist() for step in range(STEPS)]


@pytest.mark.parametrize("mode", ["ours", "dense_best", "hybrid"])
def test_the_runner_picks_each_micro_batchs_backend_as_the_simulator_does(profile, reference, mode):
    planned = planned_backends(profile, mode)
    assert planned == simulated_backends(profile, mode)
    ran = {name for step in planned for name in step}
    assert ran == {"ours": {"ours"}, "dense_best": {NAME}, "hybrid": {"ours", NAME}}[mode]


def hybrid_run(profile, tmp_path) -> pd.DataFrame:
    """A CPU hybrid run through dense_train.py: checks that micro_batches.csv names, per step and micro-batch, the
    backend the simulator chooses; returns sequences.csv joined to its micro-batch's row."""
    cmd = [sys.executable, "tests/runner/dense_train.py", f"hydra.run.dir={tmp_path}", *overrides(profile, "hybrid")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"attention peers warmed up before step 0: {NAME} " in proc.stdout
    rows = pd.read_csv(tmp_path / "micro_batches.csv")
    recorded = [g.sort_values("micro_batch").attention_backend.tolist() for _, g in rows.groupby("step")]
    assert recorded == simulated_backends(profile, "hybrid")
    return pd.read_csv(tmp_path / "sequences.csv").merge(rows, on=["step", "dp_rank", "micro_batch"],
                                                         suffixes=("", "_mb"))


@pytest.mark.slow
def test_a_hybrid_run_records_which_backend_ran_each_micro_batch(profile, tmp_path):
    """A CPU run through dense_train.py: micro_batches.csv names the backend of each micro-batch (the simulator's
    choice); the sequences that reference ran report every block kept and all their attention covered, those
    on our kernel what it selected at their kept fraction."""
    sequences = hybrid_run(profile, tmp_path)
    dense = sequences[sequences.attention_backend == NAME]
    ours = sequences[sequences.attention_backend == "ours"]
    assert len(dense) and len(ours)
    assert (dense.kept_fraction == 1.0).all() and (dense.coverage == 1.0).all()
    assert (ours.kept_fraction < 1.0).any() and (ours.kept_fraction >= 0.5 - 1e-6).all()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_a_dense_mode_whose_backends_need_a_gpu_is_one_line_before_anything_runs(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={run_dir}", *TINY,
           f"cost.profile={BACKENDS_PROFILE}", "cost.attention_backend=hybrid"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: cost.attention_backend=hybrid: the cost profile prices the dense backend cudnn, which cannot run "
        "here (cudnn: absent (RuntimeError: no CUDA GPU here)); allowed: cost.attention_backend=ours, or a machine "
        "where cudnn, fa4 load (the peers extra on a GPU)"]
    assert not run_dir.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_a_policy_that_trains_dense_names_its_own_key():
    with pytest.raises(ConfigError, match=r"^policy\.attention_backend=dense_best: the cost profile prices the dense "
                                          r"backend cudnn, which cannot run here \(cudnn: absent"):
        build_planner(compose([*TINY, f"cost.profile={BACKENDS_PROFILE}", "policy=verl_dense"]), ONE_RANK)


def test_dense_modes_refuse_context_parallel_processes(profile, reference):
    two = ["cluster.gpus_per_node=2", "layout.cp=2"]
    world = World(rank=0, size=2, local_rank=0, local_size=2)
    with pytest.raises(ConfigError, match=r"^cost\.attention_backend=hybrid with layout\.cp=2: the runner runs a "
                                          r"peer backend on whole documents only; allowed: "):
        build_planner(compose([*overrides(profile, "hybrid"), *two]), world)
    planner, _ = build_planner(compose([*overrides(profile, "hybrid"), *two, "runner.one_process=true"]), ONE_RANK)
    assert set(planner.peers) == {NAME}  # one process holds whole documents
    np.testing.assert_array_equal(planner.backends(planner.plan(0)[0]).shape, (1, 2))


@pytest.mark.parametrize("mode", ["dense_best", "hybrid"])
def test_the_runner_runs_a_sparse_peer_where_the_simulator_does(sparse_profile, reference, mode):
    planned = planned_backends(sparse_profile, mode)
    assert planned == simulated_backends(sparse_profile, mode)
    ran = {name for step in planned for name in step}
    assert ran == {"dense_best": {NAME}, "hybrid": {NAME, SPARSE}}[mode]  # dense_best never runs a sparse peer


def test_hybrid_loads_the_sparse_peer_at_the_profiles_block_size_and_dense_best_does_not(sparse_profile, reference):
    planner, _ = build_planner(compose(overrides(sparse_profile, "hybrid")), ONE_RANK)
    loaded = planner.peers
    assert set(loaded) == {NAME, SPARSE} and loaded[SPARSE].block_size == planner.planner.cost.block_size == 128
    planner, _ = build_planner(compose(overrides(sparse_profile, "dense_best")), ONE_RANK)
    assert set(planner.peers) == {NAME}


def test_a_profile_that_prices_a_sparse_peer_as_dense_is_one_line(sparse_profile, reference, tmp_path):
    priced = json.loads(sparse_profile.read_text())
    del priced["backends"][SPARSE]["sparse"]
    path = tmp_path / "mislabelled.json"
    path.write_text(json.dumps(priced))
    with pytest.raises(ConfigError, match=rf"^cost\.attention_backend=hybrid: the cost profile prices {SPARSE} as a "
                                          rf"dense backend, but kernels.backends' {SPARSE} is sparse; allowed: a "
                                          rf"profile whose backends entry for {SPARSE} says \"sparse\": true$"):
        build_planner(compose(overrides(path, "hybrid")), ONE_RANK)


@pytest.mark.parametrize("budget", [{"kept_fraction": torch.tensor([0.5, 0.25, 1.0])},
                                    {"top_k": torch.tensor([2, 1, 3]), "p": None}])
def test_a_micro_batch_on_a_sparse_peer_runs_its_selection_and_reports_it(budget):
    """runner.attention: the peer selects at the micro-batch's budgets (as our kernel would), computes the kept
    blocks, and its sequences report that selection's kept fractions and coverages; gradients reach q, k, v."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 256, 333, 400], dtype=torch.int32)
    q = torch.randn(400, 4, 16, requires_grad=True)
    k, v = (torch.randn(400, 2, 16, requires_grad=True) for _ in range(2))
    peer = PeerRun.of(NaiveSparse(block_size=32), cu, torch.device("cpu"))
    budgets = (budget.get("p"), budget.get("kept_fraction"), budget.get("top_k"), peer)
    o, kept, coverage = make_attention("kernel", 32)(q, k, v, cu, budgets)
    expected, sel = sparse_attention(q, k, v, cu, **budget, block_size=32, return_selection=True, backend="naive")
    torch.testing.assert_close(o, expected)
    torch.testing.assert_close(kept, sel.kept_fraction)
    torch.testing.assert_close(coverage, sel.coverage)
    assert (kept < 1.0).any() and (coverage < 1.0).any()
    o.sum().backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v))
    dense = PeerRun.of(Reference(), cu, torch.device("cpu"))
    _, kept, coverage = make_attention("kernel", 32)(q, k, v, cu, (None, budget.get("kept_fraction"), None, dense))
    assert kept.tolist() == coverage.tolist() == [1.0, 1.0, 1.0]  # a dense peer keeps every block


@pytest.mark.slow
def test_a_hybrid_run_on_a_sparse_peer_records_its_selection(sparse_profile, tmp_path):
    """A CPU run through dense_train.py: micro_batches.csv names the sparse peer where it ran (the simulator's
    choice), and its sequences report what its selection kept at their kept fraction 0.5, where the dense one's
    report every block."""
    sequences = hybrid_run(sparse_profile, tmp_path)
    sparse, dense = sequences[sequences.attention_backend == SPARSE], sequences[sequences.attention_backend == NAME]
    assert len(sparse) and len(dense)
    assert (sparse.kept_fraction < 1.0).any() and (sparse.kept_fraction >= 0.5 - 1e-6).all()
    assert (sparse.coverage < 1.0).any()
    assert (dense.kept_fraction == 1.0).all() and (dense.coverage == 1.0).all()


def test_runner_compare_replays_each_micro_batch_on_the_backend_it_ran():
    """micro_batches.csv holds a row per (step, rank, micro-batch, stage); the replay takes each micro-batch's
    backend from it, and a run that records none ran ours throughout."""
    from sparsebalance.runner.compare import backends_ran
    from sparsebalance.sim.cluster import Layout

    rows = pd.DataFrame([(step, rank, mb, stage, name) for step, names in ((0, ["fa4", "ours"]), (1, ["ours", "fa4"]))
                         for rank in range(2) for mb, name in enumerate(names) for stage in range(2)],
                        columns=["step", "dp_rank", "micro_batch", "stage", "attention_backend"])
    layout = Layout(dp=2, micro_batches=2)
    assert backends_ran(rows, 1, layout).tolist() == [["ours", "fa4"], ["ours", "fa4"]]
    assert backends_ran(rows.drop(columns="attention_backend"), 1, layout) is None


def test_each_peer_runs_forward_and_backward_once_before_the_first_step(monkeypatch):
    """What a peer compiles at its first call (FlashAttention-4: 4.7 s on an H100, inside the step that first ran
    it under hybrid) is paid before step 0: each loaded peer, dense or sparse, runs forward and backward once on
    small documents, and the run's random stream is left as it was."""
    calls = []

    class Spy(Reference):
        def attention(self, q, k, v, docs):
            calls.append((NAME, q))
            return super().attention(q, k, v, docs)

    class SparseSpy(NaiveSparse):
        def attention(self, q, k, v, docs, selection):
            calls.append((SPARSE, q))
            return super().attention(q, k, v, docs, selection)

    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    took = warm_peers({NAME: Spy(), SPARSE: SparseSpy(block_size=32)}, heads=4, kv_heads=2, head_dim=16,
                      dtype=torch.float32, device=torch.device("cpu"))
    assert torch.equal(torch.rand(4), expected)
    assert list(took) == [NAME, SPARSE] and all(ms > 0 for ms in took.values())
    assert [name for name, _ in calls] == [NAME, SPARSE]
    assert all(q.grad is not None and q.grad.abs().sum() > 0 for _, q in calls)
    assert warm_peers({}, 4, 2, 16, torch.float32, torch.device("cpu")) == {}


def reference_profile(path: Path, per_token_ms: float) -> Path:
    """The pinned profile with ``reference`` its only dense backend, at ``per_token_ms`` a token (forward)."""
    priced = json.loads(BACKENDS_PROFILE.read_text())
    zero = dict.fromkeys(DENSE_FEATURES, 0.0)
    priced["backends"] = {NAME: {"version": Reference().version(), "terms": {
        "attn_fwd": zero | {"tokens": per_token_ms}, "attn_bwd": zero | {"tokens": 2 * per_token_ms}}}}
    path.write_text(json.dumps(priced))
    return path


def attention_added(cost, mode: str, plan, kept: np.ndarray, layout) -> np.ndarray:
    """Per micro-batch, what its attention adds under ``mode`` at the kept fractions ``kept`` (one process, no CP
    ring): the figure hybrid compares."""
    chosen, cost.attention_backend = cost.attention_backend, mode
    try:
        c = cost.micro_batch_costs(plan.lengths, kept, plan.micro_batch_ids, layout.micro_batches, layout)
    finally:
        cost.attention_backend = chosen
    return c.attn_fwd_ms * (1 + cost.recompute) + c.select_ms + c.attn_bwd_ms


def test_the_runner_chooses_hybrids_backend_at_the_beliefs_mean_not_its_minimum(reference, tmp_path):
    """A top-p budget (p 0.9) keeps more of a sequence the denser the belief thinks it is. The reference's price
    is set between what ours costs on micro-batch 0 at the belief's lowest kept fractions and at their mean, so
    that a choice at the mean runs the reference there and a choice at the minimum would run ours."""
    top_p = [o for o in TINY if "kept_fraction" not in o] + ["cost.attention_backend=hybrid"]
    planner, _ = build_planner(compose([*top_p, f"cost.profile={reference_profile(tmp_path / 'a.json', 1e-4)}"]),
                               ONE_RANK)
    plan, cost, layout = planner.plan(0)[0], planner.cost, planner.layout
    kept = plan.budgets.kept(cost, plan.lengths[None], planner.planner.belief.at(plan.seq_ids))
    at_mean, at_min = (attention_added(cost, "ours", plan, k, layout) for k in (kept.mean(axis=0), kept.min(axis=0)))
    assert at_min[0] < at_mean[0]
    dense = attention_added(cost, "dense_best", plan, kept.mean(axis=0), layout)
    scale = np.sqrt(at_min[0] * at_mean[0]) / (dense[0] * (1 - cost.hybrid_margin))
    priced = reference_profile(tmp_path / "b.json", 1e-4 * scale)
    planner, _ = build_planner(compose([*top_p, f"cost.profile={priced}"]), ONE_RANK)
    again = planner.plan(0)[0]
    assert again == plan  # the same plan and belief: only the reference's price moved
    np.testing.assert_array_equal(kept, again.budgets.kept(planner.cost, again.lengths[None],
                                                           planner.planner.belief.at(again.seq_ids)))
    assert planner.backends(again)[0, 0] == NAME
