"""``runner.train`` that also saves the gradients of its first step, whole tensors by parameter name, just
before the optimiser uses them, to ``$RUNNER_GRADS/rank<r>.pt``: the data of the equivalence tests of
the parallel layouts. Kept out of the runner itself: production code carries no probes."""
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from sparsebalance.runner import loop, train

OUT = Path(os.environ["RUNNER_GRADS"])
_init = loop.Trainer.__init__


def probed_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    params = dict(self.model.model.named_parameters())
    step = self.optimizer.step
    saved = []

    def save_then_step(*a, **k):
        if not saved:
            # full_tensor gathers an FSDP shard from the stage's replicas: every rank of the stage calls it
            grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu().clone()
                     for name, p in params.items()}
            torch.save(grads, OUT / f"rank{self.rank}.pt")
            saved.append(True)
        return step(*a, **k)

    self.optimizer.step = save_then_step


loop.Trainer.__init__ = probed_init

if __name__ == "__main__":
    train.cli()
