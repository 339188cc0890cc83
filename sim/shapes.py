"""Model shapes read from conf/model/*.yaml with plain YAML, their parameter counts, and the pipeline's split.

The measuring side runs on GPU machines without Hydra, OmegaConf or simpy, so this module imports none of them
and reads the model files itself. Field names are those of ``sim.config.ModelConfig``; the model
(``sparsebalance.model``) takes the same record (``ModelShape.from_config`` of the Hydra config), and so do
``sim.cost``'s feature helpers. ``ModelShape`` is where parameters are counted: the cost model, the memory model,
the engine and the calibration grid read its counts, and a test holds the model's parameters to them.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import yaml

CONF_MODEL_DIR = Path(__file__).resolve().parent.parent / "conf" / "model"


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one model, named as in ``sim.config.ModelConfig``; the calibration grid and the model
    (``sparsebalance.model``) both use this record. Parameter counts are of the matrices (norms, under 0.1%,
    are left out)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_context: int
    rope_theta: float = 500000.0  # not in conf/model/: RoPE base of the runner's model, which calibration times
    tie_embeddings: bool = False  # the LM head shares the input embedding's matrix

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"model heads={self.heads} is not a multiple of kv_heads={self.kv_heads} (GQA)")

    @classmethod
    def from_config(cls, model) -> ModelShape:
        """From a ``ModelConfig`` (or anything with its attributes); a ``ModelShape`` is returned as it is."""
        if isinstance(model, cls):
            return model
        return cls(**{f.name: getattr(model, f.name) for f in _REQUIRED},
                   tie_embeddings=bool(getattr(model, "tie_embeddings", False)))

    @property
    def params_per_layer(self) -> int:
        """Weights of one layer's matrices (QKV, output projection, SwiGLU MLP)."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        out = self.heads * self.head_dim * self.hidden
        return qkv + out + 3 * self.hidden * self.ffn

    @property
    def embedding_params(self) -> int:
        """The input embedding's matrix (a lookup: it costs no FLOPs)."""
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """The LM head's matrix, whose matmul runs whether or not it shares the embedding's weights."""
        return self.hidden * self.vocab

    @property
    def total_params(self) -> int:
        """Layers, embedding and LM head, a tied head counted once (as the model's publisher counts it)."""
        head = 0 if self.tie_embeddings else self.lm_head_params
        return self.layers * self.params_per_layer + self.embedding_params + head

    def stage_params(self, stage: StageSpan) -> int:
        """Parameters one pipeline stage holds: its layers, the embedding on the first stage, the LM head on the
        last; a tied head on a last stage that is not also the first holds a copy of the embedding."""
        params = len(stage.layers(self.layers)) * self.params_per_layer
        if stage.first:
            params += self.embedding_params
        if stage.last and not (self.tie_embeddings and stage.first):
            params += self.lm_head_params
        return params


@dataclass(frozen=True)
class StageSpan:
    """Which part of the model pipeline stage ``index`` of ``count`` holds: ``layers / count`` consecutive
    layers, the embedding on the first stage, the final norm and LM head on the last."""

    index: int = 0
    count: int = 1

    def layers(self, n_layers: int) -> range:
        if n_layers % self.count:
            raise ValueError(f"{n_layers} layers do not split evenly over {self.count} pipeline stages")
        per = n_layers // self.count
        return range(self.index * per, (self.index + 1) * per)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


_REQUIRED = [f for f in fields(ModelShape) if f.default is MISSING]


def load_shape(path: Path) -> ModelShape:
    raw = yaml.safe_load(path.read_text()) or {}
    values = {"name": raw.get("name", path.stem)}
    for f in _REQUIRED:
        if f.name == "name":
            continue
        if f.name not in raw:
            raise ValueError(f"{path}: model config lacks key {f.name!r}")
        values[f.name] = int(raw[f.name])
    return ModelShape(**values, tie_embeddings=bool(raw.get("tie_embeddings", False)))


def model_names(conf_dir: Path = CONF_MODEL_DIR) -> list[str]:
    """The models there are configs for, sorted."""
    return sorted(p.stem for p in conf_dir.glob("*.yaml"))


def load_shapes(names: list[str] | None = None, conf_dir: Path = CONF_MODEL_DIR) -> list[ModelShape]:
    """The named models (all of conf/model/ when ``names`` is None), in a stable order."""
    paths = [conf_dir / f"{n}.yaml" for n in (model_names(conf_dir) if names is None else names)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"no such model config: {', '.join(missing)}")
    if not paths:
        raise FileNotFoundError(f"no model configs in {conf_dir}")
    return [load_shape(p) for p in paths]
