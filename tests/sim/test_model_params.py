"""Every model in conf/model/ has the parameter count its publisher states, within 1% (what the gradient
all-reduce moves), and its FLOPs follow the literature: the LM head is a matmul, the embedding a lookup."""
import pytest

from sparsebalance.sim.cost import layer_features, params_per_layer, total_params
from sparsebalance.sim.core import group_options
from sparsebalance.sim.config import compose_config

# Parameters as published on each model's card.
PUBLISHED = {
    "qwen2.5-3b": 3.09e9,  # huggingface.co/Qwen/Qwen2.5-3B: "Number of Parameters: 3.09B"
    "llama3-8b": 8.03e9,  # huggingface.co/meta-llama/Meta-Llama-3-8B: 8.03B (safetensors)
}


def model(name):
    return compose_config([f"model={name}"]).model


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
    assert per_token * m.layers == pytest.approx(2 * (m.layers * params_per_layer(m) + m.vocab * m.hidden))
