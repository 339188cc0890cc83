"""The runner's console scripts, ``sparsebalance-train`` and ``sparsebalance-replay``. Both need torch, which the
``gpu`` extra installs: without it they end in one line that says so, where importing the command would end in
a ModuleNotFoundError traceback; and Ctrl-C while torch loads is the one ``interrupted`` line."""
from __future__ import annotations

import importlib

from sparsebalance.sim.core import fail, interrupts_as_one_line


def command(module: str, function: str, script: str):
    """``module.function()``, once torch imports; one ``error:`` line and exit code 2 where it does not."""
    with interrupts_as_one_line():
        try:
            import torch  # noqa: F401  (what the command's own imports need first)
        except ImportError as exc:
            fail(f"{script} needs torch, which did not import ({exc}); install the gpu extra: "
                 "pip install 'sparsebalance-sim[gpu]'")
        loaded = importlib.import_module(module)
    return getattr(loaded, function)()


def train():
    return command("sparsebalance.runner.train", "cli", "sparsebalance-train")


def replay():
    return command("sparsebalance.runner.replay", "main", "sparsebalance-replay")
