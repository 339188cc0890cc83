"""Fit the cost model to raw measurements and report its error: ``python -m calibrate.fit``.

The command line of ``calibrate.fitting`` (the coefficients) and ``calibrate.report`` (their error and the
error targets). A small argparse CLI, like calibrate.run, so that both halves read the same way;
``--check [PROFILE]`` fits nothing and says whether a profile meets the error targets.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from sparsebalance.calibrate.backends import (HELDOUT_MAX_PCT, HELDOUT_MEDIAN_PCT, busy_timed_host_work,
                                              fit_backends, print_backends, recorded_clocks, recorded_versions,
                                              unfinished_backends, with_backends)
from sparsebalance.calibrate.fitting import (FeatureSource, as_trained, build_profile, fit_all, load_measurements,
                                             write_profile)
from sparsebalance.calibrate.report import (HELDOUT_TARGET_PCT, VALIDATION_TARGET_PCT, check, error_report,
                                            print_report)
from sparsebalance.calibrate.run import DEFAULT_CSV, meta_path, read_runs
from sparsebalance.sim.backends import OURS
from sparsebalance.sim.gpu_kinds import default_kind
from sparsebalance.sim.core import ArgumentParser, ConfigError, check_writable, one_line_errors
from sparsebalance.sim.profile import load_profile

DEFAULT_OUT = DEFAULT_CSV.with_name(f"{default_kind().gpu}.json")
ROOT = Path(__file__).resolve().parents[1]
RAW_SUFFIX = "_raw.csv"  # calibrate/profiles/<gpu>_raw.csv is fitted into <gpu>.json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m calibrate.fit", description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="raw measurements from calibrate.run")
    ap.add_argument("--out", type=Path, help=f"profile to write (default: <gpu>.json beside --csv <gpu>{RAW_SUFFIX})")
    ap.add_argument("--gpu", help=f"the profile's gpu name (default: <gpu> of --csv <gpu>{RAW_SUFFIX})")
    ap.add_argument("--replace-measured", action="store_true",
                    help="allow --out to name a profile measured on another GPU, which is then overwritten")
    ap.add_argument("--check", nargs="?", const=DEFAULT_OUT, type=Path, metavar="PROFILE",
                    help=f"fit nothing; check that PROFILE (default {DEFAULT_OUT.relative_to(ROOT)}) meets the "
                         f"error targets: held-out attention fwd+bwd of every backend median <= "
                         f"{HELDOUT_MEDIAN_PCT:g}%%, max <= {HELDOUT_MAX_PCT:g}%%; whole layers median <= "
                         f"{HELDOUT_TARGET_PCT:g}%%; every validation point within {VALIDATION_TARGET_PCT:g}%%")
    ap.add_argument("--backends-only", action="store_true",
                    help="fit only the peer backends' terms and write them into the profile at --out, whose own "
                         "terms and fit stay as they are (a peer timed later, beside a committed profile); a peer "
                         "whose last calibrate.run left points unmeasured is never fitted")
    return ap.parse_args(argv)


def output_names(args: argparse.Namespace) -> tuple[str, Path]:
    """The profile's gpu name and path: as given, else the GPU that --csv <gpu>_raw.csv is named after."""
    named = args.csv.name[:-len(RAW_SUFFIX)] if args.csv.name.endswith(RAW_SUFFIX) else ""
    if (args.gpu is None or args.out is None) and not named:
        raise ConfigError(f"--csv {args.csv}: its name does not say the GPU; allowed: a CSV named "
                          f"<gpu>{RAW_SUFFIX}, or --gpu and --out")
    gpu = named if args.gpu is None else args.gpu
    if not gpu.strip():
        raise ConfigError(f"--gpu={gpu!r}: allowed: a non-empty name, such as {default_kind().gpu}")
    return gpu, args.csv.with_name(f"{named}.json") if args.out is None else args.out


def check_same_gpu(out: Path, gpu_name: str | None, csv: Path) -> None:
    """Refuse to overwrite a measured profile of another GPU (or a file that is not a provisional profile):
    refitting a GPU's own measurements replaces its profile, fitting another's needs --replace-measured."""
    if not out.exists():
        return
    try:
        existing = json.loads(out.read_bytes())
    except (OSError, ValueError):
        existing = None
    if isinstance(existing, dict) and existing.get("provisional") is True:
        return
    meta = existing.get("meta") if isinstance(existing, dict) else None
    theirs = meta.get("gpu_name") if isinstance(meta, dict) else None
    if theirs != gpu_name:
        raise ConfigError(f"--out={out}: holds a measured profile of {theirs!r}, and --csv {csv} was measured on "
                          f"{gpu_name!r}; pass --replace-measured to overwrite it with this fit")


def unfitted_backends(runs: list[dict], csv: Path) -> list[str]:
    """The peers of ``csv``'s runs that the fit leaves out; prints a line for each, saying why."""
    lines = {name: f"{left} of its points are not measured; measure them first: python -m calibrate.run --csv {csv} "
                   f"--backends {name}" for name, left in unfinished_backends(runs).items()}
    for name in busy_timed_host_work(runs):
        lines.setdefault(name, "its calls do host work beside their kernels, which the busy clock this CSV was timed "
                               "on leaves out; allowed: a CSV timed with calibrate.run --timing events")
    for name, why in lines.items():
        print(f"backend {name}: not fitted, {why}", file=sys.stderr)
    return list(lines)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check is not None:
        return check(args.check)
    if not args.csv.is_file():
        raise ConfigError(f"--csv {args.csv}: no such file (raw measurements are written by calibrate.run)")
    runs = read_runs(args.csv)
    if not runs:
        raise ConfigError(f"--csv {args.csv}: no run metadata {meta_path(args.csv).name} beside it (written by "
                          "calibrate.run)")
    gpu, out = output_names(args)
    check_writable(out, "--out")
    if not args.replace_measured:
        check_same_gpu(out, runs[-1].get("gpu_name"), args.csv)
    grid = runs[-1]["grid"]
    measured = load_measurements(args.csv)
    measurements = [m for m in measured if m.backend == OURS]  # our kernel's and the layer's
    fit_command = shlex.join(["python", "-m", "calibrate.fit", *(sys.argv[1:] if argv is None else argv)])
    if not measurements and not args.backends_only:
        raise ConfigError(f"--csv {args.csv}: holds no measurements of our kernel or the layer (calibrate.run "
                          "--peers-only timed only peers into it); allowed: --backends-only, which adds its peers to "
                          "the profile at --out")
    unfitted = unfitted_backends(runs, args.csv)
    try:
        backends = fit_backends([m for m in measured if m.backend not in (OURS, *unfitted)], grid["models"],
                                grid["block_size"], recorded_versions(runs), recorded_clocks(runs))
        if args.backends_only:
            write_profile(out, with_backends(load_profile(str(out), key="--out"), backends, runs, fit_command))
            print_backends(backends)
            print(f"wrote the backends of {out}")
            return 0
        trained, stepped = as_trained(measurements)
        features = FeatureSource(grid["models"], grid["block_size"], gpu)  # the launch features need its GPU kind
        fitted = fit_all(trained, features)
    except ConfigError as exc:
        raise ConfigError(f"--csv {args.csv}: {exc}") from None
    report = error_report(fitted, trained, measurements, features, stepped)
    profile = build_profile(gpu, runs, fitted.coefs, report, fit_command, args.csv)
    write_profile(out, profile | ({"backends": backends} if backends else {}))
    print_report(report)
    print_backends(backends)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
