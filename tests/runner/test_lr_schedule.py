"""The runner's LR schedule (runner.loop.lr_factor through torch's LambdaLR): linear warmup, then constant or a
cosine to a floor over the run's steps; a scheduler rebuilt from a saved optimiser state goes on with the curve."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from sparsebalance.runner.loop import lr_factor, make_optimizer, make_scheduler

LR = 1e-2


def config(schedule: str, warmup: int, steps: int, floor: float = 0.0):
    return OmegaConf.create({"steps": steps, "runner": {"lr": LR, "weight_decay": 0.0, "lr_schedule": schedule,
                                                        "warmup_steps": warmup, "min_lr_ratio": floor}})


def optimizer(cfg):
    return make_optimizer([torch.nn.Parameter(torch.ones(3))], cfg, fused=False)


def lrs(opt, scheduler, n: int) -> list[float]:
    """The LR each of the next ``n`` steps runs at."""
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def test_warmup_rises_linearly_to_the_peak_then_the_cosine_falls_to_the_floor():
    factor = [lr_factor(s, "cosine", warmup_steps=4, steps=12, min_lr_ratio=0.1) for s in range(13)]
    assert factor[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]  # the last warmup step and the first cosine step: the peak
    assert factor[8] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert factor[12] == pytest.approx(0.1)  # the floor, at the end of the run
    assert all(a > b for a, b in zip(factor[4:], factor[5:], strict=False))
    assert min(factor[4:]) >= 0.1


def test_a_constant_schedule_holds_the_peak_after_its_warmup():
    assert [lr_factor(s, "constant", 3, 100, 0.5) for s in (0, 1, 2, 3, 99)] == [1 / 3, 2 / 3, 1.0, 1.0, 1.0]
    assert lr_factor(0, "constant", 0, 100, 0.5) == 1.0
    assert lr_factor(0, "cosine", 0, 100, 0.0) == 1.0


def test_the_scheduler_sets_each_steps_lr():
    cfg = config("cosine", warmup=2, steps=6, floor=0.2)
    opt = optimizer(cfg)
    got = lrs(opt, make_scheduler(opt, cfg), 6)
    assert got == pytest.approx([LR * lr_factor(s, "cosine", 2, 6, 0.2) for s in range(6)])
    assert got[1] == pytest.approx(LR) and got[-1] > 0.2 * LR


def test_the_default_schedule_keeps_the_lr_the_optimiser_was_given():
    cfg = config("constant", warmup=0, steps=5)
    opt = optimizer(cfg)
    assert lrs(opt, make_scheduler(opt, cfg), 5) == [LR] * 5


@pytest.mark.parametrize("schedule, warmup", [("cosine", 3), ("constant", 4)])
def test_a_scheduler_rebuilt_on_a_restored_optimiser_continues_the_curve(schedule, warmup):
    """As the runner resumes: a fresh optimiser and scheduler, the saved optimiser state, then the scheduler
    at the checkpoint's next step."""
    cfg = config(schedule, warmup=warmup, steps=10, floor=0.1)
    opt = optimizer(cfg)
    scheduler = make_scheduler(opt, cfg)
    before = lrs(opt, scheduler, 4)
    saved = copy.deepcopy(opt.state_dict())
    uninterrupted = lrs(opt, scheduler, 6)

    restored = optimizer(cfg)
    make_scheduler(restored, cfg)
    restored.load_state_dict(saved)
    resumed = lrs(restored, make_scheduler(restored, cfg, done_steps=4), 6)
    assert resumed == uninterrupted
    assert not math.isclose(resumed[0], before[0])  # past the warmup's first step: not a restart
