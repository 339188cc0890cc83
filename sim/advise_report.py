"""What the advisor hands the user: the ranked table, the Pareto front of step time against coverage (a PNG),
a one-page Markdown report with the figure and the same page as HTML, the override line and the
``build_planner`` call of the recommendation, and ``advice.json`` with every figure behind them.

A tie: the recommendation's margin over the next candidate is the gap of their mean step times; it is a tie
where that gap is no larger than the noise, the larger of the spread over seeds of the gap (paired: the same
seed's batches for both) and the recommendation's own prediction error (the planner's median |realised /
predicted - 1| times its step time). Every candidate within that noise of the first is named with it.
"""
from __future__ import annotations

import html
import shlex
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from sparsebalance.sim.advise_search import Scored
from sparsebalance.sim.core import json_text, preset_overrides, write_text_atomic


@dataclass
class Advice:
    ranked: list[Scored]  # the last rung, ranked
    reference: Scored  # the user's current configuration (or the named baseline), simulated as the last rung
    reference_name: str
    floor: float  # the coverage a recommendation must reach
    base: list[str]  # the base overrides (preset, model, trace, cluster)
    facts: list[str]  # lines about the inputs, the prior, the space and the search
    elapsed_s: float

    def line(self, scored: Scored) -> str:
        """The sim.run command that reruns a candidate on the first seed with the steps of the last rung."""
        steps, seed = len_steps(scored), scored.per_seed[0]["seed"]
        own = [*scored.candidate.overrides(), f"steps={steps}", f"seed={seed}"]
        keys = {o.split("=", 1)[0] for o in own}
        return shlex.join(["python", "-m", "sim.run", *(o for o in self.base if o.split("=", 1)[0] not in keys), *own])

    def planner_call(self, scored: Scored) -> str:
        overrides = [o for o in preset_overrides([*self.base, *scored.candidate.overrides()])
                     if not o.startswith("policy=")]
        return (f"from sparsebalance.sim.setup import build_planner\n"
                f"planner = build_planner({scored.candidate.policy!r}, {overrides!r})")


def len_steps(scored: Scored) -> int:
    return int(scored.per_seed[0]["steps"])


def tie(ranked: list[Scored], floor: float) -> tuple[list[Scored], float]:
    """The candidates reaching the floor that the first cannot be told apart from, and the noise of its margin
    over the second."""
    first = ranked[0]
    error = abs(float(np.nanmedian(first.figure("prediction_error_pct")))) / 100 * first.step_ms
    error = error if np.isfinite(error) else 0.0
    tied, margin_noise = [], error
    for i, other in enumerate(r for r in ranked[1:] if r.coverage >= floor - 1e-9):
        gaps = other.figure("step_ms") - first.figure("step_ms")
        noise = max(float(np.std(gaps, ddof=1)) if gaps.size > 1 else 0.0, error)
        margin_noise = noise if i == 0 else margin_noise
        if gaps.mean() <= noise:
            tied.append(other)
    return tied, margin_noise


def md_table(frame: pd.DataFrame) -> str:
    rows = [list(frame.columns), ["---"] * frame.shape[1], *frame.astype(str).values.tolist()]
    return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in rows)


def table(advice: Advice) -> pd.DataFrame:
    """The last rung ranked, the reference among it (marked), with the speedup over the reference."""
    rows, ref_ms = advice.ranked, advice.reference.step_ms
    return pd.DataFrame({
        "rank": range(1, len(rows) + 1),
        "candidate": [(f"{advice.reference_name}: " if s is advice.reference else "") + s.candidate.label()
                      for s in rows],
        "step_ms": [f"{ms(s.step_ms)} +- {ms(spread(s.figure('step_ms')))}" for s in rows],
        "attn_cov": [f"{s.coverage:.4f}" for s in rows],
        "min_cov": [f"{np.nanmin(s.figure('min_coverage')):.3f}" for s in rows],
        "peak_GB": [f"{np.nanmax(s.figure('peak_memory_gb')):.1f}" for s in rows],
        "pred_err_%": [f"{np.nanmedian(s.figure('prediction_error_pct')):.1f}" for s in rows],
        "speedup": [f"{ref_ms / s.step_ms:.3f}" for s in rows],
        "meets_floor": ["yes" if s.coverage >= advice.floor - 1e-9 else "no" for s in rows],
    })


def ms(value: float) -> str:
    """A time in ms: one decimal, or three significant digits below 10 ms (a tiny model's steps)."""
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def spread(values: np.ndarray) -> float:
    return float(np.std(values, ddof=1)) if values.size > 1 else 0.0


def pareto(points: list[Scored]) -> list[Scored]:
    """The candidates no other is both faster than and higher in coverage than (ties kept)."""
    return [p for p in points if not any(q.step_ms <= p.step_ms and q.coverage >= p.coverage
                                         and (q.step_ms < p.step_ms or q.coverage > p.coverage) for q in points)]


def figure(advice: Advice, history: list[list[Scored]], path: Path) -> None:
    """Step time against attention-weighted coverage: every simulated candidate of each rung, the front of the
    last rung, the reference and the recommendation."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for number, rung in enumerate(history[1:-1], start=1):
        ax.scatter([s.coverage for s in rung], [s.step_ms for s in rung], s=14, alpha=0.45,
                   label=f"rung {number} ({len_steps(rung[0])} steps)")
    last = advice.ranked
    ax.scatter([s.coverage for s in last], [s.step_ms for s in last], s=30, color="tab:blue",
               label=f"last rung ({len_steps(last[0])} steps x {len(last[0].per_seed)} seeds)")
    front = sorted(pareto(last), key=lambda s: s.coverage)
    ax.plot([s.coverage for s in front], [s.step_ms for s in front], "-", color="tab:blue", label="Pareto front")
    ax.scatter([advice.reference.coverage], [advice.reference.step_ms], marker="s", s=60, color="tab:red",
               label=advice.reference_name)
    ax.scatter([last[0].coverage], [last[0].step_ms], marker="*", s=200, color="gold", edgecolor="k",
               label="recommended", zorder=5)
    ax.axvline(advice.floor, color="grey", ls=":", lw=1, label=f"coverage floor {advice.floor:.4f}")
    ax.set_xlabel("attention-weighted coverage")
    ax.set_ylabel("step time (ms)")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(advice: Advice, figure_name: str) -> str:
    best = advice.ranked[0]
    tied, noise = tie(advice.ranked, advice.floor)
    verdict = (f"**A tie**: {', '.join(s.candidate.label() for s in tied)} come within the noise "
               f"({ms(noise)} ms) of the first; any of them is as good as the data can tell."
               if tied else f"The margin over the next candidate exceeds the noise ({ms(noise)} ms).")
    frame = table(advice)
    if best is advice.reference:
        headline = (f"Keep your configuration: no candidate searched was faster at coverage {advice.floor:.4f} "
                    f"or more. {verdict}")
    else:
        headline = (f"{ms(best.step_ms)} ms per step, {advice.reference.step_ms / best.step_ms:.3f}x the "
                    f"{advice.reference_name}, attention-weighted coverage {best.coverage:.4f} (floor "
                    f"{advice.floor:.4f}). {verdict}")
    return "\n".join([
        "# sparsebalance-advise report", "",
        *[f"- {fact}" for fact in advice.facts], "",
        f"## Recommendation: {best.candidate.label()}", "",
        headline, "",
        "Run it:", "", "```bash", advice.line(best), "```", "",
        "Plan with it in your trainer:", "", "```python", advice.planner_call(best), "```", "",
        "## Ranked (the last rung)", "", md_table(frame), "",
        f"![step time against coverage]({figure_name})", "",
        f"Search wall time: {advice.elapsed_s:.0f} s.", "",
    ])


def write(advice: Advice, history: list[list[Scored]], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    png, md, page, data = out / "pareto.png", out / "report.md", out / "report.html", out / "advice.json"
    figure(advice, history, png)
    text = markdown(advice, png.name)
    write_text_atomic(md, text)
    write_text_atomic(page, html_page(text))
    write_text_atomic(data, json_text(payload(advice, history)))
    return [md, page, png, data]


def html_page(text: str) -> str:
    """The Markdown page as HTML: headings, lists, code, the table and the figure (no Markdown library)."""
    body, block = [], None  # block: the open element, "pre", "ul" or "table"
    for line in text.splitlines():
        kind = ("pre" if block == "pre" or line.startswith("```") else "ul" if line.startswith("- ")
                else "table" if line.startswith("|") else None)
        if block not in (None, kind) or (block == "pre" and line.startswith("```")):
            body.append(f"</{block}>")
            block = None
            if line.startswith("```"):
                continue
        if kind and block is None:
            body.append(f"<{kind}>")
            block = kind
            if kind == "pre":
                continue
        if block == "pre":
            body.append(html.escape(line))
        elif block == "ul":
            body.append(f"<li>{html.escape(line[2:])}</li>")
        elif block == "table":
            cells = [html.escape(c.strip()) for c in line.strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
        elif line.startswith("!["):
            body.append(f'<img src="{line[line.index("(") + 1:-1]}" alt="step time against coverage">')
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    if block:
        body.append(f"</{block}>")
    page = "\n".join(body)
    return (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>sparsebalance-advise</title></head><body>\n"
            f"{page}\n</body></html>\n")


def payload(advice: Advice, history: list[list[Scored]]) -> dict:
    def entry(s: Scored) -> dict:
        return {"candidate": s.candidate.label(), "overrides": s.candidate.overrides(), "rung": s.rung,
                "step_ms": s.step_ms, "attention_coverage": s.coverage, "per_seed": s.per_seed}
    return {
        "recommended": {**entry(advice.ranked[0]), "command": advice.line(advice.ranked[0])},
        "reference": {"name": advice.reference_name, **entry(advice.reference)},
        "floor": advice.floor, "base": advice.base, "facts": advice.facts, "elapsed_s": advice.elapsed_s,
        "rungs": [[entry(s) for s in rung] for rung in history],
    }
