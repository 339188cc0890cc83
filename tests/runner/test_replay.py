"""runner.replay on the CPU: a tiny model, a fake clock where the times must be known exactly.

With the cost model's own times the replayed steps are sim.run's steps to the last digit; with other
per-stage times they are the engine's 1F1B schedule plus the modelled all-reduce; the Plans are sim.run's
byte for byte; the host clock and the deadline work end to end; bad input is one line and writes nothing.

The replay's planners observe what the kernel measured, sim.run's what the cost model prices, so their Plans
agree past step 0 where the planner learns nothing from observations: sparsebalance runs here with the prior
estimator (its belief the workload's population, whatever a step reported).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sparsebalance.runner.replay import dir_name, load_inputs, main, run_replay
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.compare import policy_variant
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.engine import Engine, PlanArrays, run_pipeline
from sparsebalance.sim.pipeline import last_micro_batches
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.results import FLOAT_FORMAT
from sparsebalance.sim.run import simulate
from sparsebalance.sim.setup import prepare
from sparsebalance.sim.workload import truth_of

TINY = [
    "cost=roofline", "cost.block_size=32", "cluster.gpus_per_node=4", "layout.pp=2", "layout.micro_batches=2",
    "model.hidden=32", "model.layers=2", "model.heads=2", "model.kv_heads=1", "model.head_dim=16",
    "model.ffn=64", "model.vocab=256", "model.max_context=256",
    "workload.global_batch=8", "workload.min_len=64", "workload.max_len=256", "workload.median=160",
    "seed=5", "steps=2",
]
POLICIES = ("baseline", "sparsebalance:estimator=prior")


class FakeClock:
    """Returns a preset time for every span it is shown; the work inside still runs."""

    name = "fake clock"

    def __init__(self, times) -> None:
        self.times, self.seen = times, []

    @contextlib.contextmanager
    def span(self, key):
        yield
        self.seen.append(key)

    def read(self):
        out = {key: self.times(key) for key in self.seen}
        self.seen = []
        return out


def cost_model_times(overrides):
    """Span -> ms: the cost model's forward and backward of each micro-batch at the Plan's budgets, every stage."""
    setup = prepare(compose_typed(overrides))
    m = setup.layout.micro_batches
    times = {}
    for name in POLICIES:
        for plan, truth in simulated_plans(overrides, name):
            arrays = PlanArrays.from_plan(plan, truth)
            kept = arrays.kept(setup.cost)
            group = arrays.dp_rank * m + arrays.micro_batch
            costs = setup.cost.micro_batch_costs(arrays.length, kept, group, plan.dp * m, setup.layout)
            for g in set(group.tolist()):
                for stage in range(setup.layout.pp):
                    times[(name, plan.step, g // m, g % m, stage, "F")] = float(costs.fwd_ms[g])
                    times[(name, plan.step, g // m, g % m, stage, "B")] = float(costs.bwd_ms[g])
    return times.__getitem__


def compose_typed(overrides):
    return to_object(compose_config(overrides))


def simulated_plans(overrides, name) -> list[tuple[Plan, dict[int, float]]]:
    """sim.run's Plans of one policy, each with the sensitivities of its step's sequences (the data's truth)."""
    workload = prepare(compose_typed(overrides)).workload
    plans = simulate(compose_config(overrides), policy_variant(name)).results.plans
    return [(plan, truth_of(workload.batch(plan.step))) for plan in map(Plan.from_json, plans)]


def to_object(node):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(node)


def replayed(tmp_path, overrides, clock, policies=POLICIES) -> Path:
    out = tmp_path / "replay"
    inputs = load_inputs(overrides, ",".join(policies), None, "cpu", "kernel")
    run_replay(inputs, out, warmup=0, deadline_s=None, clock=clock, log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def cost_timed(tmp_path_factory) -> Path:
    return replayed(tmp_path_factory.mktemp("cost_timed"), TINY, FakeClock(cost_model_times(TINY)))


def sim_results(tmp_path, overrides, name):
    """sim.run's run of one policy of the same config, and its files."""
    run = simulate(compose_config(overrides), policy_variant(name))
    run_dir = tmp_path / f"sim_{name}"
    run.results.write(run_dir, run.summary)
    return run, run_dir


@pytest.mark.slow
@pytest.mark.parametrize("name", POLICIES)
def test_cost_model_times_reproduce_the_simulators_steps(cost_timed, tmp_path, name):
    run, sim_dir = sim_results(tmp_path, TINY, name)
    replayed_dir = cost_timed / dir_name(name)
    replay_steps, sim_steps = pd.read_csv(replayed_dir / "steps.csv"), pd.read_csv(sim_dir / "steps.csv")
    for col in ("step", "step_ms", "bubble_fraction", "tokens_per_s"):
        assert replay_steps[col].tolist() == sim_steps[col].tolist(), col
    replay_mb, sim_mb = pd.read_csv(replayed_dir / "micro_batches.csv"), pd.read_csv(sim_dir / "micro_batches.csv")
    for col in ("dp_rank", "micro_batch", "stage", "compute_ms", "comm_ms", "idle_ms", "tokens"):
        assert replay_mb[col].tolist() == sim_mb[col].tolist(), col
    # The predicted column at the Plan's budgets is what the fake clock returned: no error at all.
    rows = pd.read_csv(replayed_dir / "replay.csv")
    assert np.allclose(rows["plan_error_pct"], 0.0, atol=1e-6)
    comparison = json.loads((cost_timed / "comparison.json").read_text())
    assert [s["sim_ms"] for s in comparison["steps"][name]] == [s.step_ms for s in run.results.steps]
    assert [s["replay_ms"] for s in comparison["steps"][name]] == [s.step_ms for s in run.results.steps]
    assert comparison["communication"] == "modelled"


@pytest.mark.slow
@pytest.mark.parametrize("name", POLICIES)
def test_plans_are_the_simulators_byte_for_byte(cost_timed, name):
    expected = "".join(p + "\n" for p in simulate(compose_config(TINY), policy_variant(name)).results.plans)
    assert (cost_timed / dir_name(name) / "plans.jsonl").read_bytes() == expected.encode()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["layout.pp=2"], ["layout.pp=1", "layout.micro_batches=2"]], ids=["pp2", "pp1"])
def test_per_stage_times_compose_through_the_engines_schedule(tmp_path, layout):
    """Times that differ per rank, micro-batch, stage and phase: the step is the engine's 1F1B over them plus
    the modelled hand-offs and gradient all-reduce."""
    overrides = [*TINY, *layout, "steps=1"]

    def times(key):
        _, step, rank, mb, stage, phase = key
        fwd = 1.0 + 0.7 * rank + 0.3 * mb + 0.11 * stage + 0.05 * step
        return fwd if phase == "F" else 2.1 * fwd + 0.2

    out = replayed(tmp_path, overrides, FakeClock(times), policies=("lbb",))
    cfg = compose_typed(overrides)
    cluster = Cluster.from_config(cfg.cluster)
    layout_ = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
    setup = prepare(cfg)
    engine = Engine(layout_, setup.cost, cluster)
    dp, m, pp = layout_.dp, layout_.micro_batches, layout_.pp
    step_ms = pd.read_csv(out / "lbb" / "steps.csv")["step_ms"].tolist()
    for plan, truth in simulated_plans(overrides, "lbb"):
        arrays = PlanArrays.from_plan(plan, truth)
        group = arrays.dp_rank * m + arrays.micro_batch
        tokens = np.bincount(group, weights=arrays.length, minlength=dp * m)
        filled = (tokens > 0).reshape(dp, m, 1)
        grid = np.indices((dp, m, pp))
        fwd = np.where(filled, times_grid(times, plan.step, grid, "F"), 0.0)
        bwd = np.where(filled, times_grid(times, plan.step, grid, "B"), 0.0)
        p2p = setup.cost.hand_off_ms(tokens, layout_).reshape(dp, m)
        expected = composed_ms(engine, fwd, bwd, p2p, pp)
        assert step_ms[plan.step] == float(FLOAT_FORMAT % expected)
        if pp > 1:  # the stages' own times matter: the same work with every stage at its mean differs
            mean = composed_ms(engine, fwd.mean(axis=2)[..., None].repeat(pp, 2),
                               bwd.mean(axis=2)[..., None].repeat(pp, 2),
                               p2p, pp)
            assert abs(mean - expected) > 1e-6


def composed_ms(engine, fwd, bwd, p2p, pp):
    """The step from busy times [dp, m, pp]: the 1F1B pipeline, then the bucketed gradient reduction."""
    finish = run_pipeline(fwd, bwd, p2p, pp).finish_ms
    last = bwd[:, last_micro_batches(pp, fwd.shape[1]), np.arange(pp)]
    return max(finish.max(), engine.reduced_ms(finish - last, last))


def times_grid(times, step, grid, phase):
    rank, mb, stage = grid
    return np.vectorize(lambda r, b, s: times(("lbb", step, r, b, s, phase)))(rank, mb, stage)


def test_stages_and_recomputation_do_the_whole_models_work():
    """Cut into two stages with every layer's forward recomputed in its backward (from the blocks its forward
    selected), one micro-batch gives the gradients and kernel stats of the uncut model without recomputation
    (the tied LM head's copy on the last stage adds its gradient to the embedding's, as the runner sums them)."""
    import torch

    from sparsebalance.runner.data import pack
    from sparsebalance.runner.task import TaskConfig
    from sparsebalance.runner.staged import StagedModel, Untimed
    from sparsebalance.sim.shapes import ModelShape

    cfg = compose_typed(TINY)
    assert cfg.model.tie_embeddings
    plan, truth = simulated_plans(TINY, "sparsebalance")[0]
    batch = pack(plan.micro_batch(0, 0), truth, TaskConfig(), cfg.model.vocab, cfg.seed, torch.device("cpu"))
    runs = []
    for pp, recompute in ((1, False), (2, True)):
        staged = StagedModel(ModelShape.from_config(cfg.model), pp, cfg.seed, torch.device("cpu"), "kernel",
                             cfg.cost.block_size, recompute)
        kept, coverage = staged.run(batch, Untimed(), ("sparsebalance", 0, 0, 0))
        grads = {n: p.grad.clone() for n, p in staged.named_parameters()}
        if pp > 1:
            grads["embed.weight"] += grads.pop("lm_head.weight")
        runs.append((kept, coverage, grads))
    (kept1, cov1, grads1), (kept2, cov2, grads2) = runs
    assert torch.equal(kept1, kept2) and torch.equal(cov1, cov2) and (kept1 < 1).any()
    assert grads1.keys() == grads2.keys()
    for name in grads1:
        assert grads1[name].abs().sum() > 0, name
        torch.testing.assert_close(grads1[name], grads2[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("pp", [1, 2])
def test_the_replay_runs_the_runners_weights(pp):
    """Each replayed stage holds the weights runner.train starts that stage from (sparsebalance.model.make_model),
    so that the kernel selects what the runner's first step selects."""
    import torch

    from sparsebalance.model import make_model
    from sparsebalance.runner.staged import StagedModel
    from sparsebalance.sim.shapes import ModelShape, StageSpan

    cfg = compose_typed(TINY)
    staged = StagedModel(ModelShape.from_config(cfg.model), pp, cfg.seed, torch.device("cpu"), "kernel",
                         cfg.cost.block_size, recompute=False)
    for s, stage in enumerate(staged.stages):
        runner = make_model(cfg.model, cfg.seed, StageSpan(s, pp)).state_dict()
        replayed = stage.state_dict()
        assert replayed.keys() == runner.keys()
        for name, weights in runner.items():
            assert torch.equal(replayed[name], weights), name


def test_host_clock_and_deadline_end_to_end(tmp_path, capsys):
    out = tmp_path / "timed"
    assert main([*TINY, "--policies", "baseline,lbb", "--warmup", "0", "--deadline-s", "1e-6",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "communication is modelled" in printed and "deadline" in printed
    for name in ("baseline", "lbb"):
        assert len(pd.read_csv(out / name / "steps.csv")) == 1  # the deadline cut the second round for both
        rows = pd.read_csv(out / name / "replay.csv")
        assert (rows["measured_fwd_ms"] > 0).all() and (rows["measured_bwd_ms"] > 0).all()
        assert rows["kernel_kept_fraction"].between(0, 1).all()
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["communication"] == "modelled" and summary["steps"] == 1 and summary["steps_planned"] == 2
    table = pd.read_csv(out / "comparison.csv")
    assert list(table["policy"]) == ["baseline", "lbb"]
    assert table.loc[1, "x_baseline"] == pytest.approx(table.loc[0, "replay_ms"] / table.loc[1, "replay_ms"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


@pytest.mark.parametrize("args, message", [
    (["--policies", "baseline,nope"], "'nope' is not a policy"),
    (["--policies", "baseline,baseline"], "named twice"),
    (["--baselines", "verl"], "'verl' is not among the replayed policies"),
    (["--warmup", "-1"], "--warmup=-1"),
    (["--deadline-s", "0"], "--deadline-s=0.0"),
    (["layout.cp=2", "layout.pp=1"], "layout.cp=2"),
    (["model.vocab=100"], "model.vocab=100 is too small"),
    (["layout.dp=3"], "layout dp=3"),
    (["--device", "tpu"], "--device='tpu' is unknown; allowed: auto, cuda, cpu"),
    (["--attention", "flash"], "--attention='flash' is unknown; allowed: kernel, triton, naive"),
    (["no_such_key=1"], "no_such_key"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main([*TINY, *args, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_out_dir_that_cannot_be_made_is_refused_before_the_replay(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--out", str(tmp_path / "file" / "out")])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"error: --out='{tmp_path / 'file' / 'out'}' cannot be written (Not a directory)")


def test_an_out_dir_with_files_is_refused_and_left_as_it_was(tmp_path, capsys):
    (tmp_path / "kept.txt").write_text("mine")
    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--out", str(tmp_path)])
    stderr = capsys.readouterr().err
    assert exc.value.code == 2 and stderr.count("\n") == 1 and "not an empty directory" in stderr
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]
