"""``python -m sim.run ... plot=true``: the run's figures, drawn by a Hydra callback after the job.

``conf/config.yaml`` names ``RunFigures`` under ``hydra.callbacks``, so that ``sim`` neither draws nor imports
anything of ``viz``. Hydra instantiates the callback for every run, plotting or not: this module loads no
plotting library, ``on_job_end`` imports matplotlib only when it draws.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from sparsebalance.sim.core import fail
from sparsebalance.viz.runs import PlotError


class RunFigures(Callback):
    """After each job that completed with ``plot: true`` (the run, or every job of a ``-m`` sweep), the figures
    of ``python -m viz <run dir>`` into ``<run dir>/figures``. A failed job draws nothing."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status is not JobStatus.COMPLETED or not OmegaConf.select(config, "plot", default=False):
            return
        from sparsebalance.viz.figures import results_figures, save

        run_dir = Path(config.hydra.runtime.output_dir)
        try:
            figures = results_figures(run_dir, step=0)
        except PlotError as exc:  # e.g. write_plans=false: no Plans to replay the timeline from
            fail(f"plot=true: no figures: {exc}")
        written = save(figures, run_dir / "figures", "png")
        print(f"figures: {written[0].parent}  ({', '.join(f.name for f in written)})")
