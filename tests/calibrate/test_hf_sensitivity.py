"""calibrate.hf_sensitivity on a tiny randomly initialised Hugging Face model built from a config (no download):
the pooled block masses, the raw rows, the profile fitted as calibrate.sensitivity fits, and the advisor's
starting point reading that profile as its prior."""
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from sparsebalance.calibrate.hf_sensitivity import (
    block_mass,
    import_transformers,
    kept_counts,
    main,
    measure,
    row_selection,
)
from sparsebalance.calibrate.sensitivity import build_profile, write_profile
from sparsebalance.sim.advise import base_overrides, prior_of
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import CONF_DIR, ConfigError
from sparsebalance.sim.run import simulate
from sparsebalance.sim.sensitivity import RAW_COLUMNS, load_sensitivity_profile


def transformers_or_skip():
    try:
        return import_transformers()
    except ConfigError:
        pytest.skip("transformers is not installed (pip install 'sparsebalance-sim[advise]')")


def test_uniform_attention_keeps_as_much_mass_as_blocks():
    length, block = 64, 16
    probs = torch.tril(torch.ones(length, length))
    probs = (probs / probs.sum(-1, keepdim=True))[None].repeat(2, 1, 1)  # 2 query heads, 1 KV head
    mass = block_mass(probs, kv_heads=1, block=block)
    assert mass.shape == (1, 4, 4) and torch.allclose(mass.sum(-1), torch.ones(1, 4))
    counts = kept_counts(mass, "kept", 0.5)
    assert counts.tolist() == [[1, 1, 2, 2]]  # round(0.5 x causal blocks), at least one
    kept = row_selection(mass, counts)
    assert float(kept[0, 0]) == pytest.approx(1.0)  # the diagonal alone is the first row's whole mass


@pytest.mark.slow
def test_a_tiny_random_model_yields_a_profile_the_simulator_reads(tmp_path):
    transformers = transformers_or_skip()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256, initializer_range=0.5)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    tokens = torch.Generator().manual_seed(0)
    sequences = [("text", i, torch.randint(0, 128, (n,), generator=tokens)) for i, n in enumerate([64] * 8 + [128] * 8)]
    raw = measure(model, sequences, block=16)
    assert list(raw.columns) == list(RAW_COLUMNS) and len(raw) == 16 * 2 * 8  # sequences x layers x budgets
    top_p = raw[raw["mode"] == "p"].groupby("budget")["coverage"].mean()
    assert top_p.is_monotonic_increasing and (top_p.index.to_numpy() <= top_p.to_numpy() + 1e-6).all()
    profile = build_profile(raw.assign(source=0), [{"command": "test"}], "test")
    path = tmp_path / "sensitivity_tiny_hf.json"
    write_profile(path, profile)
    model_of_s = load_sensitivity_profile(str(path))
    assert model_of_s.lengths == (64, 128) and np.all(np.isfinite(model_of_s.logit_mean))
    # the advisor's starting point with this profile: the planners' prior and the simulator's draws
    cfg = OmegaConf.load(CONF_DIR / "advise.yaml")
    cfg.sensitivity_profile = str(path)
    cfg.overrides = ["model=tiny", "cost=roofline", "cost.block_size=16", "cluster.gpus_per_node=2",
                     "workload.global_batch=4", "layout.micro_batches=2", "workload.min_len=64", "workload.max_len=128",
                     "workload.median=96",
                     "model.max_context=256", "steps=2", "policy=verl_topk"]
    overrides, _ = base_overrides(cfg, tmp_path)
    base = compose_config(overrides)
    # the planners start from the measured profile, and the simulator draws the truth from it too
    assert prior_of(base) == (f"profile {path} (text); the data's truth drawn from the measured profile {path} "
                              "(task its only one)")
    run = simulate(base)
    assert 0 < run.summary["attention_coverage"] <= 1


@pytest.mark.slow
def test_the_command_measures_a_local_checkpoint_on_jsonl_texts(tmp_path):
    """The real-weights path on a checkpoint directory (a tiny random Llama and a word-level tokenizer saved
    there), texts of one task cut at two lengths."""
    transformers = transformers_or_skip()
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(120)]
    vocab = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    vocab.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256, initializer_range=0.5)
    checkpoint = tmp_path / "tiny"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    transformers.PreTrainedTokenizerFast(tokenizer_object=vocab, unk_token="[UNK]").save_pretrained(checkpoint)
    pick = np.random.default_rng(0)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": " ".join(pick.choice(words, 140)), "task": "qa"}) + "\n"
                             for _ in range(10)))
    out = tmp_path / "profile.json"
    assert main(["--model", str(checkpoint), "--texts", str(texts), "--lengths", "64,128", "--block", "16",
                 "--dtype", "float32", "--out", str(out)]) == 0
    assert load_sensitivity_profile(str(out), "qa").lengths == (64, 128)
