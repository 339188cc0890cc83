"""Your own model's sparsity: ``python -m calibrate.hf_sensitivity --model <HF name or path> --texts texts.jsonl
--lengths 1024,4096,16384 --out calibrate/profiles/sensitivity_<name>.json``.

Measures how much attention mass a Hugging Face causal LM keeps at each block budget, on the user's own texts,
and fits the sensitivity profile the simulator and the advisor read (``workload.sensitivity_profile``,
``python -m sim.advise sensitivity_profile=...``), with the same fit as ``python -m calibrate.sensitivity``
(``build_profile``: per sequence the exponent s of ``coverage = kept_fraction ** s``, then logit(s) by length).

The measurement: the model runs with eager attention and returns its attention probabilities per layer
(``output_attentions``); they are pooled to the kernel's blocks as its selection sees them: per (KV head, query
block), the mass each causal key block gets, summed over the query rows of the block and the query heads of the
KV group, normalised per row. A top-p budget keeps the fewest blocks, heaviest first, whose mass reaches p; a
kept-fraction budget keeps the round(kf x causal) heaviest (at least one); the diagonal block is always kept
(kernels/sparse_attention/selection.py's rules). Per (sequence, layer, budget) the row is written as
``python -m runner.sensitivity`` writes it (``sim.sensitivity.RAW_COLUMNS``): kept fraction = kept blocks /
causal blocks over KV heads, coverage = the mean over rows of the mass kept. Real texts have no generator
sensitivity: ``data_sensitivity`` is written as 1 for every row, and the run's facts say so.

Texts: JSONL with a ``text`` field (and optionally ``task``, default ``text``); each text that reaches a
length of ``--lengths`` is measured on its first that many tokens. Real weights need a download from the
Hub or a local checkpoint directory; the tests build a tiny random model from a config instead (``measure``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sparsebalance.calibrate.sensitivity import (
    build_profile,
    print_report,
    write_profile,
)
from sparsebalance.sim.core import (
    ArgumentParser,
    ConfigError,
    check_writable,
    number_list,
    one_line_errors,
)
from sparsebalance.sim.sensitivity import RAW_COLUMNS

P_BUDGETS = (0.5, 0.7, 0.8, 0.9, 0.95)
KEPT_BUDGETS = (0.1, 0.25, 0.5)


def block_mass(probs: torch.Tensor, kv_heads: int, block: int) -> torch.Tensor:
    """[H, L, L] attention probabilities of one layer -> [Hkv, nb, nb] mass per (KV head, query block, key
    block), each causal row normalised to 1 (the last block may be partial)."""
    heads, length, _ = probs.shape
    nb = -(-length // block)
    padded = torch.nn.functional.pad(probs.float(), (0, nb * block - length, 0, nb * block - length))
    pooled = padded.reshape(kv_heads, heads // kv_heads, nb, block, nb, block).sum(dim=(1, 3, 5))
    return pooled / pooled.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def kept_counts(mass: torch.Tensor, mode: str, budget: float) -> torch.Tensor:
    """[Hkv, nb] blocks each row keeps under a budget: its causal blocks are 0..row."""
    nb = mass.shape[-1]
    causal = torch.arange(1, nb + 1, device=mass.device).expand(mass.shape[:-1])
    if mode == "kept":
        return torch.clamp(torch.round(budget * causal), min=1).long()
    ordered = mass.sort(dim=-1, descending=True).values.cumsum(dim=-1)
    reached = (ordered < budget - 1e-6).sum(dim=-1) + 1  # fewest blocks whose mass reaches p
    return torch.minimum(reached, causal)


def row_selection(mass: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mass kept per row: the diagonal block, then the heaviest others up to ``counts`` blocks."""
    nb = mass.shape[-1]
    diag = torch.diagonal(mass, dim1=-2, dim2=-1)
    others = mass.clone()
    idx = torch.arange(nb, device=mass.device)
    others[..., idx, idx] = -1.0  # taken first, as the kernel's rules keep it always
    others = others.masked_fill(idx[None, :] > idx[:, None], -1.0)
    ordered = others.sort(dim=-1, descending=True).values.clamp_min(0.0).cumsum(dim=-1)
    extra = torch.gather(torch.nn.functional.pad(ordered, (1, 0)), -1, (counts - 1).clamp_min(0)[..., None])[..., 0]
    return diag + extra


def layer_rows(probs: torch.Tensor, kv_heads: int, block: int) -> list[tuple[str, float, float, float]]:
    """(mode, budget, kept fraction, coverage) of one layer at every budget."""
    mass = block_mass(probs, kv_heads, block)
    nb = mass.shape[-1]
    causal = kv_heads * nb * (nb + 1) / 2
    rows = []
    for mode, budgets in (("p", P_BUDGETS), ("kept", KEPT_BUDGETS)):
        for budget in budgets:
            counts = kept_counts(mass, mode, budget)
            coverage = row_selection(mass, counts).clamp(max=1.0)
            rows.append((mode, budget, float(counts.sum()) / causal, float(coverage.mean())))
    return rows


@torch.no_grad()
def measure(model, sequences: list[tuple[str, int, torch.Tensor]], block: int) -> pd.DataFrame:
    """The raw rows (``RAW_COLUMNS``) of ``(task, seq_id, token ids [L])`` on a causal LM built with eager
    attention; ``model.config`` gives the KV heads."""
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    records = []
    for task, seq_id, ids in sequences:
        attentions = model(ids[None], output_attentions=True).attentions
        for layer, probs in enumerate(attentions):
            for mode, budget, kept, coverage in layer_rows(probs[0], kv_heads, block):
                records.append((task, seq_id, int(ids.numel()), 1.0, layer, mode, budget,
                                min(1.0, max(kept, 1e-9)), min(1.0, max(coverage, 1e-9))))
    return pd.DataFrame.from_records(records, columns=list(RAW_COLUMNS))


def import_transformers():
    """``transformers``, imported with a checkout's root off ``sys.path`` for the while: it looks for Hugging
    Face's ``kernels`` package by that name, and a checkout's own ``kernels/`` folder (``python -m`` from the root
    puts the root on the path) would answer. One ConfigError line where it is not installed."""
    root = Path(__file__).resolve().parents[1]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        import transformers
        import transformers.modeling_utils
    except ImportError as exc:
        raise ConfigError(f"calibrate.hf_sensitivity needs transformers ({exc}); allowed: pip install "
                          "'sparsebalance-sim[advise]'") from None
    finally:
        sys.path[:] = saved
    return transformers


def read_texts(path: Path) -> list[tuple[str, str]]:
    """(task, text) of every JSONL line; one ConfigError line on the first bad one."""
    if not path.is_file():
        raise ConfigError(f"--texts {path}: no such file; allowed: JSONL with a 'text' field (and 'task')")
    out = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ConfigError(f"--texts {path}: line {number} is not JSON") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ConfigError(f"--texts {path}: line {number} has no 'text' string")
        out.append((str(row.get("task", "text")), row["text"]))
    return out


def tokenised(texts: list[tuple[str, str]], tokenizer, lengths: list[int]) -> list[tuple[str, int, torch.Tensor]]:
    """Each text's first ``n`` tokens for every ``n`` of ``lengths`` it reaches, numbered per task."""
    out, counts = [], {}
    for task, text in texts:
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        for n in lengths:
            if ids.numel() >= n:
                out.append((task, counts.setdefault(task, 0), ids[:n]))
                counts[task] += 1
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m calibrate.hf_sensitivity", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model name or local checkpoint directory")
    ap.add_argument("--texts", required=True, type=Path, help="JSONL, one {'text': ..., 'task': ...} per line")
    ap.add_argument("--lengths", default="1024,2048,4096", help="comma-separated token counts to measure at",
                    type=number_list(int, lambda n: n >= 1, "whole token counts >= 1"))
    ap.add_argument("--block", default=128, type=int, help="the kernel's block size (the cost profile's)")
    ap.add_argument("--out", required=True, type=Path, help="the profile to write")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    return ap.parse_args(argv)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lengths, block = sorted(set(args.lengths)), args.block
    if block < 1:
        raise ConfigError(f"--block {block}; allowed: a whole number of tokens >= 1 (the cost profile's block size)")
    check_writable(args.out, "--out")
    transformers = import_transformers()
    AutoModelForCausalLM, AutoTokenizer = transformers.AutoModelForCausalLM, transformers.AutoTokenizer
    texts = read_texts(args.texts)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager",
                                                 dtype=getattr(torch, args.dtype)).eval()
    raw = measure(model, tokenised(texts, tokenizer, lengths), block)
    command = shlex.join(["python", "-m", "calibrate.hf_sensitivity", *(sys.argv[1:] if argv is None else argv)])
    profile = build_profile(raw.assign(source=0), [run_facts(args, model, command, raw)], command)
    write_profile(args.out, profile)
    print_report(profile)
    print(f"wrote {args.out}")
    return 0


def run_facts(args: argparse.Namespace, model, command: str, raw: pd.DataFrame) -> dict:
    """The measurement's facts, as runner.sensitivity's ``<stem>.meta.json`` holds them."""
    return {"command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "model": {"source": str(args.model), "config": model.config.to_dict().get("architectures")},
            "task": {task: {"texts": str(args.texts), "lengths": sorted(map(int, np.unique(group["length"]))),
                            "data_sensitivity": "none (real texts, written as 1)"}
                     for task, group in raw.groupby("task")}}


if __name__ == "__main__":
    sys.exit(main())
