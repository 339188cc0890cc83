"""``python -m sim.provisional`` writes the roofline-derived profile beside the measured one,
never over it unless asked (``--replace-measured``)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pinned import PINNED_PROFILE
from sparsebalance.sim import provisional
from sparsebalance.sim.config import CostConfig
from sparsebalance.sim.core import resolve_path
from sparsebalance.sim.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]


def write_provisional(capsys, *args: str) -> tuple[int, str]:
    """Exit status and stderr of sim.provisional's command line, run in this process."""
    try:
        code = provisional.main([*args])
    except SystemExit as done:
        code = done.code
    return code, capsys.readouterr().err


def test_the_default_target_is_not_the_simulators_default_profile(tmp_path, monkeypatch, capsys):
    assert resolve_path(provisional.PROVISIONAL_OUT) != resolve_path(CostConfig().profile)
    monkeypatch.setattr(provisional, "PROVISIONAL_OUT", str(tmp_path / "provisional.json"))
    assert write_provisional(capsys) == (0, "")
    written = load_profile(str(tmp_path / "provisional.json"))
    assert written["provisional"] is True and "sim.provisional" in written["meta"]["command"]


def test_a_provisional_profile_is_replaced_without_asking(tmp_path, capsys):
    out = tmp_path / "provisional.json"
    out.write_text(json.dumps({"provisional": True, "stale": True}))
    assert write_provisional(capsys, "--out", str(out)) == (0, "")
    assert "stale" not in load_profile(str(out))


@pytest.mark.parametrize("existing", ["measured", "unreadable"])
def test_a_measured_profile_is_kept_unless_asked(tmp_path, capsys, existing):
    out = tmp_path / "h200.json"
    if existing == "measured":
        shutil.copy(PINNED_PROFILE, out)
    else:
        out.write_text("{not json")
    before = out.read_bytes()
    code, err = write_provisional(capsys, "--out", str(out))
    assert code == 2 and err.splitlines() == [
        f"error: --out={out}: holds a measured (not provisional) profile; pass --replace-measured to overwrite "
        "it with the roofline-derived one"]
    assert out.read_bytes() == before and sorted(tmp_path.iterdir()) == [out]
    assert write_provisional(capsys, "--out", str(out), "--replace-measured") == (0, "")
    assert load_profile(str(out))["provisional"] is True


def test_the_refusal_from_the_shell_is_one_line(tmp_path):
    out = tmp_path / "h200.json"
    shutil.copy(PINNED_PROFILE, out)
    done = subprocess.run([sys.executable, "-m", "sparsebalance.sim.provisional", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert out.read_bytes() == PINNED_PROFILE.read_bytes()
