"""Every command answers ``--bogus`` with one line on stderr and exit code 2, and ``--help`` with exit code 0:
the ``python -m`` modules (each file with a ``__main__`` block) and the console scripts of pyproject.toml, each
run in this process (``runpy`` for a module, the entry point's function for a script)."""
import importlib
import runpy
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "policies", "kernels", "calibrate", "model", "runner", "viz")


def module_commands() -> list[str]:
    """The modules ``python -m`` runs: the packages' (under ``sparsebalance``) and the benchmarks'."""
    names = []
    for path in sorted([*ROOT.glob("*/**/*.py")]):
        top = path.relative_to(ROOT).parts[0]
        if top not in (*PACKAGES, "benchmarks") or not is_command(path):
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":
            parts.pop()
        names.append(".".join(["sparsebalance", *parts] if top in PACKAGES else parts))
    return names


def is_command(path: Path) -> bool:
    return path.name == "__main__.py" or 'if __name__ == "__main__":' in path.read_text()


def script_commands() -> list[str]:
    return sorted(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


COMMANDS = [*(f"-m {m}" for m in module_commands()), *script_commands()]


def run(command: str, flag: str, monkeypatch) -> int:
    """``command flag`` in this process; its exit code."""
    monkeypatch.setattr(sys, "argv", [command, flag])
    try:
        if command.startswith("-m "):
            runpy.run_module(command[3:], run_name="__main__", alter_sys=False)
        else:
            module, function = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][
                command].split(":")
            getattr(importlib.import_module(module), function)()
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    return 0


def test_the_commands_are_found():
    assert len(module_commands()) >= 20 and "sparsebalance.sim.run" in module_commands()
    assert "sparsebalance-sim" in script_commands()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # runpy: a module imported before it runs as __main__
@pytest.mark.parametrize("command", COMMANDS)
def test_a_bogus_option_is_one_line_and_exit_2_and_help_exits_0(command, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # a command that wrote anything would write here
    code = run(command, "--bogus", monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err[-2000:])
    assert run(command, "--help", monkeypatch) == 0, capsys.readouterr().err[-2000:]
