"""What every package of the project uses: the bad-input error, the one-line CLI wrapper around it and an
argparse parser that raises it, atomic file writes, paths relative to the project, and composing the Hydra config
outside an app.

It sits at the bottom of the stack (standard library, Hydra and OmegaConf only), so that ``sim``, the
policies, calibration, the runner and the figures share one definition of each.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Sequence

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
GROUPS = ("policy", "cluster", "model", "workload", "cost")
PRESETS = "experiment"  # the group of presets, chosen with +experiment=<name> (not in the default list)
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command ended by Ctrl-C


class ConfigError(ValueError):
    """Bad user input; the entry point prints its message as one line and exits with EXIT_BAD_INPUT."""


def refuse_unread(node: object, names: Sequence[str], prefix: str, why: str, allowed: str) -> None:
    """One line for the first of ``names`` set away from its schema default where the run does not read it
    (``why``); nested dataclasses are compared key by key."""
    for f in (f for f in dataclasses.fields(node) if f.name in names):
        value = getattr(node, f.name)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(value):
            changed = [g.name for g in dataclasses.fields(value) if getattr(value, g.name) != getattr(default, g.name)]
            key, value = (f"{f.name}.{changed[0]}", getattr(value, changed[0])) if changed else (f.name, None)
        else:
            key, changed = f.name, value != default
        if changed:
            raise ConfigError(f"{prefix}{key}={getattr(value, 'value', value)} is not read {why}; allowed: {allowed}")


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` naming the choice closest to a misspelt ``word``, or nothing when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def fail(message: str) -> NoReturn:
    """End the process on bad input: one ``error:`` line on stderr, exit code 2."""
    print(f"error: {str(message).splitlines()[0] if str(message) else 'bad input'}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ConfigError line, as every other bad input."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def refuse_unknown_options(argv: list[str]) -> None:
    """A ConfigError for an option a Hydra app does not take (Hydra would print its usage and the error)."""
    from hydra._internal.utils import get_args_parser

    # intermixed: overrides may come before and after an option (``a=1 -m b=2``), as Hydra itself takes them
    _, unknown = get_args_parser().parse_known_intermixed_args(argv)
    if unknown:
        raise ConfigError(f"unrecognized arguments: {' '.join(unknown)}; allowed: key=value overrides and Hydra's "
                          "options (--help)")


def parse_numbers(text: str, kind: Callable[[str], object], valid: Callable[[object], bool] | None = None,
                  allowed: str = "") -> list:
    """The comma-separated ``kind`` values of ``text`` (``int``, ``float``, ``str``), each passing ``valid``
    where given; a ValueError names the bad value and what is ``allowed``."""
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of {kind.__name__}s") from None
    bad = [v for v in values if valid is not None and not valid(v)]
    if bad:
        raise ValueError(f"{text!r}: {bad[0]!r} is not allowed; allowed: {allowed}")
    return values


def number_list(kind: Callable[[str], object], valid: Callable[[object], bool] | None = None,
                allowed: str = "") -> Callable[[str], list]:
    """An argparse type: :func:`parse_numbers` of the argument."""
    def parse(text: str) -> list:
        try:
            return parse_numbers(text, kind, valid, allowed)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def interrupted(detail: str = "") -> NoReturn:
    """End the process after Ctrl-C: one ``interrupted`` line on stderr (``detail`` appended), exit code 130. A
    second Ctrl-C is ignored from here, so that what the caller cleaned up stays cleaned up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"interrupted{detail}", file=sys.stderr, flush=True)
    sys.exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def interrupts_as_one_line() -> Iterator[None]:
    """Around a command's heavy imports (hydra, numpy, pandas, torch: seconds on a loaded machine), before its own
    Ctrl-C handling exists: Ctrl-C ends the process with the one ``interrupted`` line, exit code 130, instead of
    a traceback from inside an import. The previous handler is back afterwards; off the main thread, where no
    handler can be set, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def quiet_interrupts_in_callbacks() -> None:
    """Ctrl-C that lands while Python runs a callback it cannot raise from (a weakref's, during garbage collection)
    is printed as "Exception ignored in ..." and a traceback, by the process it lands in (a sweep's joblib workers
    get it too); :func:`interrupted` reports the interrupt once, so such a KeyboardInterrupt is dropped here and
    every other unraisable exception still goes to Python's own hook."""
    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            sys.__unraisablehook__(unraisable)

    sys.unraisablehook = hook


def one_line_errors(main: Callable[..., int | None]) -> Callable[..., int | None]:
    """Wrap a command-line ``main`` so that a ConfigError ends it as one line and exit code 2, and Ctrl-C as one
    line and exit code 130, never a traceback."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        quiet_interrupts_in_callbacks()
        try:
            return main(*args, **kwargs)
        except ConfigError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            interrupted()

    return wrapped


# ----------------------------------------------------------------------------- files
def resolve_path(path: str | Path) -> Path:
    """A path as given, or relative to the project root (configs name repo files from any cwd)."""
    given = Path(path)
    if given.is_absolute() or given.exists():
        return given
    return ROOT / given


def not_a_file(file: Path) -> str | None:
    """Why ``file`` cannot be read as a file (``no such file``, ``is a directory``, ``is not a regular file``:
    a device or a pipe), or None when it is a regular file."""
    if file.is_file():
        return None
    if file.is_dir():
        return "is a directory"
    return "is not a regular file" if file.exists() else "no such file"


def read_json_config_file(path: str, key: str, where: str):
    """The parsed JSON of a file a config key names; a missing, unreadable or malformed file is one ConfigError
    line naming ``key`` and the path (``where``: where such files come from)."""
    file = resolve_path(path)
    problem = not_a_file(file)
    if problem:
        raise ConfigError(f"{key}={path!r}: {problem}; allowed: a JSON file ({where})")
    try:
        return json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}={path!r}: not valid JSON ({exc})") from None
    except (OSError, RecursionError) as exc:
        raise ConfigError(f"{key}={path!r}: cannot be read ({type(exc).__name__})") from None


def read_checked_json(path: str, key: str, where: str, problem) -> dict:
    """``read_json_config_file``, then ``problem(parsed)`` (what is wrong with it, or None): either is one
    ConfigError line naming ``key`` and the path. What every profile reader does."""
    parsed = read_json_config_file(path, key, where)
    found = problem(parsed)
    if found:
        raise ConfigError(f"{key}={path!r}: {found}")
    return parsed


def check_writable(path: str | Path, key: str, *, directory: bool = False) -> Path:
    """``path`` if the command can write it (a file, or with ``directory`` a directory), else one ConfigError
    line naming ``key``; for commands to call before any work runs, so that a bad output path costs nothing.

    It writes and removes a temporary file in the deepest directory of the path that exists (permission bits
    do not tell: root passes them on /proc). It makes no directory, so that processes checking one path at
    once (the ranks of a torchrun job) cannot remove one from under another.
    """
    path = Path(path)
    if path.exists() and path.is_dir() != directory:
        raise ConfigError(f"{key}={str(path)!r} is a {'file' if directory else 'directory'}; allowed: a "
                          f"{'directory' if directory else 'file'} path")
    target = (path if directory else path.parent).absolute()
    existing = next(d for d in (target, *target.parents) if d.exists())
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        raise ConfigError(f"{key}={str(path)!r} cannot be written ({exc.strerror or type(exc).__name__}); "
                          "allowed: a path in a writable directory") from None
    return path


# The temporaries of the atomic writers: hidden, named after what they become, with a random part and .tmp.
TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")


def temporary_beside(path: Path, *, directory: bool = False) -> Path:
    """A new hidden file (or directory) in ``path``'s directory, named after it. It gets the permissions of an
    ordinary write (0666, or 0777 for a directory, less the umask), which its rename passes on to ``path``:
    ``tempfile.mkstemp`` and ``mkdtemp`` make them 0600 and 0700, which teammates cannot read."""
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    if directory:
        tmp.mkdir()
    else:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return tmp


@contextlib.contextmanager
def temporary_dir(path: str | Path) -> Iterator[Path]:
    """A directory beside ``path`` (``temporary_beside``) to build files in, removed with what is left in it
    however the block ends (an error, Ctrl-C); a caller moves what it keeps out of it, or renames it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_beside(path, directory=True)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; on success it is flushed to disk and renamed over
    ``path`` (a reader sees the old file or the whole new one, also after a crash), on error removed. The file
    gets the permissions of an ordinary write (``temporary_beside``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_beside(path)
    try:
        yield tmp
        with tmp.open("rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def json_text(payload) -> str:
    """The project's JSON file text: sorted keys, two-space indent, a final newline (stable across runs)."""
    return json.dumps(payload, indent=2, sort_keys=True) + "\n"


def write_json_atomic(path: str | Path, payload: dict) -> None:
    write_text_atomic(path, json_text(payload))


def write_checked_json(path: str | Path, payload: dict, problem: Callable[[object], str | None], key: str) -> None:
    """``write_json_atomic`` of a payload that ``problem`` (a loader's check) accepts as read back from its text;
    a refused one is one ConfigError line naming ``key`` and ``path``, and leaves ``path`` as it was."""
    text = json_text(payload)
    found = problem(json.loads(text))
    if found:
        raise ConfigError(f"{key}={str(path)!r}: {found}")
    write_text_atomic(path, text)


# ----------------------------------------------------------------------------- config composition
def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def preset_options(config_name: str | None = None) -> list[str]:
    """The presets a config composes: runner.train's own (those that set ``runner`` keys, which only its schema
    has) only under its config ``runner``; every preset when ``config_name`` is None."""
    from omegaconf import OmegaConf

    return [name for name in group_options(PRESETS) if config_name in (None, "runner")
            or "runner" not in OmegaConf.load(CONF_DIR / PRESETS / f"{name}.yaml")]


def preset_overrides(args: Sequence[str]) -> list[str]:
    """``experiment=x`` as Hydra needs it, ``+experiment=x`` (presets are not in the default list), so that the
    commands accept both spellings."""
    return [f"+{a}" if a.startswith(f"{PRESETS}=") else a for a in args]


def check_group_overrides(argv: Sequence[str], config_name: str | None = None) -> None:
    """Reject unknown config-group options in one line before Hydra prints its multi-line report; with
    ``config_name``, also the presets that config cannot compose (``preset_options``)."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+~").split("@")[0]
        if not sep or group not in (*GROUPS, PRESETS):
            continue
        allowed = preset_options(config_name) if group == PRESETS else group_options(group)
        inner = value[value.find("(") + 1 : value.rfind(")")] if value.startswith("choice(") else value
        for option in filter(None, (v.strip() for v in inner.split(","))):
            if option in allowed:
                continue
            if option in group_options(group):
                raise ConfigError(f"{group} {option!r} is runner.train's preset (it sets runner keys); allowed "
                                  f"here: {', '.join(allowed)}")
            raise ConfigError(f"unknown {group} {option!r}{did_you_mean(option, allowed)}; allowed: "
                              f"{', '.join(allowed)}")


def hydra_reason(exc: Exception) -> str:
    """Hydra's and OmegaConf's error as one line: its first line, its cause's, the options of a missing config,
    and for an unknown key the closest known one (a misspelt ``polcy=kk``: did you mean 'policy'?)."""
    from hydra.errors import MissingConfigException

    reason = str(exc).splitlines()[0]
    cause = exc.__cause__
    if cause is not None:
        reason += f" ({str(cause).splitlines()[0]}){_closest_key(cause)}"
    if isinstance(exc, MissingConfigException) and exc.options:
        reason += f"; allowed: {', '.join(exc.options)}"
    return reason


def _closest_key(exc: BaseException) -> str:
    """``did_you_mean`` for an OmegaConf error about a key its parent node lacks; at the top, the presets group
    is a choice too (it is not in the default list)."""
    key, parent = getattr(exc, "key", None), getattr(exc, "parent_node", None)
    if not isinstance(key, str) or parent is None or not hasattr(parent, "keys"):
        return ""
    keys = [str(k) for k in parent.keys() if k != "hydra"]
    return did_you_mean(key, keys + [PRESETS] if parent._get_parent() is None else keys)


def check_bool_overrides(cfg, overrides: Sequence[str]) -> None:
    """A true/false key set to anything else is refused: OmegaConf would turn ``write_plans=2`` into true and
    ``plot=0`` into false without a word."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.is_delete() or override.is_sweep_override():
            continue
        key = override.key_or_group
        if isinstance(OmegaConf.select(cfg, key, default=None), bool) and not isinstance(override.value(), bool):
            raise ConfigError(f"{override.input_line}: {key} is a switch; allowed: true, false")
