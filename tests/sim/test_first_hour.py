"""What a new user meets in a first hour, as one table per kind of outcome: Ctrl-C, bad input that looked
plausible, the spelling of presets, groups and options, the size guard and progress of sim.compare, and the
permissions of what the commands write.

Every row checks the exit code, that stderr is the one line it should be, and what is left on disk. The
commands run in this process (``sim.run``'s ``cli``, ``sim.compare``'s ``main``); only Ctrl-C needs a child
process, which gets SIGINT the way a terminal sends it, to its whole process group.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import stat
import subprocess
import sys
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import sparsebalance.sim.compare as sim_compare
import sparsebalance.sim.progress as sim_progress
import sparsebalance.sim.run as sim_run
from pinned import PINNED_PROFILE, pinned
from sparsebalance.sim.core import (CONF_DIR, TEMPORARY, atomic_path, preset_options, quiet_interrupts_in_callbacks,
                                    temporary_dir)
from sparsebalance.sim.profile import FASTEST_FLOPS_PER_MS, SLOWEST_FLOPS_PER_MS

ROOT = Path(__file__).resolve().parents[2]
# The runner's tiny model on one CPU process (a few ms a step), for Ctrl-C during runner.train.
TINY_RUNNER = [
    "cost=roofline", "cost.block_size=32", "cluster.gpus_per_node=1", "layout.micro_batches=2", "model.hidden=32",
    "model.layers=1", "model.heads=2", "model.kv_heads=1", "model.head_dim=16", "model.ffn=64", "model.vocab=128",
    "model.max_context=512", "workload.global_batch=4", "workload.min_len=64", "workload.max_len=512",
    "workload.median=128", "policy=baseline", "runner.task.n_keys=16", "runner.task.n_values=16",
    "runner.task.max_pairs=4", "runner.device=cpu", "write_plans=false",
]


@pytest.fixture(autouse=True)
def umask():
    """The usual umask, whatever the environment's: what an ordinary write gets is then 0644 (0755 a directory)."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """Inputs that look plausible and are not: profiles with absurd coefficients, traces in other digits."""
    made = {"dir": tmp_path}
    profile = json.loads(PINNED_PROFILE.read_text())
    for name, flops in (("slow", 1e300), ("fast", 1e-20)):
        edited = copy.deepcopy(profile)
        edited["terms"]["attn_fwd"]["flops"] = flops
        made[name] = tmp_path / f"profile_{name}.json"
        made[name].write_text(json.dumps(edited))
    for name, length in (("arabic", "٣"), ("superscript", "²"), ("short", "4096")):
        made[name] = tmp_path / f"trace_{name}.csv"
        made[name].write_text(f"length\n1024\n{length}\n" + "2048\n" * 8)
    return made


def invoke(entry, argv: list[str], monkeypatch, capsys) -> tuple[int, str, list[str]]:
    """A command run in this process: its exit code, stdout and stderr lines."""
    monkeypatch.setattr(sys, "argv", ["prog", *argv])
    try:
        entry()
        code = 0
    except SystemExit as done:
        code = done.code or 0
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


RUN, COMPARE = sim_run.cli, sim_compare.main
ONE_POLICY = ["--policies", "kk", "--baselines", "kk", "--oracles", ""]

# (command, arguments with {file} placeholders, what the one error line says)
BAD_INPUT = {
    "profile-absurdly-slow": (RUN, ["cost.profile={slow}"], "terms.attn_fwd.flops=1e+300 ms per FLOP"),
    "profile-faster-than-any-gpu": (RUN, ["cost.profile={fast}"], "TFLOP/s, faster than any GPU"),
    "results-not-finite": (RUN, ["cost=roofline", "cluster.peak_tflops=1e-305", "steps=1"],
                           "the run's step_ms is inf, not a finite number; nothing was written"),
    "compare-not-finite": (COMPARE, ["cost=roofline", "cluster.peak_tflops=1e-305", "steps=1", *ONE_POLICY],
                           "kk: a step time is not a finite number"),
    "trace-path-without-trace": (RUN, ["workload.trace_path={short}"], "is read only by the trace workload"),
    "trace-arabic-indic-digit": (RUN, ["workload=trace", "workload.trace_path={arabic}"], "row 2 has length '٣'"),
    "trace-superscript-digit": (RUN, ["workload=trace", "workload.trace_path={superscript}"],
                                "row 2 has length '²'"),
    "trace-is-a-directory": (RUN, ["workload=trace", "workload.trace_path={dir}"], "is a directory"),
    "trace-is-a-device": (RUN, ["workload=trace", "workload.trace_path=/dev/null"], "is not a regular file"),
    "profile-is-a-directory": (RUN, ["cost.profile={dir}"], "is a directory"),
    "profile-is-a-device": (RUN, ["cost.profile=/dev/null"], "is not a regular file"),
    "runner-preset": (RUN, ["+experiment=learning"], "experiment 'learning' is runner.train's preset"),
    "group-misspelt": (RUN, ["polcy=kk"], "(did you mean 'policy'?)"),
    "preset-group-misspelt": (RUN, ["experimnt=paper"], "(did you mean 'experiment'?)"),
    "option-misspelt": (RUN, ["policy=sparsebalanse"],
                        "unknown policy 'sparsebalanse' (did you mean 'sparsebalance'?)"),
    "compare-group-misspelt": (COMPARE, ["polcy=kk"], "(did you mean 'policy'?)"),
    "compare-option-misspelt": (COMPARE, ["--policies", "sparsebalanse"], "(did you mean 'sparsebalance'?)"),
    "compare-runner-preset": (COMPARE, ["experiment=learning"], "is runner.train's preset"),
    "compare-too-many-seeds": (COMPARE, ["--seeds", "100000"], "8 GPUs x 20 steps x --seeds 100000 x "),
    "sweep-without-processes": (RUN, ["-m", "policy=baseline,kk", "hydra.launcher.n_jobs=0"],
                                "hydra.launcher.n_jobs=0 is out of range"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, files, tmp_path, monkeypatch, capsys):
    entry, args, needle = BAD_INPUT[case]
    before = sorted(tmp_path.iterdir())
    args = pinned([a.format(**files) for a in args])
    if entry is RUN:
        args = [f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}", *args]
    code, _, err = invoke(entry, args, monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert needle in err[0]
    assert sorted(tmp_path.iterdir()) == before  # no run or sweep directory, nothing half-written


@pytest.mark.parametrize("path, what", [("/dev/null", "is not a regular file"), ("/", "a directory")])
def test_a_checkpoint_that_is_no_file_says_what_it_is(path, what):
    pytest.importorskip("torch")
    from sparsebalance.runner.checkpoint import Invalid, read

    with pytest.raises(Invalid, match=f"^{what}; allowed: a checkpoint file"):
        read(Path(path))


# (command, arguments, stderr lines expected)
GOOD_INPUT = {
    "run-preset-without-plus": (RUN, ["experiment=paper", "steps=1"], []),
    "compare-preset-with-plus": (COMPARE, ["+experiment=paper", "steps=1", *ONE_POLICY], []),
    "trace-shorter-than-the-run": (RUN, ["workload=trace", "workload.trace_path={short}", "steps=2"],
                                   ["warning: workload.trace_path='{short}' holds 10 sequences, fewer than the 2 steps "
                                    "x workload.global_batch=64 = 128 of the run, which goes through it 12.8 times, "
                                    "starting it over each time it ends"]),
}


@pytest.mark.parametrize("case", GOOD_INPUT)
def test_both_spellings_work_and_a_cycled_trace_is_said_once(case, files, tmp_path, monkeypatch, capsys):
    entry, args, expected = GOOD_INPUT[case]
    args = pinned([a.format(**files) for a in args])
    if entry is RUN:
        args = [f"hydra.run.dir={tmp_path / 'run'}", *args]
    code, out, err = invoke(entry, args, monkeypatch, capsys)
    assert code == 0 and err == [line.format(**files) for line in expected]
    assert "kk" in out if entry is COMPARE else (tmp_path / "run" / "summary.json").is_file()
    if entry is RUN:  # what the run wrote is readable by its group and others, as an ordinary write
        written = [p for p in (tmp_path / "run").rglob("*")]
        assert written and all(stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644) for p in written)


def test_help_lists_only_the_presets_sim_run_composes(monkeypatch, capsys):
    code, out, err = invoke(RUN, ["--help"], monkeypatch, capsys)
    line = next(line for line in out.splitlines() if line.startswith("experiment: "))
    assert code == 0 and err == []
    assert line.split(": ", 1)[1].split(" (")[0].split(", ") == preset_options("config")
    assert "learning" not in line and "paper" in line and "+experiment=<name>" in line


def test_compare_logs_its_progress_off_a_terminal(monkeypatch, capsys):
    """Off a terminal (pytest's captured stderr), a line per seed and per policy's steps once the clock says a
    log interval has passed: the clock here jumps 10 s at every reading."""
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(sim_progress, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    code, _, err = invoke(COMPARE, ["--seeds", "2", "steps=2", *ONE_POLICY, *pinned()], monkeypatch, capsys)
    assert code == 0
    assert any(line.startswith("sim.compare: seed 1/2 after ") for line in err), err
    assert any(line.startswith("kk: step 1/2 after ") for line in err), err


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_atomic_writes_get_the_permissions_of_an_ordinary_write(mask, tmp_path):
    os.umask(mask)
    (tmp_path / "ordinary").write_text("x")
    with atomic_path(tmp_path / "atomic") as tmp:
        tmp.write_text("x")
    with temporary_dir(tmp_path / "dir") as tmp:
        (tmp_path / "plain_dir").mkdir()
        os.replace(tmp, tmp_path / "dir")
    mode = stat.S_IMODE((tmp_path / "ordinary").stat().st_mode)
    assert stat.S_IMODE((tmp_path / "atomic").stat().st_mode) == mode == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "dir").stat().st_mode) == stat.S_IMODE((tmp_path / "plain_dir").stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atomic", "dir", "ordinary", "plain_dir"]


def test_every_atomic_writer_uses_the_shared_helper():
    """tempfile's mkstemp and mkdtemp make 0600 files and 0700 directories: no writer of the project calls them."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    callers = [path for path in tracked.stdout.split() if not path.startswith("tests/")
               and any(f"{name}(" in (ROOT / path).read_text() for name in ("mkstemp", "mkdtemp"))]
    assert callers == []


def test_profile_bounds_follow_the_clusters_peaks():
    """The fastest a profile may price a FLOP is the 2:4-sparse peak of the fastest GPU in conf/cluster (twice its
    dense bf16 peak); the slowest, 1 GFLOP/s, below a hundred-thousandth of the slowest dense peak."""
    peaks = [yaml.safe_load(path.read_text()).get("peak_tflops") for path in (CONF_DIR / "cluster").glob("*.yaml")]
    peaks = [p * 1e9 for p in peaks if p is not None]  # FLOP per ms
    assert FASTEST_FLOPS_PER_MS >= 2 * max(peaks) and SLOWEST_FLOPS_PER_MS <= 1e-5 * min(peaks)


# ----------------------------------------------------------------------------- Ctrl-C
def interrupt(argv: list[str], ready, timeout_s: float = 600) -> tuple[int, list[str]]:
    """Start a command, wait until ``ready()`` says it is running, send SIGINT to its process group (what Ctrl-C
    in a terminal does: the joblib workers and torchrun ranks get it too); its exit code and stderr lines. Both
    waits are bounds for a stuck command, not figures of speed: a loaded machine may take minutes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # a child of a shell's background job would inherit SIGINT ignored
                            preexec_fn=lambda: (signal.signal(signal.SIGINT, signal.SIG_DFL), os.umask(0o022)))
    try:
        deadline = time.monotonic() + timeout_s
        while not ready(proc):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err.splitlines()


def temporaries(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if TEMPORARY.match(p.name)] if path.exists() else []


def test_ctrl_c_in_a_garbage_collection_callback_prints_nothing(monkeypatch, capsys):
    """Ctrl-C can land while Python runs a weakref's callback, which cannot raise: Python's own hook prints it as
    "Exception ignored in" and a traceback (a CI sweep's Ctrl-C did). The commands drop that one exception; any
    other unraisable exception is still printed."""
    def collect_raising(exc):
        class Box:
            """An object a weakref can watch."""
        box = Box()
        ref = weakref.ref(box, lambda _: (_ for _ in ()).throw(exc))
        del box
        return ref

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    collect_raising(KeyboardInterrupt())
    assert "Exception ignored in" in capsys.readouterr().err  # the default, without the commands' hook
    quiet_interrupts_in_callbacks()
    collect_raising(KeyboardInterrupt())
    assert capsys.readouterr().err == ""
    collect_raising(ValueError("kept"))
    assert "ValueError: kept" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_in_a_run_removes_its_directory(tmp_path):
    run = tmp_path / "run"
    code, err = interrupt(["sim.run", f"hydra.run.dir={run}", "steps=30000", *pinned()],
                          ready=lambda _: (run / ".hydra").is_dir())
    assert code == 130 and err == ["interrupted"]
    assert not run.exists()


@pytest.mark.slow
def test_ctrl_c_in_a_sweep_keeps_finished_jobs_only(tmp_path):
    sweep = tmp_path / "sweep"
    code, err = interrupt(["sim.run", "-m", f"hydra.sweep.dir={sweep}", "steps=1,30000", "hydra.launcher.n_jobs=2",
                           *pinned()],
                          ready=lambda _: ((sweep / "0" / "summary.json").is_file()
                                           and (sweep / "1" / ".hydra").is_dir()))
    assert code == 130 and err == [f"interrupted; 1 finished job kept in {sweep}"]
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]
    assert (sweep / "0" / "summary.json").is_file() and temporaries(sweep) == []


def test_ctrl_c_in_a_comparison_is_one_line():
    """Sent once the comparison runs, after its trace warning (the shipped trace is shorter than the run)."""
    first: list[str] = []
    code, err = interrupt(["sim.compare", "workload=trace", "steps=30000", *ONE_POLICY, *pinned()],
                          ready=lambda proc: first.append(proc.stderr.readline()) or True)
    assert first[0].startswith("warning: workload.trace_path=")
    assert code == 130 and err == ["interrupted"]


@pytest.mark.slow
def test_ctrl_c_in_training_keeps_the_steps_written_and_says_so(tmp_path):
    pytest.importorskip("torch")
    run = tmp_path / "run"
    code, err = interrupt(["runner.train", f"hydra.run.dir={run}", *TINY_RUNNER, "steps=2000"],
                          ready=lambda _: (run / "summary.json").is_file())
    assert code == 130 and len(err) == 1, err
    assert err[0].startswith(f"interrupted; {run} keeps the results of ") and err[0].endswith(" of 2000 steps")
    assert temporaries(run) == []
    written = [p for p in run.iterdir() if p.is_file() and p.suffix in (".csv", ".json")]
    assert {p.name for p in written} >= {"train.csv", "sequences.csv", "summary.json", "steps.csv"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in written)
