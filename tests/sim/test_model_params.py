"""Every model in conf/model/ has the parameter count its publisher states, within 1% (what the gradient
all-reduce moves), and its FLOPs follow the literature: the LM head is a matmul, the embedding a lookup."""
import pytest

from sparsebalance.sim.cost import layer_features
from sparsebalance.sim.core import group_options
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.shapes import ModelShape, StageSpan

# Parameters as published on each model's card.
PUBLISHED = {
    "qwen2.5-3b": 3.09e9,  # huggingface.co/Qwen/Qwen2.5-3B: "Number of Parameters: 3.09B"
    "llama3-8b": 8.03e9,  # huggingface.co/meta-llama/Meta-Llama-3-8B: 8.03B (safetensors)
}


def model(name):
    return compose_config([f"model={name}"]).model


def total_params(model) -> int:
    return ModelShape.from_config(model).total_params


# The project's own models, which no publisher counts: the runner's learning model.
OWN = ["tiny"]


def test_every_model_config_has_a_published_count():
    assert sorted([*PUBLISHED, *OWN]) == group_options("model")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_the_published_one(name):
    assert total_params(model(name)) == pytest.approx(PUBLISHED[name], rel=0.01)


def test_tied_embeddings_count_one_matrix():
    qwen = model("qwen2.5-3b")
    untied = qwen.copy()
    untied.tie_embeddings = False
    assert total_params(untied) - total_params(qwen) == qwen.vocab * qwen.hidden


def test_layer_flops_count_the_lm_head_once_and_no_embedding():
    m = model("llama3-8b")
    per_token = layer_features(1.0, m)["flops"]
    layer = ModelShape.from_config(m).params_per_layer
    assert per_token * m.layers == pytest.approx(2 * (m.layers * layer + m.vocab * m.hidden))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_the_stages_hold_every_parameter_once_and_a_tied_heads_copy(name, pp):
    """What sim.memory prices per stage: the layers split evenly, the embedding on the first stage, the LM head
    on the last (a copy of the embedding where they are tied and the stages are several)."""
    shape = ModelShape.from_config(model(name))
    held = [shape.stage_params(StageSpan(s, pp)) for s in range(pp)]
    copy = shape.lm_head_params if shape.tie_embeddings and pp > 1 else 0
    assert sum(held) == shape.total_params + copy
    layers = shape.layers // pp * shape.params_per_layer
    assert held[1:-1] == [layers] * (pp - 2) and held[0] >= layers + shape.embedding_params
