"""Installable beside a trainer: the wheel holds one import name, ``sparsebalance``, with the configs and the
measured profiles inside it, and a non-editable install runs the main job from any directory, next to a
top-level ``kernels`` package (the import name of Hugging Face's kernel hub)."""
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_folders() -> set[str]:
    """Every package the pyproject maps, with its sub-packages found on disk."""
    names = {"sparsebalance"}
    for name, folder in PYPROJECT["package-dir"].items():
        names.add(name)
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            names.add(".".join([name, *parts]) if parts else name)
    return names


def test_the_pyproject_lists_every_package_folder():
    assert set(PYPROJECT["packages"]) == package_folders()


def test_every_package_folder_is_mapped_into_the_namespace():
    """A folder of the project with an ``__init__.py`` at the top is one of the namespace's packages."""
    tops = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"sparsebalance", "tests", "benchmarks"}
    assert tops == {folder for folder in PYPROJECT["package-dir"].values() if folder != "conf"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the sources: setuptools keeps a build/ folder in the tree it builds, whose stale
    files would travel into later wheels."""
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source") / "tree"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "outputs", "multirun", ".venv",
                                                                "*.egg-info", "__pycache__", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], check=True, capture_output=True, text=True, timeout=600)
    (found,) = out.glob("sparsebalance_sim-*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_holds_one_import_name_with_its_configs_and_profiles(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info" not in n.split("/")[0]} == {"sparsebalance"}
    assert "sparsebalance/conf/config.yaml" in names and "sparsebalance/conf/hydra/sweeper/dst_optuna.yaml" in names
    assert {"sparsebalance/calibrate/profiles/h200.json", "sparsebalance/sim/traces/example.csv"} <= set(names)
    assert not [n for n in names if "/tests/" in n or n.startswith("sparsebalance/kernels/") and n.endswith(".md")]


@pytest.mark.slow
def test_an_installed_wheel_runs_the_main_job_from_another_directory_beside_a_kernels_package(wheel, tmp_path):
    site, work = tmp_path / "site", tmp_path / "elsewhere"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    (site / "kernels").mkdir()  # stands in for Hugging Face's kernels package, a top-level ``kernels``
    (site / "kernels" / "__init__.py").write_text("HUB = True\n")
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = ("import kernels, sparsebalance.sim.run, sparsebalance.kernels.backends as b; "
             "print(kernels.HUB, sparsebalance.sim.run.__file__, b.__file__)")
    shown = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env, capture_output=True, text=True,
                           timeout=120, check=True).stdout.split()
    assert shown[0] == "True" and all(path.startswith(str(site)) for path in shown[1:])
    run_dir = work / "run"
    proc = subprocess.run([str(site / "bin" / "sparsebalance-sim"), "policy=sparsebalance", "steps=2",
                           "workload.global_batch=16", "layout.micro_batches=2", f"hydra.run.dir={run_dir}"], cwd=work,
                           env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"summary.json", "steps.csv", "micro_batches.csv"} <= {p.name for p in run_dir.iterdir()}
