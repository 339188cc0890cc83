"""``--table``: the markdown results table of a grid CSV or a ``--fair`` CSV (no GPU needed)."""
from __future__ import annotations

import math

from sparsebalance.sim.core import ConfigError
from .fair import DENSE_IMPLS, FAIR_PAIRS, SPARSE_IMPLS


def case_label(case: str, T: int, ndocs: int) -> str:
    return f"packed {T // 1024}K ({ndocs} documents)" if case.startswith("packed") else f"single {T // 1024}K"


def cell(ms: float, speedup: float) -> str:
    return "-" if math.isnan(ms) else f"{ms:.2f}" + ("" if math.isnan(speedup) else f" ({speedup:.2f}x)")


# the columns each table reads, of a grid CSV and of a --fair CSV (which has ``heads``)
TABLE_COLUMNS = {"grid": ("case", "T", "ndocs", "sparsity", "impl", "fwd_ms", "fwdbwd_ms", "speedup_vs_flex_fwdbwd",
                          "error"),
                 "fair": ("heads", "T", "ndocs", "padded_T", "sparsity", "impl", "fwdbwd_ms", "fwdbwd_tflops", "error")}
TABLE_INPUT = "allowed: a grid CSV (--bench --csv) or a --fair CSV of python -m benchmarks.attention"


def read_results(path: str):
    """The rows of a grid or --fair CSV; any other file is one ConfigError line naming it."""
    import pandas as pd

    try:
        df = pd.read_csv(path, dtype={"error": str})  # an all-empty column would read as float
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--table {path!r}: not a readable CSV ({str(exc).splitlines()[0]}); {TABLE_INPUT}") from None
    missing = [c for c in TABLE_COLUMNS["fair" if "heads" in df else "grid"] if c not in df]
    if missing:
        raise ConfigError(f"--table {path!r}: no column {missing[0]!r}; {TABLE_INPUT}")
    if df.empty:
        raise ConfigError(f"--table {path!r}: a header without rows; {TABLE_INPUT}")
    return df


def results_table(path: str) -> str:
    """Markdown of a grid CSV (of a --fair CSV: :func:`fair_table`): our fwd+bwd ms and FlexAttention's time over ours
    per case and sparsity (by
    ``do_bench``, and by CUDA-graph replay where the grid has it), the dense point against cuDNN, and the
    selection's cost."""
    df = read_results(path)
    if "heads" in df:
        return fair_table(df)
    ours, cudnn = df[df.impl == "triton_sparse"], df[df.impl == "cudnn_dense"].set_index("T")
    sparsities = sorted(ours.sparsity.unique())
    lines = ["| fwd+bwd ms (FlexAttention's time / ours) | " + " | ".join(f"sparsity {s:g}" for s in sparsities)
             + " | dense: cuDNN's time / ours |", "| --- " * (len(sparsities) + 2) + "|"]
    timings = (("", "fwdbwd_ms", "speedup_vs_flex_fwdbwd"),
               (", CUDA graph", "fwdbwd_graph_ms", "speedup_vs_flex_fwdbwd_graph"))
    for (case, T, ndocs), g in ours.groupby(["case", "T", "ndocs"], sort=False):
        g = g.set_index("sparsity")
        for suffix, ms, speedup in timings:
            if ms not in g or g[ms].isna().all():
                continue
            cells = [cell(g[ms].get(s, float("nan")), g[speedup].get(s, float("nan"))) for s in sparsities]
            dense = (f"{cudnn.loc[T, ms] / g.loc[0.0, ms]:.2f}x" if T in cudnn.index and 0.0 in g.index
                     and not math.isnan(cudnn.loc[T, ms]) else "-")
            lines.append(f"| {case_label(case, T, ndocs)}{suffix} | " + " | ".join(cells) + f" | {dense} |")
    return "\n".join(lines + selection_lines(df)) + "\n"


FAIR_COLUMNS = (("flex_token_mask", "Flex, token-level document mask"), ("flex_padded", "Flex, documents padded"),
                ("flex_exact", "Flex, aligned, exact blocks"),
                ("flex_flash_exact", "Flex FLASH, aligned, exact blocks"),
                ("cudnn_per_document_dense", "cuDNN dense, a call per document"),
                ("fa4_varlen_dense", "FlashAttention-4 dense varlen"),
                ("fa3_varlen_dense", "FlashAttention-3 dense varlen"),
                ("fa4_sparse", "FlashAttention-4 block-sparse, our blocks, documents padded"))


def fair_table(df) -> str:
    """Markdown of a --fair CSV: per head configuration and sparsity, the kept fraction, our fwd+bwd ms and
    effective TFLOP/s on the unaligned and the aligned batch, and each other implementation's ms with its time
    over ours (above 1: ours is faster) against ours on the batch it starts from (FAIR_PAIRS); a dense backend,
    timed at sparsity 0, against ours at every sparsity. Columns of implementations the CSV never names are left
    out; then why any is absent. Where the CSV has ``hybrid`` rows (``--profile``), a last column: hybrid's ms and
    the backend the profile chose, with the fastest dense kernel's time and ours' over hybrid's (at least 1:
    hybrid is as fast), and a note at each point where the profile chose the slower option."""
    ours_of = {theirs: ours for theirs, ours in FAIR_PAIRS}
    columns = [(impl, title) for impl, title in FAIR_COLUMNS if impl in set(df.impl)]
    hybrid = "hybrid" in set(df.impl)
    titles = [title for _, title in columns] + ([HYBRID_TITLE] if hybrid else [])
    lines = ["| heads | sparsity | kept | ours, unaligned: ms (TFLOP/s) | ours, aligned: ms (TFLOP/s) | "
             + " | ".join(titles) + " |", "| --- " * (5 + len(titles)) + "|"]
    timed = df[df.fwdbwd_ms.notna()]
    # the dense kernels at sparsity 0, where a point did not time them itself (their work is the same at any)
    dense = timed[timed.impl.isin(DENSE_IMPLS.values()) & (timed.sparsity == 0)].set_index(["heads", "impl"]).fwdbwd_ms
    notes = []
    for (heads, sp), g in timed.groupby(["heads", "sparsity"], sort=False):
        g = g.set_index("impl")

        def ours(impl, g=g):
            return f"{g.fwdbwd_ms[impl]:.2f} ({g.fwdbwd_tflops[impl]:.0f})" if impl in g.index else "-"

        def peer(impl, g=g, heads=heads):
            ms = g.fwdbwd_ms[impl] if impl in g.index else dense.get((heads, impl), float("nan"))
            return "-" if math.isnan(ms) or ours_of[impl] not in g.index else \
                f"{ms:.2f} ({ms / g.fwdbwd_ms[ours_of[impl]]:.2f}x)"

        kept = g.kept_fraction.get("triton_sparse", float("nan"))
        here = point_dense(g, dense.get(heads))
        cells = [peer(i) for i, _ in columns] + ([hybrid_cell(g, here)] if hybrid else [])
        lines.append(f"| {heads} | {sp:g} | {kept:.3f} | {ours('triton_sparse')} | {ours('triton_sparse_aligned')} | "
                     + " | ".join(cells) + " |")
        notes += hybrid_note(g, here, heads, sp) if hybrid else []
    absent = df[df.error.fillna("").str.startswith("absent")].drop_duplicates("impl")
    notes += [f"* {dict(FAIR_COLUMNS).get(r.impl, r.impl)}: {r.error}" for r in absent.itertuples()]
    padded = df[df.impl == "flex_padded"].dropna(subset=["padded_T"]).head(1)
    notes += [f"* padded batch: {int(r.padded_T)} tokens for {int(r.T)} ({r.padded_T / r.T - 1:.1%} more), "
              f"{int(r.ndocs)} documents" for r in padded.itertuples()]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


HYBRID_TITLE = "hybrid: ms, backend (fastest dense's ms / hybrid's, ours' / hybrid's)"


def point_dense(g, fallback):
    """The dense kernels' ms that hybrid is held against at one point: those timed in the same turns where the
    run timed them at every sparsity (``--profile``), else ``fallback``, their sparsity-0 times."""
    here = g.fwdbwd_ms[g.index.isin(list(DENSE_IMPLS.values()))]
    return here if len(here) else fallback


def hybrid_cell(g, dense) -> str:
    """Hybrid's cell at one point (``g``: its rows by impl; ``dense``: the dense kernels' ms by impl, or None)."""
    if "hybrid" not in g.index:
        return "-"
    ms = g.fwdbwd_ms["hybrid"]
    fastest = dense.min() if dense is not None else float("nan")
    ours = g.fwdbwd_ms.get("triton_sparse", float("nan"))
    ratios = ", ".join("-" if math.isnan(x) else f"{x / ms:.2f}x" for x in (fastest, ours))
    return f"{ms:.2f} {g.backend['hybrid']} ({ratios})"


def hybrid_note(g, dense, heads: str, sp: float) -> list[str]:
    """A note where the option the profile chose ran slower than another that this point timed (ours or a sparse
    peer here, a dense kernel here or at sparsity 0)."""
    if "hybrid" not in g.index or "triton_sparse" not in g.index:
        return []
    options = {"ours": g.fwdbwd_ms["triton_sparse"]}
    options |= {name: dense[impl] for name, impl in DENSE_IMPLS.items() if dense is not None and impl in dense}
    options |= {name: g.fwdbwd_ms[impl] for name, impl in SPARSE_IMPLS.items() if impl in g.index}
    chosen, best = g.backend["hybrid"], min(options, key=options.get)
    if chosen not in options or options[chosen] <= options[best]:
        return []
    return [f"* hybrid at {heads}, sparsity {sp:g}: the profile chose {chosen} ({options[chosen]:.2f} ms), {best} ran "
            f"{options[best]:.2f} ms ({options[best] / options[chosen]:.2f}x)"]


def selection_lines(df) -> list[str]:
    """One line per selection mode: its time and its share of fwd+bwd over the grid's selection rows."""
    sel = df[df.case.str.startswith("selection")]
    out = []
    for impl, g in sel.groupby("impl", sort=False):
        share = g.error.str.extract(r"select/attn_fwdbwd=([0-9.]+)", expand=False).astype(float) * 100
        T = int(g["T"].iloc[0])
        out.append(f"* selection ({impl[len('select['):-1]}) at {T // 1024}K tokens: {g.fwd_ms.min():.2f}-"
                   f"{g.fwd_ms.max():.2f} ms, {share.min():.1f}-{share.max():.1f}% of the fwd+bwd over it "
                   f"({len(g)} samples)")
    return [""] + out if out else []
