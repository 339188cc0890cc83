"""What a user brings to ``python -m sim.advise``, turned into sim.run overrides: a Hugging Face ``config.json``
(the model's shape, no weights), a length trace (CSV, JSONL or Parquet, a length column, optional task labels)
and a cluster YAML file (the ``conf/cluster`` format). Any problem is one ConfigError line."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from sparsebalance.sim.core import ConfigError, not_a_file, resolve_path
from sparsebalance.sim.workload import read_trace

# The decoder-only families whose published config.json fields the reader knows (Qwen2.5, Llama 3, Mistral);
# each attends causally over the whole context, which is what the cost model prices.
ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
            "max_position_embeddings")
TRACE_SUFFIXES = (".csv", ".jsonl", ".parquet")


def hf_model(path: str) -> dict:
    """The ``model.*`` values of a Hugging Face ``config.json``: layers, hidden size, heads, KV heads (absent:
    multi-head attention), head dimension (absent: hidden / heads), FFN width, vocabulary, maximum context,
    tied embeddings. A sliding window in effect is refused: the simulator prices full causal attention."""
    config = _json_object(path)
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in ARCHITECTURES:
        raise ConfigError(f"model config {path!r}: architecture {arch!r} is not supported; allowed: "
                          f"{', '.join(ARCHITECTURES)}")
    missing = [key for key in REQUIRED if not _whole(config.get(key))]
    if missing:
        raise ConfigError(f"model config {path!r}: {missing[0]}={config.get(missing[0])!r}; allowed: a whole "
                          f"number >= 1 ({arch} configs have {', '.join(REQUIRED)})")
    _check_window(config, path)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return {
        "name": Path(path).parent.name or Path(path).stem,
        "hidden": config["hidden_size"], "layers": config["num_hidden_layers"], "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads, "head_dim": head_dim,
        "ffn": config["intermediate_size"], "vocab": config["vocab_size"],
        "max_context": config["max_position_embeddings"],
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def _json_object(path: str) -> dict:
    file = resolve_path(path)
    problem = not_a_file(file)
    if problem:
        raise ConfigError(f"model config {path!r}: {problem}; allowed: a Hugging Face config.json")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model config {path!r}: not JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {path!r}: the top level is not a JSON object")
    return config


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_window(config: dict, path: str) -> None:
    """Qwen2 reads ``sliding_window`` only with ``use_sliding_window``; Llama has none; Mistral v0.1 has 4096."""
    window = config.get("sliding_window")
    in_effect = window is not None and config.get("use_sliding_window", True)
    if in_effect and window < config["max_position_embeddings"]:
        raise ConfigError(f"model config {path!r}: sliding_window={window} below the context "
                          f"{config['max_position_embeddings']}; allowed: full causal attention (sliding_window "
                          "null or use_sliding_window false), which is what the cost model prices")


@dataclass(frozen=True)
class Trace:
    """A user's trace as the trace workload reads it, with what the advisor reports of it."""

    path: str  # a CSV or JSONL file with a ``length`` column (a copy where the user's file is otherwise)
    lengths: np.ndarray
    tasks: dict[str, int]  # label -> sequences; empty without labels


def read_user_trace(path: str, length_column: str, task_column: str | None, out_dir: Path) -> Trace:
    """The trace's lengths (checked as sim.workload checks a trace) and task counts; a Parquet file, or one whose
    length column has another name, is copied to ``out_dir/trace.csv`` with a ``length`` column."""
    file = resolve_path(path)
    if file.suffix not in TRACE_SUFFIXES:
        raise ConfigError(f"trace.path={path!r}: suffix {file.suffix!r}; allowed: {', '.join(TRACE_SUFFIXES)}")
    frame = _trace_frame(path, file)
    for key, column in (("trace.length_column", length_column), ("trace.task_column", task_column)):
        if column is not None and column not in frame.columns:
            raise ConfigError(f"{key}={column!r} is not a column of {path!r}; "
                              f"allowed: {', '.join(map(str, frame.columns))}")
    tasks = frame[task_column].astype(str).value_counts().to_dict() if task_column else {}
    if file.suffix != ".parquet" and length_column == "length":
        return Trace(path, read_trace(path), tasks)
    out_dir.mkdir(parents=True, exist_ok=True)
    copy = out_dir / "trace.csv"
    frame[[length_column]].rename(columns={length_column: "length"}).to_csv(copy, index=False)
    return Trace(str(copy), read_trace(str(copy)), tasks)


def _trace_frame(path: str, file: Path) -> pd.DataFrame:
    problem = not_a_file(file)
    if problem:
        raise ConfigError(f"trace.path={path!r}: {problem}; allowed: a CSV, JSONL or Parquet trace")
    try:
        if file.suffix == ".parquet":
            return pd.read_parquet(file)
        if file.suffix == ".jsonl":
            return pd.read_json(file, lines=True, dtype=False)
        return pd.read_csv(file, dtype=str)
    except ImportError:
        raise ConfigError(f"trace.path={path!r}: reading Parquet needs pyarrow; allowed: pip install "
                          "'sparsebalance-sim[advise]', or a CSV or JSONL trace") from None
    except (ValueError, OSError) as exc:
        raise ConfigError(f"trace.path={path!r}: unreadable ({str(exc).splitlines()[0]})") from None


def cluster_file(path: str) -> dict:
    """A cluster YAML file in the ``conf/cluster`` format, as a mapping (checked with the schema when composed)."""
    file = resolve_path(path)
    problem = not_a_file(file)
    if problem:
        raise ConfigError(f"cluster_file={path!r}: {problem}; allowed: a YAML file in the conf/cluster format")
    try:
        node = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"cluster_file={path!r}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(node, dict):
        raise ConfigError(f"cluster_file={path!r}: the top level is not a mapping of the conf/cluster keys")
    return node


def dotted(prefix: str, node: dict) -> list[str]:
    """A nested mapping as ``prefix.key=value`` overrides (Hydra's grammar: strings quoted)."""
    out = []
    for key, value in node.items():
        if isinstance(value, dict):
            out += dotted(f"{prefix}.{key}", value)
        else:
            out.append(f"{prefix}.{key}={override_value(value)}")
    return out


def override_value(value) -> str:
    """A value as a Hydra override writes it: null, true/false, numbers as they are, strings quoted where they
    hold characters the override grammar reads."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    return text if text.replace("_", "").replace("-", "").replace(".", "").replace("/", "").isalnum() else f"'{text}'"
