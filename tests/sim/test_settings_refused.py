"""Settings that a mode does not read, or that would not do what they say, are refused in one line naming why and
what to use: the roofline's keys under a calibrated profile, a profile measured at another block size, empty
micro-batches (sim.run and runner.train alike), and sim.compare's overrides of what it sets itself.
"""
from __future__ import annotations

import json
import sys

import pytest

import sparsebalance.sim.compare as sim_compare
from pinned import PINNED_PROFILE, pinned
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.run import check_composition


@pytest.fixture(scope="module")
def block_64(tmp_path_factory):
    """The pinned profile as if measured at block size 64."""
    profile = json.loads(PINNED_PROFILE.read_text())
    profile["block_size"] = 64
    path = tmp_path_factory.mktemp("profile") / "block_64.json"
    path.write_text(json.dumps(profile))
    return path


# (overrides, text the one error line must contain); "{block_64}" is the fixture's path
RUN_CASES = [
    (["cost.block_size=64"], "cost.block_size=64: the profile "),
    (["cost.block_size=64"], "allowed: cost.block_size=128 (or unset), cost=roofline cost.block_size=64"),
    (["cost.profile={block_64}", "cost.block_size=128"], "was measured at block size 64"),
    (["cost.attn_efficiency=0.5"], "cost.attn_efficiency=0.5 is read by cost=roofline only"),
    (["cost.matmul_efficiency=0.5"], "cost.matmul_efficiency=0.5 is read by cost=roofline only"),
    (["cost.attn_bwd_ratio=3"], "cost.attn_bwd_ratio=3.0 is read by cost=roofline only"),
    (["cost.launch_ms=0.01"], "cost.launch_ms=0.01 is read by cost=roofline only"),
    (["cost.name=roofline"], "cost.block_size is not set; cost=roofline needs a block size"),
    (["layout.micro_batches=16"], "layout.micro_batches=16 is more than the 8 sequences a DP rank gets "
                                  "(workload.global_batch=64 over dp=8), so micro-batches would be empty; allowed: "
                                  "layout.micro_batches <= 8, or workload.global_batch >= 128"),
    (["layout.pp=2", "layout.micro_batches=64"], "allowed: layout.micro_batches <= 16"),
    (["layout.dp=2", "layout.cp=4", "workload.global_batch=7", "layout.micro_batches=4"],
     "more than the 3 sequences a DP rank gets"),
]
# What each refused setting's neighbour runs: the value that is read, or the mode that reads it.
ACCEPTED = [["cost.block_size=128"], ["cost=roofline", "cost.block_size=64", "cost.attn_efficiency=0.5"],
            ["layout.micro_batches=8"],
            ["cost.profile={block_64}"]]


@pytest.mark.parametrize("overrides,needle", RUN_CASES, ids=[" ".join(o) for o, _ in RUN_CASES])
def test_a_setting_the_run_would_not_honour_is_one_line(block_64, overrides, needle):
    with pytest.raises(ConfigError) as caught:
        check_composition(pinned(["steps=2", *(o.format(block_64=block_64) for o in overrides)]))
    assert needle in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("overrides", ACCEPTED, ids=" ".join)
def test_the_settings_that_are_read_pass(block_64, overrides):
    check_composition(pinned(["steps=2", *(o.format(block_64=block_64) for o in overrides)]))


def test_under_a_profile_the_run_records_the_block_it_runs_at(tmp_path):
    """Unset, the block size is the profile's: the config records null, not a block the run did not use."""
    from sparsebalance.sim.config import compose_config
    from sparsebalance.sim.setup import prepare

    cfg = compose_config(pinned(["steps=1"]))
    assert cfg.cost.block_size is None
    assert prepare(cfg).cost.block_size == json.loads(PINNED_PROFILE.read_text())["block_size"]


RUNNER_CASES = [
    (["+experiment=cpu_smoke", "cost=calibrated"], "cost.block_size=32: the profile "),
    (["+experiment=cpu_smoke", "layout.micro_batches=8"], "layout.micro_batches=8 is more than the 4 sequences"),
]


@pytest.mark.parametrize("overrides,needle", RUNNER_CASES, ids=[" ".join(o) for o, _ in RUNNER_CASES])
def test_the_runner_refuses_them_alike(overrides, needle):
    pytest.importorskip("torch")
    from sparsebalance.runner.dist import World
    from sparsebalance.runner.train import check_inputs

    with pytest.raises(ConfigError) as caught:
        check_inputs(overrides, World(rank=0, size=2, local_rank=0))
    assert needle in str(caught.value) and "\n" not in str(caught.value)


COMPARE_CASES = [
    (["policy.estimator=oracle"], "policy.estimator=oracle: sim.compare does not read policy: it compares the "
                                  "policies of --policies"),
    (["policy=kk"], "--policies <name>:<key>=<value>"),
    (["+policy.sparsity.params.p=0.5"], "sim.compare does not read policy"),
    (["baseline=verl"], "baseline=verl: sim.compare does not read baseline: --baselines names the policies"),
    (["write_plans=false"], "sim.compare does not read write_plans: it writes nothing"),
    (["plot=true"], "sim.compare does not read plot"),
    (["--seed", "1"], "unrecognized arguments: --seed 1"),
    (["--polic", "verl"], "unrecognized arguments: --polic verl"),
    (["--seeds", "x"], "argument --seeds: invalid int value: 'x'"),
]


@pytest.mark.parametrize("argv,needle", COMPARE_CASES, ids=[" ".join(a) for a, _ in COMPARE_CASES])
def test_compare_refuses_what_it_does_not_read_in_one_line(argv, needle, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sim.compare", *pinned(["steps=1"]), "--policies", "baseline", *argv])
    with pytest.raises(SystemExit) as exited:
        sim_compare.main()
    err = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.mark.parametrize("policies,baselines,note", [
    (("sparsebalance", "verl_topk"), ("verl_topk",), None),
    (("sparsebalance", "sab"), ("sparsebalance",), None),
    (("sparsebalance:estimator=prior", "verl:sparsity.params.p=0.8"), ("verl:sparsity.params.p=0.8",), None),
])
def test_vs_best_over_chosen_policies_is_over_rows_shown(policies, baselines, note):
    assert sim_compare.shown_baselines(policies) == baselines
    assert sim_compare.vs_best_note(policies, baselines) is note


def test_vs_best_over_a_row_not_shown_names_it():
    assert sim_compare.vs_best_note(("sparsebalance",), ("verl", "sparsebalance")) == (
        "vs_best: over the fastest of verl, sparsebalance on each seed (not shown: verl)")


def test_compare_with_chosen_policies_prints_vs_best_over_them(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv",
                        ["sim.compare", *pinned(["steps=1", "workload.global_batch=16", "layout.micro_batches=2"]),
                                      "--policies", "baseline,verl", "--oracles", ""])
    sim_compare.main()
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    rows = lines[next(i for i, words in enumerate(lines) if words[:1] == ["policy"]) + 1:]
    vs_best = {row[0]: float(row[-1]) for row in rows}
    assert max(vs_best.values()) == 1.0 and set(vs_best) == {"baseline", "verl"}


# ----------------------------------------------------------------------------- run directories
def run_cli(monkeypatch, capsys, *overrides) -> tuple[int, list[str]]:
    import sparsebalance.sim.run as sim_run

    monkeypatch.setattr(sys, "argv", ["sim.run", *pinned(["steps=1", "baseline=null", *overrides])])
    try:
        sim_run.cli()
        code = 0
    except SystemExit as done:
        code = done.code or 0
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.slow  # three runs: over 3 s on a loaded machine
def test_a_run_dir_with_results_is_refused_and_an_overwrite_leaves_nothing_of_the_old_run(tmp_path, monkeypatch,
                                                                                          capsys):
    run = tmp_path / "run"
    assert run_cli(monkeypatch, capsys, f"hydra.run.dir={run}", "seed=1")[0] == 0
    first = (run / "steps.csv").read_bytes()
    (run / "figures").mkdir()
    (run / "figures" / "timeline.png").write_bytes(b"old")
    (run / "notes.txt").write_text("the user's")
    code, err = run_cli(monkeypatch, capsys, f"hydra.run.dir={run}", "seed=2")
    assert code == 2 and err == [f"error: hydra.run.dir={run} holds the results of an earlier run (micro_batches.csv); "
                                 "allowed: another hydra.run.dir, or overwrite=true to replace them"]
    assert (run / "steps.csv").read_bytes() == first
    assert run_cli(monkeypatch, capsys, f"hydra.run.dir={run}", "seed=2", "overwrite=true")[0] == 0
    assert (run / "steps.csv").read_bytes() != first and not (run / "figures").exists()
    assert sorted(p.name for p in run.iterdir()) == [".hydra", "micro_batches.csv", "notes.txt", "plans.jsonl",
                                                     "run.log", "steps.csv", "summary.json"]


def test_a_second_run_into_a_directory_in_use_is_refused(tmp_path, monkeypatch, capsys):
    """A run in progress holds the directory's lock (made with O_EXCL): the second command is refused and the
    first one's lock and directory stay as they were."""
    from sparsebalance.sim.outputs import LOCK, Outputs, claimed_run_dir

    run = tmp_path / "a" / "run"
    with claimed_run_dir(Outputs(run, sweep=False), overwrite=False, job_name="run"):
        code, err = run_cli(monkeypatch, capsys, f"hydra.run.dir={run}")
        assert code == 2 and err == [f"error: hydra.run.dir={run}: another run is writing there (its lock: "
                                     f"{run / LOCK}); allowed: another hydra.run.dir, or the lock removed once no run "
                                     "uses the directory"]
        assert [p.name for p in run.iterdir()] == [LOCK]
        with pytest.raises(ConfigError, match="another run is writing there"):
            with claimed_run_dir(Outputs(run, sweep=False), overwrite=True, job_name="run"):
                pass
    assert not (tmp_path / "a").exists()  # the directories made for the lock went with it


def test_the_runner_refuses_overwrite():
    pytest.importorskip("torch")
    from sparsebalance.runner.dist import World
    from sparsebalance.runner.train import check_inputs

    with pytest.raises(ConfigError, match=r"^overwrite=true is sim.run's; runner.train does not replace"):
        check_inputs(["+experiment=cpu_smoke", "overwrite=true"], World(rank=0, size=2, local_rank=0))
