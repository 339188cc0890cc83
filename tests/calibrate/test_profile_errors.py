"""Bad profile files at the front door: ``python -m sim.run cost.profile=<file>`` exits 2 with one
``error:`` line naming the key and its value, no traceback, and no run directory left behind.

The cases call sim.run's entry point in this process (the refusal happens before Hydra's app starts); one case
and the good profile run it as a process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pinned import PINNED_PROFILE
from sparsebalance.sim.run import cli

ROOT = Path(__file__).resolve().parents[2]


def edited(change) -> str:
    """The pinned profile as JSON text after ``change(profile)``; Python's json writes nan/inf as NaN/Infinity."""
    profile = json.loads(PINNED_PROFILE.read_text())
    change(profile)
    return json.dumps(profile)


def setter(path: tuple[str, ...], value):
    def change(profile):
        node = profile
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


# (id, file content, what the error line must name)
CASES = [
    ("missing-coefficient", edited(lambda p: p["terms"]["attn_fwd"].pop("q_blocks")),
     "terms.attn_fwd.q_blocks is missing"),
    ("unknown-feature", edited(setter(("terms", "layer_fwd", "blocks"), 1e-9)),
     "terms.layer_fwd.blocks: unknown feature"),
    ("nan-coefficient", edited(setter(("terms", "attn_bwd", "flops"), float("nan"))), "terms.attn_bwd.flops=nan"),
    ("inf-coefficient", edited(setter(("terms", "select", "const"), float("inf"))), "terms.select.const=inf"),
    ("negative-coefficient", edited(setter(("terms", "layer_bwd", "tokens"), -1e-6)),
     "terms.layer_bwd.tokens=-1e-06"),
    ("string-coefficient", edited(setter(("terms", "attn_fwd", "const"), "0.02")),
     "terms.attn_fwd.const='0.02': not a number"),
    ("bool-coefficient", edited(setter(("terms", "attn_fwd", "flops"), True)),
     "terms.attn_fwd.flops=True: not a number"),
    ("term-not-an-object", edited(setter(("terms", "select"), [0.1, 0.2])), "terms.select=[0.1, 0.2]"),
    ("missing-term", edited(lambda p: p["terms"].pop("select")),
     "terms=['attn_bwd', 'attn_fwd', 'layer_bwd', 'layer_fwd']"),
    ("extra-term", edited(setter(("terms", "embed"), {"const": 0.1})), "'embed'"),
    ("schema-version", edited(setter(("schema_version",), 1)),
     "schema_version=1: this simulator reads 2; refit the profile from its raw measurements"),
    ("schema-version-string", edited(setter(("schema_version",), "1")), "schema_version='1'"),
    ("block-size-zero", edited(setter(("block_size",), 0)), "block_size=0: must be a positive integer"),
    ("block-size-float", edited(setter(("block_size",), 128.5)), "block_size=128.5: must be a positive integer"),
    ("block-size-bool", edited(setter(("block_size",), True)), "block_size=True: must be a positive integer"),
    ("provisional-not-bool", edited(setter(("provisional",), "no")), "provisional='no': must be true or false"),
    ("missing-terms", edited(lambda p: p.pop("terms")), "missing key 'terms'"),
    ("truncated-json", PINNED_PROFILE.read_text()[:200], "not valid JSON"),
    ("empty-file", "", "not valid JSON"),
    ("top-level-array", "[1, 2, 3]", "the top level is an array; a profile is a JSON object"),
    ("top-level-number", "128", "the top level is a number"),
]


def sim_run(profile: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    command = [sys.executable, "-m", "sparsebalance.sim.run", f"cost.profile={profile}", f"hydra.run.dir={run_dir}",
               *overrides]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def sim_run_here(profile: Path, run_dir: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["sim.run", f"cost.profile={profile}", f"hydra.run.dir={run_dir}"])
    with pytest.raises(SystemExit) as exc:
        cli()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def check_refusal(code: int, stdout: str, stderr: str, needle: str, profile: Path, run_dir: Path) -> None:
    lines = stderr.splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert needle in lines[0] and f"cost.profile='{profile}'" in lines[0], lines[0]
    assert "Traceback" not in stderr + stdout
    assert not run_dir.exists()


@pytest.mark.parametrize("content, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_profile_is_one_error_line_and_leaves_nothing(tmp_path, content, needle, monkeypatch, capsys):
    profile = tmp_path / "bad.json"
    profile.write_text(content)
    check_refusal(*sim_run_here(profile, tmp_path / "run", monkeypatch, capsys), needle, profile, tmp_path / "run")


def test_the_process_exits_with_the_one_line(tmp_path):
    _, content, needle = CASES[0]
    profile = tmp_path / "bad.json"
    profile.write_text(content)
    run = sim_run(profile, tmp_path / "run")
    check_refusal(run.returncode, run.stdout, run.stderr, needle, profile, tmp_path / "run")


def test_the_pinned_profile_itself_runs(tmp_path):
    """The cases above fail for what was changed, not for what they start from."""
    run = sim_run(PINNED_PROFILE, tmp_path / "run", "steps=2", "baseline=null")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "run" / "summary.json").is_file()
