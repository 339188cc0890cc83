"""The comparison presets: what each one holds, and that every policy of the table plans them."""
import pytest

from sparsebalance.sim.core import preset_overrides
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.cluster import Cluster, Layout
from pinned import pinned


def layout_of(experiment):
    cfg = compose_config(pinned(preset_overrides([f"experiment={experiment}"])))
    return cfg, Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))


def test_bubble_light_preset_is_the_paper_with_sixteen_micro_batches():
    cfg, layout = layout_of("paper_bubble_light")
    assert (layout.dp, layout.cp, layout.pp, layout.micro_batches) == (2, 1, 4, 16)
    assert cfg.workload.global_batch == 2 * layout.dp * layout.micro_batches  # micro-batch size 2 as `paper`


def test_64_node_preset_uses_context_parallelism_inside_a_node():
    cfg, layout = layout_of("paper_64nodes_cp")
    assert layout.gpus == 512 and layout.cp == cfg.cluster.gpus_per_node == 8
    assert cfg.workload.max_len <= cfg.model.max_context and cfg.workload.max_len > 32768
    assert cfg.workload.global_batch == 2 * layout.dp * layout.micro_batches


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["paper_bubble_light", "paper_64nodes_cp"])
def test_sparsebalance_beats_the_strongest_baseline_on_the_preset(experiment):
    """Blind planning: sparsebalance_topk beats every baseline, verl_topk (top-k at the same coverage target)
    included, at an attention-weighted coverage no lower than the top-p baselines'; top-p sparsebalance beats
    the top-p baselines."""
    from sparsebalance.sim.compare import compare

    top_p = ("baseline", "lbb", "lbb_ordered", "verl", "token_cap")
    table = compare(pinned(preset_overrides([f"experiment={experiment}", "steps=2"])),
                    ("baseline", "lbb_ordered", "verl", "verl_topk", "sparsebalance", "sparsebalance_topk"),
                    baselines=(*top_p, "verl_topk")).set_index("policy")
    assert table.loc["sparsebalance_topk", "vs_best"] > 1.0
    assert table.loc["sparsebalance_topk", "attn_cov"] >= table.loc["baseline", "attn_cov"] - 1e-9
    fastest_top_p = table.loc[["baseline", "lbb_ordered", "verl"], "step_ms"].min()
    assert table.loc["sparsebalance", "step_ms"] < fastest_top_p
    assert table.loc["sparsebalance", "attn_cov"] >= table.loc["baseline", "attn_cov"] - 1e-9
