"""sim.advise: the user's inputs read (Hugging Face configs of three families, traces), the search space pruned
before anything runs, and the recommendation's override line rerun through sim.run to the reported step time."""
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf
from sparsebalance.sim.advise import split_argv
from sparsebalance.sim.advise_inputs import hf_model, read_user_trace
from sparsebalance.sim.advise_report import html_page, pareto, tie
from sparsebalance.sim.advise_search import Scored, rank
from sparsebalance.sim.advise_space import Candidate, enumerate_space
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import CONF_DIR, ConfigError, preset_overrides
from sparsebalance.sim.run import simulate

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"
# A 2-GPU run of a tiny model on the roofline cost model: seconds, not minutes.
TINY = ["model=tiny", "cost=roofline", "cluster.gpus_per_node=2", "workload.global_batch=8", "layout.micro_batches=2",
        "workload.min_len=128", "workload.max_len=1024", "workload.median=256", "model.max_context=1024",
        "cost.block_size=32", "steps=3"]


@pytest.mark.parametrize("name, preset", [("qwen2.5-3b", "qwen2.5-3b"), ("llama3.1-8b", "llama3-8b")])
def test_a_published_config_reads_as_the_shipped_model_preset(name, preset):
    shipped = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml"))
    read = hf_model(str(CONFIGS / name / "config.json"))
    assert {k: v for k, v in read.items() if k != "name"} == {k: v for k, v in shipped.items() if k != "name"}


def test_mistral_reads_with_its_own_field_names():
    read = hf_model(str(CONFIGS / "mistral-7b-v0.3" / "config.json"))
    assert (read["layers"], read["hidden"], read["heads"], read["kv_heads"], read["head_dim"], read["vocab"],
            read["max_context"]) == (32, 4096, 32, 8, 128, 32768, 32768)


def test_an_unknown_architecture_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"architecture 'GPT2LMHeadModel' is not supported; allowed: Qwen2") as err:
        hf_model(str(CONFIGS / "gpt2" / "config.json"))
    assert "\n" not in str(err.value)


def test_a_sliding_window_in_effect_is_refused():
    with pytest.raises(ConfigError, match="sliding_window=4096 below the context 32768"):
        hf_model(str(CONFIGS / "mistral-7b-v0.1" / "config.json"))


def test_a_parquet_trace_with_task_labels_becomes_a_length_csv(tmp_path):
    pytest.importorskip("pyarrow")
    source = tmp_path / "trace.parquet"
    pd.DataFrame({"tokens": [100, 2000, 300], "task": ["qa", "code", "qa"]}).to_parquet(source)
    trace = read_user_trace(str(source), "tokens", "task", tmp_path / "out")
    assert trace.lengths.tolist() == [100, 2000, 300] and trace.tasks == {"qa": 2, "code": 1}
    assert pd.read_csv(trace.path)["length"].tolist() == [100, 2000, 300]


def test_a_missing_length_column_is_named():
    with pytest.raises(ConfigError, match="trace.length_column='tokens' is not a column"):
        read_user_trace(str(ROOT / "sim" / "traces" / "example.csv"), "tokens", None, ROOT / "unused")


def test_bare_overrides_go_to_the_starting_point_and_current_ones_to_the_reference():
    argv = split_argv(["preset=paper", "layout.pp=2", "current.policy=verl", "space.policy=[verl]"])
    assert argv == ["preset=paper", "space.policy=[verl]", "overrides=['layout.pp=2']", "current=['policy=verl']"]


def test_the_space_prunes_what_sim_run_refuses_and_what_cannot_fill_a_micro_batch():
    space = OmegaConf.load(CONF_DIR / "advise.yaml").space
    space.policy = ["verl"]
    found = enumerate_space(space, compose_config(TINY))
    # 2 GPUs: (cp, pp) in (1, 1), (1, 2), (2, 1) with dp 2, 1, 1; a global batch of 8; no dense backend priced
    assert {c.label() for c in found.candidates} == {
        f"verl dp{dp}xcp{cp}xpp{pp} m{m} ours" for dp, cp, pp in ((2, 1, 1), (1, 1, 2), (1, 2, 1))
        for m in (1, 2, 4, 8) if dp * m <= 8}
    # m 8, 16 on dp2 and 16 on each dp1 at least; sim.run's own check of empty micro-batches comes before the
    # others, so layouts refused for another reason as well count here too
    assert found.pruned["more micro-batches than a DP rank's sequences (workload.global_batch / dp)"] >= 4
    assert found.pruned["the parallel degrees do not divide the GPU count"] > 0


def test_a_policy_that_names_its_own_backend_sweeps_no_other():
    space = OmegaConf.load(CONF_DIR / "advise.yaml").space
    space.policy = ["verl_dense"]
    found = enumerate_space(space, compose_config(TINY))
    assert all(c.value("cost.attention_backend") is None for c in found.candidates)


def test_a_candidates_overrides_are_sim_run_overrides():
    c = Candidate("verl", (("layout.dp", 2), ("layout.micro_batches", 4), ("cost.attention_backend", "ours")))
    assert c.overrides() == ["policy=verl", "layout.dp=2", "layout.micro_batches=4", "cost.attention_backend=ours"]


@pytest.mark.slow
def test_the_recommended_override_line_reruns_to_the_reported_step_time(tmp_path):
    """The advisor's command (subprocess, as a user runs it), then its override line through sim.run's loop."""
    out = tmp_path / "advice"
    command = [sys.executable, "-m", "sim.advise", *TINY, "space.policy=[verl,verl_topk]",
               "search.rungs=[{keep: 3, steps: 2, seeds: 1},{keep: 2, steps: null, seeds: 2}]", "search.jobs=1",
               f"hydra.run.dir={out}"]
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    advice = json.loads((out / "advice.json").read_text())
    for name in ("report.md", "report.html", "pareto.png"):
        assert (out / name).stat().st_size > 0
    best = advice["recommended"]
    line = shlex.split(best["command"])
    assert line[:3] == ["python", "-m", "sim.run"] and line[3:] == shlex.split(done.stdout.splitlines()[-3])[3:]
    rerun = simulate(compose_config(preset_overrides(line[3:])))
    assert rerun.summary["step_ms"] == pytest.approx(best["per_seed"][0]["step_ms"], rel=1e-12)
    assert best["step_ms"] == pytest.approx(sum(s["step_ms"] for s in best["per_seed"]) / 2, rel=1e-12)
    assert "elapsed:" in done.stdout


def scored(name: str, times: list[float], coverage: float) -> Scored:
    per_seed = [{"step_ms": t, "attention_coverage": coverage, "min_coverage": 0.5, "peak_memory_gb": 1.0,
                 "prediction_error_pct": 0.0, "bubble_fraction": 0.0, "steps": 3, "seed": i}
                for i, t in enumerate(times)]
    return Scored(Candidate(name, ()), 2, sum(times) / len(times), coverage, per_seed)


def test_ranking_puts_what_reaches_the_floor_first_then_the_least_coverage_lost():
    fast_short, slow_ok, faster_ok, close_short = (scored("a", [1.0], 0.80), scored("b", [3.0], 0.91),
                                                   scored("c", [2.0], 0.90), scored("d", [0.5], 0.89))
    assert [s.candidate.policy for s in rank([fast_short, slow_ok, faster_ok, close_short],
                                             0.9)] == ["c", "b", "d", "a"]


def test_a_gap_within_the_paired_seed_spread_is_a_tie_and_one_beyond_it_is_not():
    first = scored("a", [100.0, 110.0, 120.0], 0.9)
    noisy = scored("b", [101.0, 109.0, 122.0], 0.9)  # gaps 1, -1, 2: mean 0.67, spread 1.53
    clear = scored("c", [105.0, 115.0, 125.0], 0.9)  # gaps 5, 5, 5: no spread
    tied, noise = tie([first, noisy, clear], 0.9)
    assert [s.candidate.policy for s in tied] == ["b"] and noise == pytest.approx(1.5275, rel=1e-3)


def test_the_pareto_front_keeps_what_nothing_beats_on_both_axes():
    points = [scored("a", [1.0], 0.90), scored("b", [2.0], 0.95), scored("c", [2.5], 0.93), scored("d", [0.9], 0.85)]
    assert {s.candidate.policy for s in pareto(points)} == {"a", "b", "d"}


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["trace.task_column=task"], "trace.task_column / trace.length_column name columns of trace.path"),
    (["current.policy=verl", "baseline=verl"], "baseline=verl with current set"),
    (["model_config=tests/fixtures/hf_configs/gpt2/config.json"], "architecture 'GPT2LMHeadModel' is not supported"),
    (["space.policy=[nope]"], "space.policy: 'nope' is not a policy"),
])
def test_settings_that_would_go_unused_or_are_bad_end_the_command_in_one_line(argv, message, tmp_path):
    done = subprocess.run([sys.executable, "-m", "sim.advise", *TINY, *argv, f"hydra.run.dir={tmp_path}"],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_html_page_holds_the_lists_code_and_table_of_the_markdown():
    page = html_page("# t\n\n- a fact\n\n```bash\npython -m sim.run x=1\n```\n\n| k | v |\n| --- | --- |\n| 1 | 2 |\n")
    assert "<ul>\n<li>a fact</li>\n</ul>" in page and "<pre>\npython -m sim.run x=1\n</pre>" in page
    assert "<table>\n<tr><td>k</td><td>v</td></tr>\n<tr><td>1</td><td>2</td></tr>\n</table>" in page
