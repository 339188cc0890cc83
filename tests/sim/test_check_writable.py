"""sim.core.check_writable: an output path is tried before any work runs, and trying it leaves nothing behind."""
from __future__ import annotations

import sys

import pytest

from sparsebalance.sim.core import ConfigError, check_writable


def test_a_new_file_in_new_directories_is_writable_and_the_probe_leaves_nothing(tmp_path):
    out = tmp_path / "a" / "b" / "out.json"
    assert check_writable(out, "--out") == out
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_can_be_written_over(tmp_path):
    (tmp_path / "old.csv").write_text("x")
    assert check_writable(tmp_path / "old.csv", "--out") == tmp_path / "old.csv"
    assert [p.name for p in tmp_path.iterdir()] == ["old.csv"]


def test_an_existing_directory_is_writable_and_keeps_its_files(tmp_path):
    (tmp_path / "kept.txt").write_text("x")
    check_writable(tmp_path, "--out", directory=True)
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


@pytest.mark.parametrize("directory", [False, True])
def test_the_wrong_kind_of_path_is_one_line_naming_it(tmp_path, directory):
    there = tmp_path / "x"
    if directory:
        there.write_text("a file")
    else:
        there.mkdir()
    with pytest.raises(ConfigError, match=r"^--out='.*x' is a (file|directory); allowed: a (directory|file) path$"):
        check_writable(there, "--out", directory=directory)


def test_a_path_under_a_file_cannot_be_written(tmp_path):
    (tmp_path / "f").write_text("a file")
    with pytest.raises(ConfigError, match=r"cannot be written \(Not a directory\); allowed: a path in a writable"):
        check_writable(tmp_path / "f" / "sub" / "out.csv", "--out")
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_a_path_the_system_refuses_cannot_be_written():
    with pytest.raises(ConfigError, match=r"^hydra.run.dir='/proc/nope' cannot be written"):
        check_writable("/proc/nope", "hydra.run.dir", directory=True)


@pytest.mark.parametrize("sweep", [[], ["-m"]], ids=["run", "sweep"])
def test_a_read_only_working_directory_is_one_line_before_any_job(monkeypatch, capsys, sweep):
    """The default run and sweep directories are under the working directory; /proc takes no new file, even
    for root."""
    from sparsebalance.sim import run as sim_run

    monkeypatch.chdir("/proc")
    monkeypatch.setattr(sys, "argv", ["sim.run", *sweep, "steps=1", "layout.micro_batches=1"])
    with pytest.raises(SystemExit) as exit_:
        sim_run.cli()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: hydra.{'sweep' if sweep else 'run'}.dir=") and "cannot be written" in err
