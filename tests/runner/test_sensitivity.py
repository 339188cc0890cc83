"""``python -m runner.sensitivity`` on a tiny CPU checkpoint (the reference attention): a row per (sequence, layer,
budget), per-layer figures through the tap that agree with the model's own layer mean, packed copies that measure
what each budget alone measures, identical files from identical runs, one line for bad input; and the whole path,
checkpoint -> runner.sensitivity -> calibrate.sensitivity -> sim.run with the fitted profile."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from omegaconf import OmegaConf

from sparsebalance.calibrate import sensitivity as calibrate_sensitivity
from sparsebalance.runner import sensitivity
from sparsebalance.runner.attention import make_attention
from sparsebalance.runner.task import make_example
from sparsebalance.sim.config import RunConfig
from sparsebalance.sim.sensitivity import RAW_COLUMNS, load_sensitivity_profile, raw_meta_path
from sparsebalance.sim.workload import Workload
from pinned import PINNED_OVERRIDES
from tiny import TINY_ONE_RANK

pytestmark = pytest.mark.slow  # every test reads the checkpoint of a training run
ROOT = Path(__file__).resolve().parents[2]
LAYERS = 2
# The tiny run: two layers, block size 32, context 512.
OVERRIDES = [o for o in TINY_ONE_RANK if not o.startswith("model.layers=")] + [f"model.layers={LAYERS}"]
CPU = torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint_dir(once) -> Path:
    """A run dir with the checkpoint of one training step on the CPU, made once per session (its tests, which
    only read it, may run on different xdist workers)."""
    return once("sensitivity-checkpoint", _train)


def _train(run_dir: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    proc = subprocess.run([sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={run_dir}", *OVERRIDES,
                           "steps=1", "runner.checkpoint_every=1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def trained(checkpoint_dir):
    return sensitivity.load_trained(checkpoint_dir, CPU, torch.float32)


def measure(capsys, *argv) -> tuple[int, str]:
    try:
        code = sensitivity.main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_the_checkpoint_gives_its_model_task_and_block_size(trained):
    assert sorted(trained.model.blocks) == ["0", "1"]
    assert trained.task.name == "retrieval" and trained.task.n_keys == 16
    assert trained.block_size == 32 and trained.steps == 1 and trained.seed == 5


def test_the_tap_records_each_layer_and_their_mean_is_the_models(trained):
    example = make_example(trained.task, trained.vocab, trained.seed, sensitivity.HELD_OUT, 256, 0.5)
    tap = sensitivity.LayerTap(make_attention("kernel", trained.block_size))
    cu = torch.tensor([0, 256], dtype=torch.int32)
    with torch.no_grad():
        out = trained.model(torch.as_tensor(example.tokens), cu, (torch.tensor([0.8]), None), torch.tensor([255]), tap)
    assert len(tap.calls) == LAYERS
    kept = np.array([k for k, _ in tap.calls])
    coverage = np.array([c for _, c in tap.calls])
    np.testing.assert_allclose(kept.mean(axis=0), out.kept_fraction.numpy(), rtol=1e-6)
    np.testing.assert_allclose(coverage.mean(axis=0), out.coverage.numpy(), rtol=1e-6)


def test_packed_copies_measure_what_each_budget_alone_measures(trained):
    tokens = make_example(trained.task, trained.vocab, trained.seed, sensitivity.HELD_OUT + 1, 256, 0.7).tokens
    attend = make_attention("kernel", trained.block_size)
    for mode, budgets in (("p", [0.5, 0.9]), ("kept", [0.1, 0.5])):
        packed = sensitivity.forward_copies(trained, tokens, mode, budgets, attend, CPU)
        for i, b in enumerate(budgets):
            alone = sensitivity.forward_copies(trained, tokens, mode, [b], attend, CPU)
            for layer in range(LAYERS):
                np.testing.assert_allclose(packed[layer][0][i], alone[layer][0][0], rtol=1e-5)
                np.testing.assert_allclose(packed[layer][1][i], alone[layer][1][0], rtol=1e-5)


def test_the_csv_has_a_row_per_sequence_layer_and_budget_and_repeats_exactly(checkpoint_dir, tmp_path, capsys):
    args = ["--lengths", "256,128", "--p", "0.5,0.9", "--kept", "0.25", "--sequences", "2", "--max-tokens", "300"]
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    assert measure(capsys, checkpoint_dir, *args, "--out", a)[0] == 0
    assert measure(capsys, checkpoint_dir / "checkpoint.pt", *args, "--out", b)[0] == 0
    assert a.read_bytes() == b.read_bytes()
    raw = pd.read_csv(a)
    assert list(raw.columns) == list(RAW_COLUMNS) and len(raw) == 4 * LAYERS * 3
    assert sorted(raw["length"].unique()) == [128, 256] and sorted(raw["layer"].unique()) == [0, 1]
    assert raw["seq_id"].min() == sensitivity.HELD_OUT and raw["seq_id"].nunique() == 4
    top_p = raw[raw["mode"] == "p"]
    assert (top_p["coverage"] >= top_p["budget"] - 1e-6).all()  # top-p keeps at least p of the routing mass
    assert raw.groupby(["seq_id", "layer", "mode"])["kept_fraction"].is_monotonic_increasing.all()
    facts = json.loads(raw_meta_path(a).read_text())
    assert facts["task"] == {"retrieval": {"kind": "retrieval", "n_keys": 16, "n_values": 16, "max_pairs": 4,
                                           "n_queries": 2}}
    assert facts["model"]["layers"] == LAYERS and facts["block_size"] == 32 and facts["trained_steps"] == 1


def test_the_block_size_can_be_the_one_training_will_use(checkpoint_dir, tmp_path, capsys):
    """A checkpoint trained at block 32 measured at its own block (the same bytes as without the flag) and at 16:
    more, smaller blocks per sequence, so a top-p target keeps less of the sequence on average."""
    args = ["--lengths", "256", "--p", "0.5,0.9", "--sequences", "2"]
    default, at_32, at_16 = tmp_path / "default.csv", tmp_path / "b32.csv", tmp_path / "b16.csv"
    assert measure(capsys, checkpoint_dir, *args, "--out", default)[0] == 0
    assert measure(capsys, checkpoint_dir, *args, "--block-size", "32", "--out", at_32)[0] == 0
    assert measure(capsys, checkpoint_dir, *args, "--block-size", "16", "--out", at_16)[0] == 0
    assert default.read_bytes() == at_32.read_bytes()
    assert json.loads(raw_meta_path(at_16).read_text())["block_size"] == 16
    assert pd.read_csv(at_16)["kept_fraction"].mean() < pd.read_csv(at_32)["kept_fraction"].mean() - 0.02


def test_a_run_cut_short_keeps_the_lengths_it_finished(checkpoint_dir, tmp_path, capsys, monkeypatch):
    real = sensitivity.measure_sequence

    def stop_at_256(trained, seq, *args):
        if seq.length == 256:
            raise KeyboardInterrupt  # a time limit's kill
        return real(trained, seq, *args)

    monkeypatch.setattr(sensitivity, "measure_sequence", stop_at_256)
    out = tmp_path / "raw.csv"
    with pytest.raises(SystemExit) as stopped:
        sensitivity.main([str(checkpoint_dir), "--lengths", "128,256", "--p", "0.9", "--sequences", "2",
                          "--out", str(out)])
    assert stopped.value.code == 130  # Ctrl-C: one line, no traceback
    assert capsys.readouterr().err.splitlines()[-1] == "interrupted"  # progress lines, then one line, no traceback
    raw = pd.read_csv(out)
    assert raw["length"].unique().tolist() == [128] and len(raw) == 2 * LAYERS
    assert json.loads(raw_meta_path(out).read_text())["lengths"] == [128, 256]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.csv", "raw.meta.json"]


def _garbage(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"not a checkpoint")
    return path


def _edited(checkpoint_dir: Path, tmp_path: Path, edit) -> Path:
    content = torch.load(checkpoint_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    edit(content)
    path = tmp_path / "checkpoint.pt"
    torch.save(content, path)
    return path


def test_a_checkpoint_whose_history_an_older_runner_wrote_is_measured(checkpoint_dir, tmp_path, capsys):
    path = _edited(checkpoint_dir, tmp_path, lambda c: c["history"]["train"][0].pop("loss"))
    out = tmp_path / "raw.csv"
    assert measure(capsys, path, "--lengths", "128", "--sequences", "1", "--p", "0.9", "--out", out)[0] == 0
    assert len(pd.read_csv(out)) == LAYERS


@pytest.mark.parametrize("source, args, needle", [
    (lambda d, t: t / "missing.pt", [], "missing.pt: no such file"),
    (lambda d, t: t, [], "checkpoint.pt: no such file"),
    (lambda d, t: _garbage(t), [], "not a torch checkpoint"),
    (lambda d, t: _edited(d, t, lambda c: c.update(version=1)), [],
     "checkpoint version 1; this runner reads version 2"),
    (lambda d, t: _edited(d, t, lambda c: c["config"].pop("runner.task")), [], "its config lacks runner.task"),
    (lambda d, t: _edited(d, t, lambda c: c["model"].popitem()), [], "its weights do not fit its model config"),
    (lambda d, t: d, ["--lengths", "1024"], "--lengths: 1024 is outside [25, 512]"),
    (lambda d, t: d, ["--lengths", "128,abc"], "--lengths '128,abc' is not a comma-separated list of ints"),
    (lambda d, t: d, ["--p", "0,0.5"], "--p '0,0.5': 0.0 is not allowed; allowed: coverage targets in (0, 1]"),
    (lambda d, t: d, ["--kept", "1"], "--kept '1': 1.0 is not allowed; allowed: kept fractions in (0, 1)"),
    (lambda d, t: d, ["--sequences", "0"], "--sequences 0: allowed: a whole number >= 1"),
    (lambda d, t: d, ["--attention", "flash"], "--attention='flash' is unknown; allowed: kernel, triton, naive"),
    (lambda d, t: d, ["--device", "tpu"], "--device='tpu' is unknown; allowed: auto, cuda, cpu"),
    (lambda d, t: d, ["--block-size", "48"], "--block-size 48: allowed: 16, 32, 64, 128"),
])
def test_bad_input_is_one_line_and_writes_nothing(checkpoint_dir, tmp_path, capsys, source, args, needle):
    out = tmp_path / "raw.csv"
    argv = [source(checkpoint_dir, tmp_path), "--lengths", "128", *args, "--out", out]
    code, err = measure(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert not out.exists() and not raw_meta_path(out).exists()


def test_an_out_that_cannot_be_written_is_one_line_before_any_measurement(checkpoint_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code, err = measure(capsys, checkpoint_dir, "--lengths", "128", "--sequences", "1", "--out",
                        tmp_path / "file" / "raw.csv")
    assert code == 2 and err.count("\n") == 1 and "raw.csv' cannot be written (Not a directory)" in err, err


def test_checkpoint_to_simulator(checkpoint_dir, tmp_path, capsys):
    """The whole path on the CPU: measure, fit, and simulate with the fitted profile."""
    raw, profile = tmp_path / "raw.csv", tmp_path / "sensitivity_tiny.json"
    assert measure(capsys, checkpoint_dir, "--lengths", "128,256", "--p", "0.5,0.9", "--kept", "0.1,0.25",
                   "--sequences", "4", "--out", raw)[0] == 0
    assert calibrate_sensitivity.main([str(raw), "--out", str(profile)]) == 0
    written = json.loads(profile.read_text())
    assert written["fit"]["tasks"]["retrieval"]["sequences"] == {"fit": 6, "heldout": 2, "clipped": 0, "dense": 0}
    assert written["meta"]["task"]["retrieval"]["n_keys"] == 16
    model = load_sensitivity_profile(str(profile))
    assert model.task == "retrieval" and model.lengths[0] == 128 and model.lengths[-1] == 256
    run_dir = tmp_path / "sim"
    sim = subprocess.run([sys.executable, "-m", "sparsebalance.sim.run", f"hydra.run.dir={run_dir}", *PINNED_OVERRIDES,
                          "steps=2", "layout.micro_batches=2", "workload.global_batch=16",
                          f"workload.sensitivity_profile={profile}", "baseline=null"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert sim.returncode == 0, sim.stderr
    # the sequences the run simulated: its workload's draws (Plans carry lengths, not sensitivities)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig),
                                              OmegaConf.load(run_dir / ".hydra" / "config.yaml")))
    workload = Workload(cfg.workload, cfg.model.max_context, cfg.seed)
    batches = [workload.batch(step) for step in range(cfg.steps)]
    planned = [(a["seq_id"], a["length"]) for line in (run_dir / "plans.jsonl").read_text().splitlines()
               for a in json.loads(line)["assignments"]]
    assert sorted(planned) == sorted((q.id, q.length) for batch in batches for q in batch)
    s = np.array([q.sensitivity for batch in batches for q in batch])
    lengths = np.array([q.length for batch in batches for q in batch])
    # every draw inside the profile's spread: within 6 standard deviations of its mean in logit space
    z = np.log(s / (1 - s))
    assert np.all(np.abs(z - model.mean(lengths)) <= 6 * model.std(lengths) + 1e-6)
