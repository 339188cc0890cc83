"""Where a Hydra command's jobs write, and what is left of it when a job fails or the command is interrupted.

A run (or sweep job) directory without ``summary.json`` never got its results: what the job and Hydra wrote
there is removed (``.hydra/``, the job's log, results files, the atomic writers' temporaries) and the
directory too once empty, so that nothing half-written is left behind. Only those names go: a run directory
may be one the user already keeps other files in (``hydra.run.dir=.``).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hydra import compose, initialize_config_dir
from hydra._internal.grammar.utils import escape_special_characters
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sparsebalance.sim.core import CONF_DIR, TEMPORARY, ConfigError, check_writable, hydra_reason
from sparsebalance.sim.results import FILES

# Launchers whose jobs end with this process (joblib's workers are killed when it is interrupted; the basic
# launcher runs them in it): only their directories are cleaned up after Ctrl-C. A Slurm job goes on running.
LOCAL_LAUNCHERS = ("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
                   "hydra._internal.core_plugins.basic_launcher.BasicLauncher")


@dataclass(frozen=True)
class Outputs:
    """Where a command's jobs write: a run directory, or a ``-m`` sweep's (``sweep``), and whether its jobs end
    with this process (``local``: LOCAL_LAUNCHERS)."""

    path: Path
    sweep: bool
    local: bool = True


def output_dir(overrides: list[str], mode: str, config_name: str = "config") -> tuple[str, str]:
    """The run (``mode`` "run") or sweep directory that ``overrides`` (no swept values) give, resolved as in the
    job (``${now:...}``, ``${hydra:...}``), and the launcher's target."""
    hydra = HydraConfig.instance()
    previous = hydra.cfg
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            node = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
        hydra.set_config(node)  # what ${hydra:...} in the path resolves against, as in the job
        return str(OmegaConf.select(node, f"hydra.{mode}.dir")), node.hydra.launcher._target_
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(hydra_reason(exc)) from None
    finally:
        hydra.cfg = previous


def pin_output_dir(argv: list[str], fixed: list[str], sweep: bool, config_name: str = "config"
                   ) -> tuple[list[str], Outputs]:
    """``argv`` with ``hydra.run.dir`` (or ``hydra.sweep.dir``) set to the directory it resolves to now
    (``fixed``: the overrides without swept values), so that this process knows where its jobs write when it is
    interrupted: Hydra forgets a job's directory once the job ends, the joblib launcher runs them in other
    processes, and ``${now:...}`` resolves anew in each."""
    mode = "sweep" if sweep else "run"
    path, launcher = output_dir(fixed, mode, config_name)
    key = f"hydra.{mode}.dir"
    check_writable(path, key, directory=True)  # the default is under the working directory, which may be read-only
    kept = [a for a in argv if a.split("=", 1)[0].lstrip("+") != key]
    # Among the other overrides, which Hydra's parser takes as one run of arguments; never last, where a flag
    # with an optional value (--info) would take it as its own.
    at = next((i for i, a in enumerate(kept) if "=" in a and not a.startswith("-")), 0)
    pinned = [*kept[:at], f"{key}={escape_special_characters(path)}", *kept[at:]]
    return pinned, Outputs(Path(path), sweep, launcher in LOCAL_LAUNCHERS)


def discard_outputs(outputs: Outputs, job_name: str, files: tuple[str, ...] = FILES) -> str:
    """After Ctrl-C: ``discard_run`` of a run's directory, or ``discard_sweep``; what the one ``interrupted``
    line adds."""
    if outputs.sweep:
        return discard_sweep(outputs, job_name, files)
    discard_run(outputs.path, job_name, files)
    return ""


def discard_run(run_dir: Path, job_name: str, files: tuple[str, ...] = FILES) -> bool:
    """Remove what the job wrote in ``run_dir`` (Hydra's ``.hydra/`` and ``<job_name>.log``, ``files``, the
    atomic writers' temporaries) unless it holds complete results (``summary.json``), then the directory and
    its parent (the date or sweep directory) where that leaves them empty. In a complete one, only
    temporaries a write left when it was cut short go. Returns whether the run was incomplete."""
    if not run_dir.is_dir():
        return False
    complete = (run_dir / "summary.json").exists()
    for entry in run_dir.iterdir():
        if TEMPORARY.match(entry.name) or not complete and entry.name in (".hydra", f"{job_name}.log", *files):
            # another process of the job (a worker) may be removing the same entries
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    if complete:
        return False
    for directory in (run_dir, run_dir.parent):
        with contextlib.suppress(OSError):  # not empty: it holds what is not this run's
            directory.rmdir()
    return True


def stop_workers() -> None:
    """Kill joblib's worker processes, if this process started any. They get Ctrl-C too, but one that lands
    where Python cannot raise it (a garbage-collection callback) leaves the worker running its job, and at exit
    joblib waits for its workers: the command would end only when that job does. Killed first, a worker writes
    nothing after its directory is cleaned up."""
    from joblib.externals.loky import reusable_executor

    executor = reusable_executor._executor  # loky has no public accessor that does not start an executor
    if executor is not None:
        executor.shutdown(wait=False, kill_workers=True)


def discard_sweep(sweep: Outputs, job_name: str, files: tuple[str, ...] = FILES) -> str:
    """After Ctrl-C: ``discard_run`` of each job directory (those with a ``.hydra/``) and, when no job finished,
    of the sweep's ``multirun.yaml``; the sweep directory goes once empty. Returns what the one ``interrupted``
    line adds: the finished jobs kept, or that the launcher's jobs may still run."""
    if not sweep.local:
        return f"; the launcher's jobs may still be running (their directory: {sweep.path})"
    stop_workers()
    if not sweep.path.is_dir():
        return ""
    jobs = [d for d in sweep.path.iterdir() if (d / ".hydra").is_dir()]
    kept = [d for d in jobs if not discard_run(d, job_name, files)]
    if kept:
        return f"; {len(kept)} finished job{'s' * (len(kept) > 1)} kept in {sweep.path}"
    (sweep.path / "multirun.yaml").unlink(missing_ok=True)
    for directory in (sweep.path, sweep.path.parent):
        with contextlib.suppress(OSError):
            directory.rmdir()
    return ""


LOCK = ".run.lock"


@contextlib.contextmanager
def claimed_run_dir(outputs: Outputs, overwrite: bool, job_name: str, files: tuple[str, ...] = FILES
                    ) -> Iterator[None]:
    """A run directory for this command alone, while it runs. One that holds an earlier run's results is refused
    unless ``overwrite``, which first removes everything of that run (``.hydra/``, its log, ``files``, figures);
    a lock file made with O_EXCL refuses a second command into the same directory while this one runs. The lock,
    and the directories made only for it, go when the command ends. A sweep's jobs get their own directories."""
    if outputs.sweep:
        yield
        return
    path = outputs.path
    earlier = [name for name in (*files, "summary.json") if (path / name).exists()]
    if earlier and not overwrite:
        raise ConfigError(f"hydra.run.dir={path} holds the results of an earlier run ({earlier[0]}); allowed: "
                          "another hydra.run.dir, or overwrite=true to replace them")
    made = [d for d in (path, *path.parents) if not d.exists()]
    path.mkdir(parents=True, exist_ok=True)
    try:
        lock = os.open(path / LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        raise ConfigError(f"hydra.run.dir={path}: another run is writing there (its lock: {path / LOCK}); allowed: "
                          "another hydra.run.dir, or the lock removed once no run uses the directory") from None
    try:
        os.write(lock, str(os.getpid()).encode())
        if overwrite:
            for name in (".hydra", f"{job_name}.log", "figures", *files):
                entry = path / name
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        yield
    finally:
        os.close(lock)
        (path / LOCK).unlink(missing_ok=True)
        for directory in made:  # deepest first; one that holds anything stays
            with contextlib.suppress(OSError):
                directory.rmdir()
