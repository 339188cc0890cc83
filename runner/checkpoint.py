"""Checkpoint and resume: model, optimiser, data position (the next step), every rank's RNG state,
and the Results rows so far, so that a resumed run writes one continuous loss curve.

Weights and optimiser state are the whole model's, keyed by parameter name, whole tensors: every pipeline
stage's (gathered from sharded replicas under FSDP) merged on rank 0, and each stage takes its own share
on resume.

Data needs no iterator state: the batch of step ``s`` is a pure function of (seed, s).

A checkpoint is data, never code: everything in it is a tensor, a number, a string, a list or a dict
(RNG states included), it is read with ``torch.load(weights_only=True)``, which refuses any other
object without constructing it, and its structure is checked before anything uses it. A file that is
not such a checkpoint (truncated, corrupt, foreign, another version, another run) is one
``ConfigError`` that names it and what is wrong.
"""
from __future__ import annotations

import contextlib
import pickle
import random
import warnings
import zipfile
from pathlib import Path
from typing import get_args, get_type_hints

import numpy as np
import torch

from sparsebalance.runner.records import SequenceRecord, TrainRecord
from sparsebalance.sim.core import ConfigError, atomic_path, not_a_file
from sparsebalance.sim.results import MicroBatchRecord, StepRecord

FORMAT = "sparsebalance-runner-checkpoint"
# 2: weights and optimiser state keyed by parameter name, whole tensors, whatever the layout that wrote them
VERSION = 2
KEYS = ("format", "version", "model", "optimizer", "next_step", "rng", "history", "config")
HISTORY_KEYS = ("steps", "micro_batches", "plans", "train", "sequences")
# The record each history row was made from (and is made into again when the Results are next written).
ROW_RECORDS = {"steps": StepRecord, "micro_batches": MicroBatchRecord, "train": TrainRecord,
               "sequences": SequenceRecord}
NUMPY_GENERATOR = "MT19937"


class Invalid(ValueError):
    """What is wrong inside a checkpoint; ``load`` prefixes the file."""


# ---------------------------------------------------------------------- RNG states as plain data
def rng_state() -> dict:
    """This process's RNG states as tensors, lists and numbers (what ``weights_only`` loads)."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached_gaussian)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(_numpy_state(state["numpy"]))
    random.setstate(_python_state(state["python"]))
    if torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def _numpy_state(state: dict) -> tuple:
    return (NUMPY_GENERATOR, np.asarray(state["keys"], dtype=np.uint32), state["pos"], state["has_gauss"],
            state["cached_gaussian"])


def _python_state(state: dict) -> tuple:
    return state["version"], tuple(state["internal"]), state["gauss_next"]


def _check_rng(state, where: str) -> None:
    """Each state goes into a throwaway generator of its library, which accepts only a well-formed one."""
    _expect(state, dict, where, "a dict of RNG states")
    _expect_keys(state, ("torch", "cuda", "numpy", "python"), where)
    for key, kind in (("numpy", dict), ("python", dict), ("cuda", list)):
        _expect(state[key], kind, f"{where}.{key}", f"a {kind.__name__}")
    for i, t in enumerate([state["torch"], *state["cuda"]]):
        name = f"{where}.torch" if i == 0 else f"{where}.cuda[{i - 1}]"
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
            raise Invalid(f"{name} is not a generator state (a 1-d uint8 tensor)")
    try:
        torch.Generator().set_state(state["torch"])
    except RuntimeError as exc:
        raise Invalid(f"{where}.torch is not a CPU generator state ({_first_line(exc)})") from None
    for key, restore in (("numpy", lambda s: np.random.RandomState().set_state(_numpy_state(s))),
                         ("python", lambda s: random.Random().setstate(_python_state(s)))):
        try:
            restore(state[key])
        except (LookupError, TypeError, ValueError, OverflowError) as exc:
            raise Invalid(f"{where}.{key} is not a {key} RNG state ({_first_line(exc)})") from None


# ---------------------------------------------------------------------- save
def save(path: Path, *, model_state: dict, optimizer_state: dict, next_step: int, rng_states: list[dict],
         history: dict, config: dict) -> None:
    """Write durably and atomically (``sim.core.atomic_path``: a temp file beside ``path``, fsynced, renamed
    over it, the directory fsynced): a crash at any point leaves the old checkpoint or the new one."""
    content = {
        "format": FORMAT, "version": VERSION,
        "model": model_state, "optimizer": optimizer_state, "next_step": next_step,
        "rng": rng_states, "history": history, "config": config,
    }
    with atomic_path(path) as tmp:
        torch.save(content, tmp)


# ---------------------------------------------------------------------- load
def load(path: Path, world_size: int, config: dict) -> dict:
    """The checkpoint, if it is one and this run can continue it; otherwise one ConfigError line.

    Every member's CRC is checked (a changed byte anywhere is refused); the tensors are memory-mapped, so
    that checking a checkpoint before training holds none of its weights in memory."""
    with naming(path):
        ckpt = read(path)
        check_structure(ckpt)
    if len(ckpt["rng"]) != world_size:
        raise ConfigError(f"runner.resume={path}: written by {len(ckpt['rng'])} ranks, this run has "
                          f"{world_size}; allowed: a checkpoint of a run with the same world size")
    changed = sorted(k for k in config if k != "steps" and ckpt["config"].get(k) != config[k])
    if changed:
        raise ConfigError(f"runner.resume={path}: written with a different config ({', '.join(changed)} differ); "
                          "allowed: a checkpoint of a run with the same config (steps may grow)")
    return ckpt


@contextlib.contextmanager
def naming(path: Path):
    """What is wrong inside the checkpoint, as one ConfigError that names the file."""
    try:
        yield
    except Invalid as exc:
        raise ConfigError(f"runner.resume={path}: {exc}") from None


def read(path: Path):
    if path.is_dir():
        raise Invalid("a directory; allowed: a checkpoint file (<run dir>/checkpoint.pt)")
    problem = not_a_file(path)
    if problem:
        raise Invalid(f"{problem}; allowed: a checkpoint file (<run dir>/checkpoint.pt)")
    try:
        with zipfile.ZipFile(path) as archive:
            corrupt = archive.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        raise Invalid(f"not a torch checkpoint ({_first_line(exc)}: truncated, or another kind of file)") from None
    if corrupt is not None:
        raise Invalid(f"corrupt: its member {corrupt} fails its CRC check")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about foreign pickle protocols on stderr
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise Invalid(f"refused unread: it holds objects that are not plain data ({_refusal(exc)})") from None
    except Exception as exc:  # noqa: BLE001  (any failure to parse an untrusted file is bad input)
        raise Invalid(f"not a readable torch checkpoint ({type(exc).__name__}: {_first_line(exc)})") from None


def _refusal(exc: pickle.UnpicklingError) -> str:
    """The unpickler's reason, out of torch's multi-paragraph advice around it."""
    lines = [ln.strip() for ln in str(exc).splitlines()]
    reason = next((ln for ln in lines if ln.startswith("WeightsUnpickler error:")), lines[0] if lines else "")
    return reason.removeprefix("WeightsUnpickler error:").strip()


def check_structure(ckpt) -> None:
    """Every key this runner reads, with the type it uses it as."""
    _expect(ckpt, dict, "the file", "a dict (a runner checkpoint)")
    if ckpt.get("format") != FORMAT:
        raise Invalid(f"not a runner checkpoint (format {ckpt.get('format')!r}; allowed: {FORMAT!r})")
    if ckpt.get("version") != VERSION:
        raise Invalid(f"checkpoint version {ckpt.get('version')!r}; this runner reads version {VERSION}")
    _expect_keys(ckpt, KEYS, "the checkpoint")
    next_step = ckpt["next_step"]
    if type(next_step) is not int or next_step < 1:
        raise Invalid(f"next_step={next_step!r}; allowed: a whole number >= 1")
    _check_tensor_dict(ckpt["model"], "model")
    _check_optimizer(ckpt["optimizer"])
    _expect(ckpt["rng"], list, "rng", "a list (one state per rank)")
    if not ckpt["rng"]:
        raise Invalid("rng is empty; allowed: one state per rank")
    for rank, state in enumerate(ckpt["rng"]):
        _check_rng(state, f"rng[{rank}]")
    _check_history(ckpt["history"], next_step)
    _expect(ckpt["config"], dict, "config", "a dict")


def _check_tensor_dict(value, where: str) -> None:
    _expect(value, dict, where, "a dict of tensors")
    for key, tensor in value.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise Invalid(f"{where}[{key!r}] is a {type(tensor).__name__}; allowed: tensors under string keys")


def _check_optimizer(value) -> None:
    _expect(value, dict, "optimizer", "an optimizer state dict")
    _expect_keys(value, ("state", "param_groups"), "optimizer")
    _expect(value["state"], dict, "optimizer.state", "a dict")
    _expect(value["param_groups"], list, "optimizer.param_groups", "a list")
    for i, group in enumerate(value["param_groups"]):
        _expect(group, dict, f"optimizer.param_groups[{i}]", "a dict")
        _expect_keys(group, ("params",), f"optimizer.param_groups[{i}]")
        _expect(group["params"], list, f"optimizer.param_groups[{i}].params", "a list of parameter names")
        for name in group["params"]:
            _expect(name, str, f"a name in optimizer.param_groups[{i}].params", "a parameter name")
    for name, state in value["state"].items():
        _expect(name, str, "an optimizer.state key", "a parameter name")
        _check_tensor_dict(state, f"optimizer.state[{name!r}]")


def _check_history(history, next_step: int) -> None:
    _expect(history, dict, "history", "a dict")
    _expect_keys(history, HISTORY_KEYS, "history")
    for key in HISTORY_KEYS:
        _expect(history[key], list, f"history.{key}", "a list")
    for i, plan in enumerate(history["plans"]):
        _expect(plan, str, f"history.plans[{i}]", "a Plan as JSON")
    for key, record in ROW_RECORDS.items():
        for i, row in enumerate(history[key]):
            _check_row(row, get_type_hints(record), f"history.{key}[{i}]")
    for key in ("steps", "plans", "train"):
        if len(history[key]) != next_step:
            raise Invalid(f"history.{key} holds {len(history[key])} steps, but next_step={next_step}")


def _check_row(row, columns: dict, where: str) -> None:
    """A row rebuilt into (or written beside) the Results: exactly its record's fields, each of its type."""
    _expect(row, dict, where, "a dict")
    if set(row) != set(columns):
        raise Invalid(f"{where} has the columns {sorted(map(str, row))}; allowed: {sorted(columns)}")
    for column, hint in columns.items():
        kinds, value = get_args(hint) or (hint,), row[column]
        if not any(_is(value, kind) for kind in kinds):
            allowed = " or ".join("None" if kind is type(None) else kind.__name__ for kind in kinds)
            raise Invalid(f"{where}[{column!r}]={value!r} is a {type(value).__name__}; allowed: {allowed}")


def _is(value, kind) -> bool:
    """``isinstance`` as the records mean their annotations: a float field takes an int, no field a bool."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return value is None if kind is type(None) else isinstance(value, kind)


def check_compatible(ckpt: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The checkpoint's tensors fit this model and optimiser (works on a meta-device copy of them)."""
    expected = model.state_dict()
    saved = ckpt["model"]
    if set(saved) != set(expected):
        odd = sorted(set(saved) ^ set(expected))
        raise Invalid(f"model has other parameters than this model ({', '.join(odd[:3])}...)")
    for key, tensor in expected.items():
        if saved[key].shape != tensor.shape:
            raise Invalid(f"model[{key!r}] has shape {tuple(saved[key].shape)}; this model's is {tuple(tensor.shape)}")
    groups = ckpt["optimizer"]["param_groups"]
    fresh = optimizer.state_dict()["param_groups"]
    if [set(g) for g in groups] != [set(g) for g in fresh]:
        raise Invalid("optimizer.param_groups do not describe this model's parameters")
    unknown = [name for g in groups for name in g["params"] if name not in expected]
    if unknown:
        raise Invalid(f"optimizer.param_groups name {unknown[0]!r}, no parameter of this model")
    for name, state in ckpt["optimizer"]["state"].items():
        if name not in expected:
            raise Invalid(f"optimizer.state[{name!r}] names no parameter of this model")
        for key, tensor in state.items():
            if tensor.dim() != 0 and tensor.shape != expected[name].shape:
                raise Invalid(f"optimizer.state[{name!r}][{key!r}] has shape {tuple(tensor.shape)}; "
                              f"its parameter's is {tuple(expected[name].shape)}")


# ---------------------------------------------------------------------- helpers
def _expect(value, kind: type, where: str, what: str) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise Invalid(f"{where} is a {type(value).__name__}; allowed: {what}")


def _expect_keys(value: dict, keys, where: str) -> None:
    missing = [k for k in keys if k not in value]
    if missing:
        raise Invalid(f"{where} lacks the key(s) {', '.join(map(repr, missing))}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
