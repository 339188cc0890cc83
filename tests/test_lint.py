"""The maintainer's static checks, with their settings in pyproject.toml: ruff's lint rules over the project,
and mypy over the packages it checks, resolving ``sparsebalance.*`` through the links in ``sparsebalance/``."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    pytest.importorskip("ruff")  # in the test extra
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.slow
def test_mypy_finds_nothing_in_the_packages_it_checks(tmp_path):
    api = pytest.importorskip("mypy.api")
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path)])
    assert status == 0, out[-3000:] + err


@pytest.mark.slow
def test_mypy_resolves_the_sparsebalance_names_to_the_top_level_folders(tmp_path, monkeypatch):
    """A wrong use of ``sparsebalance.sim.core.ConfigError`` is a type error, not an unresolved import."""
    api = pytest.importorskip("mypy.api")
    monkeypatch.chdir(ROOT)  # the checkout's root is on mypy's search path
    probe = tmp_path / "probe.py"
    probe.write_text("from sparsebalance.sim.core import ConfigError\n\nwrong: int = ConfigError('x')\n")
    out, _, status = api.run([str(probe), "--config-file", str(ROOT / "pyproject.toml"), "--follow-imports",
                              "silent", "--cache-dir", str(tmp_path / "cache")])
    assert status == 1 and out.splitlines()[0].endswith(
        'error: Incompatible types in assignment (expression has type "ConfigError", variable has type "int")  '
        '[assignment]'), out


def test_the_checkout_loads_each_module_once_under_its_sparsebalance_name():
    """``python -m sim.run`` runs the top-level folder; what it imports is ``sparsebalance.sim.*``, once."""
    probe = ("import sys, sim.run, sparsebalance.sim.core as core; "
             "print(core.__file__); print(sorted(m for m in sys.modules if m.startswith('sim.')))")
    shown = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           check=True).stdout.splitlines()
    assert shown == [str(ROOT / "sparsebalance" / "sim" / "core.py"), "['sim.run']"]
