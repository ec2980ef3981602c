"""The models of ``echo2 bench learner``: the CPU's small Qwen3 at Qwen3's vocabulary, and the real shapes the
GPU path builds from ``learner_configs/NAME.json`` (transformers configs; ``learner.py`` says where their
numbers come from). Imports the standard library and, inside functions, transformers only."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "learner_configs"
MODEL_CONFIGS = tuple(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
QWEN3_VOCAB = 151_936


def cpu_model_config(*, vocab: int = QWEN3_VOCAB, hidden: int = 128, layers: int = 2) -> dict:
    """A small Qwen3 (heads 32 wide, half as many KV heads, MLP 3x the hidden size, untied head) whose
    vocabulary dominates its size, memory and time, as the vocabulary term does at scale."""
    head_dim = min(32, hidden)
    heads = max(1, hidden // head_dim)
    return {"model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
            "head_dim": head_dim, "tie_word_embeddings": False, "max_position_embeddings": 40960}


def load_model_config(name: str, *, layers: int | None = None) -> dict:
    """``learner_configs/NAME.json`` as a dict, cut to its first ``layers`` decoder layers if asked."""
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no model config {name!r}: one of {', '.join(MODEL_CONFIGS)}")
    config = json.loads(path.read_text())
    if layers is not None:  # a truncated model of the same shape, for a GPU that does not hold the whole one
        config.update(num_hidden_layers=layers, layer_types=None, max_window_layers=layers)
    return config


def to_transformers(config: dict):
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    return AutoConfig.for_model(config["model_type"], **fields)
