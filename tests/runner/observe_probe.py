"""``runner.train`` that also records every observation its planner is shown (one JSON line per call, per rank,
to ``$OBSERVED/rank<r>.jsonl``): the data of the closed-loop test. Kept out of the runner itself."""
import json
import os
from pathlib import Path

from sparsebalance.runner import train
from sparsebalance.sim.planner import Planner

OUT = Path(os.environ["OBSERVED"])
_observe = Planner.observe


def recorded_observe(self, plan, kept_fraction, coverage, step_ms, micro_batch_ms=None):
    with (OUT / f"rank{os.environ.get('RANK', '0')}.jsonl").open("a") as f:
        f.write(json.dumps({"plan": plan.to_json(), "kept": list(map(float, kept_fraction)),
                            "coverage": list(map(float, coverage)), "step_ms": float(step_ms)}) + "\n")
    return _observe(self, plan, kept_fraction, coverage, step_ms, micro_batch_ms)


Planner.observe = recorded_observe

if __name__ == "__main__":
    train.cli()
