"""The command line of ``python -m benchmarks.attention``."""
from __future__ import annotations

import argparse
import json
import os

import torch

from sparsebalance.sim.core import ArgumentParser, number_list, one_line_errors
from .breakdown import kernel_breakdown
from .check import check
from .common import FLEX_MODES, log
from .fair import FAIR_HEADS, FAIR_IMPLS, hybrid_costs, run_fair
from .flex_variants import flex_variants
from .grid import run_bench, selection_cost
from .quick import quick
from .table import results_table
from .tune import CONFIG_KEYS, TUNE_CANDS, short_vs_long, tiles_option, tune


def int_at_least(minimum: int, what: str):
    """An argparse type: one integer >= ``minimum`` (``what`` names it in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what} (an integer >= {minimum})")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m benchmarks.attention")
    ap.add_argument("--table", metavar="GRID_CSV", default=None,
                    help="print the markdown results table of a grid CSV and exit (no GPU needed)")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--fair", action="store_true",
                    help="the fair comparison on a packed 64K batch, MHA and GQA 32:4: FlexAttention on the "
                         "token-level document mask, on whole-block (aligned) documents with exactly our kept blocks, "
                         "on padded documents, its FLASH backend, cuDNN dense (the README's table: --table of its CSV)")
    ap.add_argument("--fair-heads", type=number_list(str, lambda x: x in FAIR_HEADS, ", ".join(FAIR_HEADS)),
                    default=",".join(FAIR_HEADS),
                    help="--fair's head configurations, in this order (to split the grid over calls)")
    ap.add_argument("--fair-sparsities", type=number_list(float, lambda x: 0 <= x < 1, "sparsities in [0, 1)"),
                    default=None,
                    help="--fair's sparsities for both head configurations (default: MHA 0,0.75,0.9,0.95, "
                                       "GQA 0,0.5,0.9); 0, where the dense backends are timed, always runs")
    ap.add_argument("--fair-impls", type=number_list(str, lambda x: x in FAIR_IMPLS, ", ".join(FAIR_IMPLS)),
                    default=",".join(FAIR_IMPLS), help="--fair's implementations (ours always runs)")
    ap.add_argument("--profile", default=None,
                    help="--fair: also time 'hybrid' at every sparsity, ours or the dense backend, whichever this cost "
                         "profile (one with a 'backends' section, e.g. calibrate/profiles/h100.json) prices faster "
                         "for the batch at ours' kept fractions: cost.attention_backend=hybrid's choice")
    ap.add_argument("--quick", action="store_true", help="short follow-up check + a few of our grid points")
    ap.add_argument("--short-vs-long", action="store_true", help="short- vs long-row configs, MHA and GQA")
    ap.add_argument("--kernels", action="store_true",
                    help="each kernel alone on the fair batch at --sparsities and with only the diagonal blocks kept "
                         "(--fair-heads' head configurations): where the time goes; beside each kernel's <kind>_ms "
                         "its HBM floor <kind>_floor_ms (each operand read and written once, at a measured copy "
                         "bandwidth), their sums sum_ms and floor_sum_ms, and the effective fwd+bwd TFLOP/s of "
                         "each: tflops and floor_tflops")
    ap.add_argument("--selection", action="store_true", help="selection cost vs fwd+bwd at 8K/32K/128K, 3 repeats")
    ap.add_argument("--flex-mode", choices=FLEX_MODES, default=FLEX_MODES[0],
                    help="how FlexAttention is compiled in the grid and --fair (default: max-autotune-no-cudagraphs, "
                         "its fastest construction measured; 'default' compiles in seconds instead of minutes; "
                         "max-autotune-coordinate-descent is torchtitan's)")
    ap.add_argument("--flex-variants", action="store_true",
                    help="Flex in each --flex-mode and with fixed tile options against ours on the fair batch at "
                         "MHA 0.9 / 0.95 and GQA 0.9 (--rounds; --fair-heads to split it over calls): which "
                         "construction of the peer is strongest")
    ap.add_argument("--apply-tuned", action="store_true", help="--tune's winners for the other modes")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--check-csv", default=None, help="--check's CSV when --csv is the grid's")
    ap.add_argument("--config", default=None,
                    help="json {kind: [BM, BN, warps, stages, head_outer, tma, ws, maxnreg]} for block 128, D 128 (a "
                         "shorter list leaves the rest at the defaults)")
    ap.add_argument("--lengths", type=number_list(int, lambda x: x > 0, "positive token counts"),
                    default="8192,32768,131072")
    ap.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True,
                    help="include the packed 64K micro-batch (--no-packed: single sequences only, e.g. to split the "
                         "grid over calls)")
    ap.add_argument("--sparsities", type=number_list(float, lambda x: 0 <= x < 1, "sparsities in [0, 1)"),
                    default="0,0.5,0.75,0.9,0.95")
    ap.add_argument("--flex-dense-max", type=int, default=1 << 30)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip the remaining grid after this")
    ap.add_argument("--rounds", type=int_at_least(1, "a round count"), default=1,
                    help="time each grid point this many times, the implementations taking turns; report medians")
    ap.add_argument("--graph-max-tokens", type=int_at_least(0, "a token count"), default=0,
                    help="also time fwd and fwd+bwd replayed from CUDA graphs (GPU time without the host's launch "
                         "overhead) at grid points of at most this many tokens (0: none)")
    args = ap.parse_args(argv)
    if args.table is not None:
        if not os.path.isfile(args.table):
            ap.error(f"--table {args.table!r}: no such file (a grid CSV of this benchmark)")
        return args
    if args.profile is not None and not args.fair:
        ap.error(f"--profile {args.profile!r} prices --fair's hybrid row; allowed: with --fair")
    # checked before the GPU: a profile this benchmark cannot price the hybrid row with is one line anywhere
    args.hybrid = hybrid_costs(args.profile) if args.profile is not None else None
    if not torch.cuda.is_available():
        ap.error("no CUDA GPU here: this benchmark times the kernels, FlexAttention and cuDNN on one (the CPU "
                 "correctness tests are `python -m pytest tests/kernels`)")
    args.tune_cands = {k: [tuple(c) for c in v] for k, v in TUNE_CANDS.items()}
    configs = json.loads(args.config) if args.config else {}
    args.options = tiles_option({kind: dict(zip(CONFIG_KEYS, c, strict=False)) for kind, c in configs.items() if c})
    return args


@one_line_errors
def main(argv=None):
    args = parse_args(argv)
    if args.table is not None:
        print(results_table(args.table), end="")
        return
    if args.tune:
        best = tune(args)
        if args.apply_tuned:
            args.options = tiles_option(best)
    if args.check:
        check(argparse.Namespace(**{**vars(args), "csv": args.check_csv or args.csv}))
    if args.short_vs_long:
        short_vs_long(args)
    if args.kernels:
        kernel_breakdown(args)
    if args.flex_variants:
        flex_variants(args)
    if args.selection:
        selection_cost(lambda row: log(json.dumps(row)), args.options, lengths=(8192, 32768, 131072), repeats=3)
    if args.quick:
        args.csv = args.csv or "attention_quick.csv"
        quick(args)
    if args.fair:
        args.csv = args.csv or "attention_fair.csv"
        run_fair(args)
    if args.bench or not (args.check or args.tune or args.quick or args.selection or args.short_vs_long
                          or args.fair or args.kernels or args.flex_variants):
        if args.csv is None:
            args.csv = "attention_bench.csv"
        run_bench(args)
