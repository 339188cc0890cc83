"""The paper-setting experiment and the entry points that report SparseBalance against the baseline."""
import subprocess
import sys
from collections import Counter

import pytest

from sparsebalance.sim.compare import compare
from sparsebalance.sim.compare import main as compare_main
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.run import simulate
from sparsebalance.sim.core import preset_overrides
from sparsebalance.sim.config import compose_config
from pinned import PINNED_OVERRIDES, pinned


@pytest.mark.parametrize("preset,gpus,dp,tp", [("paper", 8, 2, 1), ("paper_4nodes", 32, 8, 1), ("paper_tp", 32, 4, 2)])
def test_paper_presets_simulate_the_papers_setting(preset, gpus, dp, tp):
    """The paper's setting as the simulator runs it, not as the preset spells it: Qwen2.5-3B on long-context QA,
    four pipeline stages, every DP rank's step in 4 micro-batches of 2 sequences (the paper's micro-batch size),
    on one node of 8 GPUs (DP2), on 4 nodes (DP8), or on 4 nodes as the paper's reported DP4 x PP4 x TP2."""
    cfg = compose_config(pinned(preset_overrides([f"experiment={preset}", "steps=1"])))
    out = simulate(cfg)
    s = out.summary
    assert (s["gpus"], s["dp"], s["cp"], s["pp"], s.get("tp", 1), s["micro_batches"]) == (gpus, dp, 1, 4, tp, 4)
    assert (s["model"], s["workload"]) == ("qwen2.5-3b", "longqa")
    plan = Plan.from_json(out.results.plans[0])
    sizes = Counter((a.dp_rank, a.micro_batch) for a in plan.assignments)
    assert len(sizes) == dp * 4 and set(sizes.values()) == {2}


@pytest.fixture(scope="module")
def paper_table():
    return compare(pinned(preset_overrides(["experiment=paper"])), oracles=("sparsebalance",)).set_index("policy")


@pytest.mark.slow
def test_sparsebalance_beats_the_paper_at_no_coverage_cost(paper_table):
    sb, base = paper_table.loc["sparsebalance"], paper_table.loc["baseline"]
    assert sb["speedup"] >= 1.33
    assert sb["mean_cov"] >= base["mean_cov"]
    assert sb["min_cov"] >= 0.8  # the coverage floor


@pytest.mark.slow
def test_sparsebalance_beats_the_strongest_baseline_where_the_attention_is(paper_table):
    """Against the fastest of baseline, lbb, lbb_ordered, verl, token_cap and verl_topk, at no loss of coverage
    weighted by attention work (the constraint DST keeps by default) or of the longest quarter's: by 5% when it
    plans with every sequence's true sensitivity (the oracle row), and planning blind (its online estimator)."""
    base = paper_table.loc["baseline"]
    oracle, blind = paper_table.loc["oracle: sparsebalance"], paper_table.loc["sparsebalance"]
    assert oracle["vs_best"] >= 1.05 and blind["vs_best"] > 1.0
    for sb in (oracle, blind):
        assert sb["attn_cov"] >= base["attn_cov"] and sb["long_cov"] >= base["long_cov"]


@pytest.mark.slow
def test_verl_is_the_strongest_top_p_baseline_and_verl_topk_the_strongest_on_the_paper_preset(paper_table):
    top_p = paper_table.loc[["baseline", "lbb", "lbb_ordered", "verl", "token_cap"]]
    assert top_p["step_ms"].min() == paper_table.loc["verl", "step_ms"]
    baselines = paper_table.loc[["baseline", "lbb", "lbb_ordered", "verl", "token_cap", "verl_topk"]]
    assert baselines["vs_best"].max() == pytest.approx(1.0)
    assert paper_table.loc["verl_topk", "vs_best"] == pytest.approx(1.0)


@pytest.mark.slow
def test_each_mechanism_alone_beats_the_baseline(paper_table):
    assert paper_table.loc["dst", "speedup"] > 1.0 and paper_table.loc["sab", "speedup"] > 1.0
    assert paper_table.loc["sab", "speedup"] >= paper_table.loc["lbb", "speedup"]
    assert paper_table.loc["sparsebalance", "speedup"] > paper_table.loc["sab", "speedup"]


@pytest.mark.slow
def test_sim_run_reports_sparsebalance_against_the_baseline(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sparsebalance.sim.run", "policy=sparsebalance", "steps=3", f"hydra.run.dir={tmp_path}",
         *PINNED_OVERRIDES],
        capture_output=True, text=True, check=True,
    ).stdout
    header, sb, base = out.splitlines()[:3]
    assert "speedup" in header and "mean_cov" in header and "min_cov" in header
    assert sb.split()[0] == "sparsebalance" and base.split()[0] == "baseline"
    assert float(sb.split()[-1]) > 1.0


@pytest.mark.parametrize("args,message", [
    (["experiment=nope"], "unknown experiment 'nope'; allowed: paper, paper_4nodes,"),  # the simulator's presets
    (["experiment=paper", "--baselines", "verl,nope"],
     "--baselines 'nope': no policy 'nope' in conf/policy/; allowed: baseline,"),
    (["experiment=paper", "--bounds", "nope"], "--bounds 'nope': no policy 'nope'"),
    (["experiment=paper", "--policies", "sparsebalance,nope"], "--policies 'nope': no policy 'nope'"),
])
def test_compare_names_the_bad_value_and_the_option_it_came_from(args, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["python -m sim.compare", "steps=1", *args])
    with pytest.raises(SystemExit) as exited:
        compare_main()
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith(f"error: {message}"), stderr
