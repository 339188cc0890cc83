"""Checkpoints are data: saved as tensors, numbers, strings, lists and dicts, read with weights_only, and
refused in one line when they are not a checkpoint this run can continue.

One real 1-rank CPU run writes the checkpoint every test starts from; a resumed run must continue it
exactly as the uninterrupted run goes on; every way of spoiling the file is refused by the runner's front
door before Hydra makes a run dir or any process group exists, and a pickled payload is refused unread.
"""
from __future__ import annotations

import copy
import io
import json
import os
import pickle
import random
import socket
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from sparsebalance.runner import checkpoint
from sparsebalance.runner.train import check_inputs
from sparsebalance.sim.core import ConfigError
from tiny import ONE_RANK, TINY_ONE_RANK

ROOT = Path(__file__).resolve().parents[2]
# A warmup longer than the first run: the resumed run must continue the LR curve, not restart it.
OVERRIDES = [*TINY_ONE_RANK, "runner.lr=1e-2", "runner.warmup_steps=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python -m runner.train`` as a user runs it: a world of one on the CPU."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    cmd = [sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={run_dir}", *OVERRIDES, *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def half(once) -> Path:
    """A 1-step run with its checkpoint: what the checks of a bad or mismatched checkpoint start from (one run
    per session, however many xdist workers share this module's tests)."""
    return once("checkpoint_half", lambda run: ok(train(run, "steps=1", "runner.checkpoint_every=1")))


@pytest.fixture(scope="module")
def runs(half, once) -> dict[str, Path]:
    """The 1-step run, the 2-step run resumed from its checkpoint, and the same 2 steps uninterrupted."""
    def make(root: Path) -> None:
        ok(train(root / "resumed", "steps=2", "runner.checkpoint_every=2", f"runner.resume={half / 'checkpoint.pt'}"))
        ok(train(root / "full", "steps=2", "runner.checkpoint_every=2"))

    root = once("checkpoint_runs", make)
    return {"half": half, "resumed": root / "resumed", "full": root / "full"}


@pytest.fixture(scope="module")
def good(half) -> Path:
    return half / "checkpoint.pt"


def read(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------- round trip
@pytest.mark.slow
def test_resume_continues_exactly_where_the_uninterrupted_run_goes(runs):
    full, resumed = read(runs["full"] / "checkpoint.pt"), read(runs["resumed"] / "checkpoint.pt")
    assert resumed["next_step"] == full["next_step"] == 2
    assert resumed["model"].keys() == full["model"].keys()
    for key, tensor in full["model"].items():
        assert torch.equal(resumed["model"][key], tensor), key
    full_state, resumed_state = full["optimizer"]["state"], resumed["optimizer"]["state"]
    assert resumed_state.keys() == full_state.keys()
    for index, state in full_state.items():
        for name, tensor in state.items():
            assert torch.equal(resumed_state[index][name], tensor), (index, name)
    assert resumed["optimizer"]["param_groups"] == full["optimizer"]["param_groups"]  # the LR after step 1 too
    loss = [pd.read_csv(runs[r] / "train.csv")["loss"] for r in ("full", "resumed")]
    pd.testing.assert_series_equal(*loss, check_exact=True)
    assert (runs["resumed"] / "plans.jsonl").read_bytes() == (runs["full"] / "plans.jsonl").read_bytes()


@pytest.mark.slow
def test_resume_restores_the_rng_states_it_saved(runs):
    """Training draws no random numbers, so the resumed run ends with the states it restored; numpy's and
    Python's generators are seeded by the OS in each process, so they match only if restored."""
    saved = read(runs["half"] / "checkpoint.pt")["rng"]
    ended = read(runs["resumed"] / "checkpoint.pt")["rng"]
    assert torch.equal(ended[0]["torch"], saved[0]["torch"])
    assert ended[0]["numpy"] == saved[0]["numpy"]
    assert ended[0]["python"] == saved[0]["python"]


def test_rng_states_survive_a_weights_only_round_trip_bit_for_bit():
    def draws():
        return torch.rand(8).tolist(), np.random.random(8).tolist(), [random.random() for _ in range(8)]

    np.random.normal()  # a cached Gaussian is part of numpy's state
    state = checkpoint.rng_state()
    expected = draws()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    buffer.seek(0)
    checkpoint.set_rng_state(torch.load(buffer, weights_only=True))
    assert draws() == expected


# ---------------------------------------------------------------------- saving
def test_a_save_that_fails_midway_keeps_the_old_checkpoint_and_leaves_no_temp_file(good, tmp_path, monkeypatch):
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(good.read_bytes())
    content = read(good)

    def torn_save(obj, f, **kwargs):
        Path(f).write_bytes(good.read_bytes()[:100])
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        save_like(target, content)
    assert target.read_bytes() == good.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_save_fsyncs_the_file_before_the_rename_and_the_directory_after(good, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode)
                                                                else "file"), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b)))
    save_like(tmp_path / "checkpoint.pt", read(good))
    assert events == ["file", "replace", "dir"]
    assert read(tmp_path / "checkpoint.pt")["next_step"] == 1


def save_like(path: Path, content: dict) -> None:
    """``checkpoint.save`` of a loaded checkpoint's content."""
    checkpoint.save(path, model_state=content["model"], optimizer_state=content["optimizer"],
                    next_step=content["next_step"], rng_states=content["rng"], history=content["history"],
                    config=content["config"])


# ---------------------------------------------------------------------- bad checkpoints
class Payload:
    """Pickles as a call that creates ``marker``: what a checkpoint from elsewhere could carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def torch_bytes(content) -> bytes:
    buffer = io.BytesIO()
    torch.save(content, buffer)
    return buffer.getvalue()


def edited(edit):
    """A checkpoint made from the good one's content with ``edit(content)`` applied."""
    def make(good: Path, marker: Path) -> bytes:
        content = copy.deepcopy(read(good))
        edit(content)
        return torch_bytes(content)
    return make


def flipped_tensor_byte(good: Path, marker: Path) -> bytes:
    data = bytearray(good.read_bytes())
    weights = max(read(good)["model"].values(), key=torch.numel).numpy().tobytes()
    at = bytes(data).find(weights)  # torch stores tensors uncompressed
    assert at > 0
    data[at + len(weights) // 2] ^= 0xFF
    return bytes(data)


def with_payload(good: Path, marker: Path) -> bytes:
    content = read(good)
    content["history"]["steps"] = Payload(marker)
    return torch_bytes(content)


def other_plan(content: dict) -> None:
    plan = json.loads(content["history"]["plans"][0])
    plan["assignments"][0]["length"] += 1
    content["history"]["plans"][0] = json.dumps(plan)


BAD = {
    # name: (the file's bytes from (good checkpoint, marker path), what the one line must say)
    "truncated to 10 bytes": (lambda g, m: g.read_bytes()[:10], "not a torch checkpoint"),
    "truncated to half": (lambda g, m: g.read_bytes()[: g.stat().st_size // 2], "not a torch checkpoint"),
    "truncated by one byte": (lambda g, m: g.read_bytes()[:-1], "not a torch checkpoint"),
    "empty": (lambda g, m: b"", "not a torch checkpoint"),
    "random bytes": (lambda g, m: np.random.default_rng(0).bytes(4096), "not a torch checkpoint"),
    "JSON": (lambda g, m: json.dumps({"model": {}, "next_step": 1}).encode(), "not a torch checkpoint"),
    "a plain pickle": (lambda g, m: pickle.dumps({"next_step": 1}), "not a torch checkpoint"),
    "a torch file of a bare state dict": (lambda g, m: torch_bytes({"weight": torch.zeros(2)}),
                                          "not a runner checkpoint"),
    "a checkpoint of the previous version": (edited(lambda c: c.update(version=1)),
                                             "checkpoint version 1; this runner reads version 2"),
    "missing the RNG states": (edited(lambda c: c.pop("rng")), "lacks the key(s) 'rng'"),
    "next_step as a string": (edited(lambda c: c.update(next_step="1")), "next_step='1'"),
    "a float tensor as torch RNG state": (edited(lambda c: c["rng"][0].update(torch=torch.zeros(5056))),
                                          "rng[0].torch is not a generator state"),
    "a short numpy RNG state": (edited(lambda c: c["rng"][0]["numpy"].update(keys=[1, 2, 3])),
                                "rng[0].numpy is not a numpy RNG state"),
    "a Python RNG state of strings": (edited(lambda c: c["rng"][0]["python"].update(internal="abc")),
                                      "rng[0].python is not a python RNG state"),
    "a loss that is a string": (edited(lambda c: c["history"]["train"][0].update(loss="low")),
                                "history.train[0]['loss']='low' is a str; allowed: float"),
    "history shorter than next_step": (edited(lambda c: c.update(next_step=2)), "holds 1 steps, but next_step=2"),
    "a parameter of another shape": (edited(lambda c: c["model"].update({next(iter(c["model"])): torch.zeros(3)})),
                                     "has shape (3,)"),
    "a Plan this config does not plan": (edited(other_plan), "its Plan of step 0 is not the one this config plans"),
    "RNG states of two ranks": (edited(lambda c: c["rng"].append(c["rng"][0])), "written by 2 ranks, this run has 1"),
    "a flipped byte in a tensor": (flipped_tensor_byte, "fails its CRC check"),
    "a pickled payload": (with_payload, "refused unread"),
}


@pytest.fixture
def spoil(good, tmp_path):
    """Write the named bad checkpoint; returns its path and the payload's marker path."""
    marker = tmp_path / "payload_ran"

    def make(name: str) -> tuple[Path, Path]:
        path = tmp_path / "bad" / "checkpoint.pt"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(BAD[name][0](good, marker))
        return path, marker

    return make


@pytest.mark.parametrize("name", BAD)
def test_a_bad_checkpoint_is_one_line_naming_the_file(spoil, tmp_path, name):
    path, marker = spoil(name)
    before = path.read_bytes()
    with pytest.raises(ConfigError) as exc:
        check_inputs([f"hydra.run.dir={tmp_path / 'run'}", *OVERRIDES, "steps=3", f"runner.resume={path}"], ONE_RANK)
    message = str(exc.value)
    assert message.startswith(f"runner.resume={path}: ") and "\n" not in message
    assert BAD[name][1] in message
    assert not marker.exists()
    assert path.read_bytes() == before
    assert not (tmp_path / "run").exists()


def test_the_payload_runs_when_loaded_without_weights_only(spoil):
    """The refusal above is not for want of a live payload."""
    path, marker = spoil("a pickled payload")
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("override, message", [
    ("runner.lr=2e-2", "written with a different config (runner.lr differ)"),
    ("steps=1", "steps=1: the checkpoint runner.resume="),
])
def test_a_checkpoint_this_run_cannot_continue_is_one_line(good, tmp_path, override, message):
    with pytest.raises(ConfigError, match="allowed: ") as exc:
        check_inputs([*OVERRIDES, "steps=3", override, f"runner.resume={good}"], ONE_RANK)
    assert message in str(exc.value)


def test_a_decaying_lr_schedule_resumes_only_with_the_steps_it_spans(good, tmp_path):
    path = tmp_path / "cosine" / "checkpoint.pt"
    content = read(good)
    content["config"]["runner.lr_schedule"] = "cosine"
    save_like(path, content)
    with pytest.raises(ConfigError) as exc:
        check_inputs([*OVERRIDES, "steps=3", "runner.lr_schedule=cosine", f"runner.resume={path}"], ONE_RANK)
    assert str(exc.value) == (f"steps=3: the checkpoint runner.resume={path} decays its LR (runner.lr_schedule=cosine) "
                              "over steps=1; allowed: steps=1 (only a constant schedule's run may grow)")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["truncated to half", "a pickled payload"])
def test_the_cli_refuses_a_bad_checkpoint_in_one_line_and_writes_nothing(spoil, tmp_path, name):
    path, marker = spoil(name)
    before = path.read_bytes()
    proc = train(tmp_path / "run", "steps=3", f"runner.resume={path}")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: runner.resume={path}: "), proc.stderr
    assert BAD[name][1] in lines[0]
    assert not marker.exists()
    assert path.read_bytes() == before
    assert not (tmp_path / "run").exists()
