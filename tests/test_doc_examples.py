"""Every fenced code block of the README, docs/*.md and the kernel's README is run or checked here.

``python`` blocks run (the kernel README's on the CPU, at a smaller size; the README's planner loop with a stand-in
for the user's batches and training step). Each command of a ``bash`` block goes through the front door of the
command it names before anything would run (``sim.run``'s check_composition, ``sim.compare``'s parser and
composition), or is listed in SKIPPED with the reason it cannot run here. ``text`` and ``json`` blocks are
output, diagrams and file formats, which hold no command.
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

import sparsebalance.sim.compare as sim_compare
from sparsebalance.sim.core import preset_overrides
from sparsebalance.sim.run import check_composition

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "kernels" / "sparse_attention" / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
# Commands that cannot run in a CPU test, by their first words, and why.
SKIPPED = {
    "python3 -m venv": "makes a virtual environment",
    ". .venv/bin/activate": "activates one",
    "pip install": "installs packages",
    "torchrun": "trains with torch.distributed (tests/runner/test_cpu_smoke.py runs the README's)",
    "bash scripts/gpu_": "a GPU job script (tests/runner/test_scripts.py runs its CPU check)",
    "OUT=": "a GPU job script (tests/runner/test_scripts.py runs its CPU check)",
    "python -m benchmarks.": "a benchmark, minutes long",
    "python -m pytest": "the test suite itself",
    "python -m viz": "draws the sweeps of the commands before it (tests/viz run the command)",
    "python -m sim.run -m hydra/launcher=slurm": "submits to a Slurm cluster",
    "python -m sim.advise": "a search, minutes long (tests/sim/test_advise.py runs the command and its override line)",
    "M=": "a shell variable that the command after it reads",
}
# The names the README's planner loop leaves to the user's code.
PLANNER_PRELUDE = """
batches = [[4096] * 64, [2048] * 32 + [8192] * 32]
def train(plan):
    return [1.0] * len(plan.assignments), [1.0] * len(plan.assignments), 1000.0
"""
# The kernel README's block on the CPU: the PyTorch reference, fp32, 1/8 of the tokens.
KERNEL_ON_CPU = [('device="cuda"', 'device="cpu"'), ("torch.bfloat16", "torch.float32"), ("8192", "512"),
                 ("3000", "200"), ("16, 128", "16, 32"), ("4, 128", "4, 32")]


def blocks(lang: str) -> list[tuple[str, str]]:
    """(page:index, text) of every block in ``lang``."""
    found = []
    for page in PAGES:
        for i, (language, text) in enumerate(FENCE.findall(page.read_text())):
            if language == lang:
                found.append((f"{page.relative_to(ROOT)}:{i}", text))
    return found


def commands() -> list[tuple[str, str]]:
    """Every command of the bash blocks: lines joined at a trailing backslash, split at ``&&``, comments cut."""
    found = []
    for where, text in blocks("bash"):
        for line in text.replace("\\\n", " ").splitlines():
            for command in line.split("&&"):
                command = shlex.split(command, comments=True)
                if command:
                    found.append((where, shlex.join(command)))
    return found


def test_every_block_is_code_that_runs_or_marked_as_text():
    languages = {lang for page in PAGES for lang, _ in FENCE.findall(page.read_text())}
    assert languages <= {"python", "bash", "text", "json"}, languages


@pytest.mark.slow  # the kernel's PyTorch reference and a planner over the paper preset: seconds each
@pytest.mark.parametrize("where,text", blocks("python"), ids=[w for w, _ in blocks("python")])
def test_python_block_runs(where, text):
    if "sparse_attention" in where:
        pytest.importorskip("torch")
        for old, new in KERNEL_ON_CPU:
            text = text.replace(old, new)
    prelude = PLANNER_PRELUDE if "build_planner" in text else ""
    exec(compile(prelude + text, where, "exec"), {"__name__": "doc_example"})


class Checked(Exception):
    """sim.compare got as far as comparing: every argument was accepted."""


def with_marks(where: str, command: str):
    """A sweep composes each of its jobs: seconds, so slow."""
    return pytest.param(where, command, id=f"{where} {command}",
                        marks=[pytest.mark.slow] if " -m " in f" {command.split(' ', 3)[-1]} " else [])


@pytest.mark.parametrize("where,command", [with_marks(w, c) for w, c in commands()])
def test_bash_command_passes_its_front_door_or_is_skipped_with_a_reason(where, command, monkeypatch):
    reason = next((why for start, why in SKIPPED.items() if command.startswith(start)), None)
    if reason:
        pytest.skip(reason)
    words = shlex.split(command)
    assert words[:2] == ["python", "-m"], f"{where}: {command}: no check for this command; add it or skip it"
    module, args = words[2], words[3:]
    if module == "sim.run":
        check_composition(preset_overrides(args))  # experiment=<name> as sim.run's command line takes it
    elif module == "sim.compare":
        def stop(*_, **__):
            raise Checked
        monkeypatch.setattr(sim_compare, "compare", stop)
        monkeypatch.setattr(sys, "argv", ["sim.compare", *args])
        with pytest.raises(Checked):
            sim_compare.main()
    else:
        pytest.fail(f"{where}: {command}: no check for python -m {module}; add it or skip it")
