"""``runner.train`` with one rank that hangs or dies at one step, for the failure tests.

RUNNER_FAULT=hang|die, RUNNER_FAULT_RANK, RUNNER_FAULT_STEP choose what, who and when. Kept out of the
runner itself: production code carries no fault switches.
"""
import os
import time

from sparsebalance.runner import loop, train

KIND = os.environ["RUNNER_FAULT"]
RANK = int(os.environ.get("RUNNER_FAULT_RANK", 1))
AT = int(os.environ.get("RUNNER_FAULT_STEP", 1))
EXIT_DIED = 17

_step = loop.Trainer.step


def faulty_step(self, step):
    if self.rank == RANK and step == AT:
        if KIND == "die":
            os._exit(EXIT_DIED)
        time.sleep(3600)
    return _step(self, step)


loop.Trainer.step = faulty_step

if __name__ == "__main__":
    train.cli()
