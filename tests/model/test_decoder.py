"""The model holds the parameters sim.shapes.ModelShape counts (what the simulator's memory model and gradient
all-reduce price), stage by stage, and every layout starts from the same weights."""
import pytest
import torch

from sparsebalance.model import TinyLlama, make_model
from sparsebalance.sim.shapes import ModelShape, StageSpan


def shape(tied: bool) -> ModelShape:
    return ModelShape("t", hidden=32, layers=4, heads=4, kv_heads=2, head_dim=8, ffn=48, vocab=50, max_context=256,
                      tie_embeddings=tied)


def matrices(model: TinyLlama) -> int:
    """Parameters of the matrices (the norms' are left out of the count, as the publishers' counts have them)."""
    return sum(p.numel() for name, p in model.named_parameters() if not name.endswith("norm.weight"))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_every_stage_holds_the_parameters_the_shape_counts(tied, pp):
    s = shape(tied)
    with torch.device("meta"):
        stages = [TinyLlama(s, StageSpan(i, pp)) for i in range(pp)]
    assert [matrices(m) for m in stages] == [s.stage_params(StageSpan(i, pp)) for i in range(pp)]
    if pp == 1:
        assert matrices(stages[0]) == s.total_params


def test_stages_start_from_the_whole_models_weights():
    whole = make_model(shape(True), seed=3).state_dict()
    for i in range(2):
        stage = make_model(shape(True), seed=3, stage=StageSpan(i, 2)).state_dict()
        for name, weights in stage.items():
            # the last stage's LM head is a copy of the tied embedding
            expected = whole["embed.weight"] if name == "lm_head.weight" else whole[name]
            assert torch.equal(weights, expected), name
