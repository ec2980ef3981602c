"""Inference engines: sample completions with their behavior log-probabilities. The interface is in
``base.py``, one engine per file, chosen by config (``rollout.engine``, the ``EngineConfig`` union in
``echo2/config/engines.py``); ``make_engine`` is the only place that maps a config to its engine.

    transformers  Hugging Face ``generate`` in the actor process (``transformers.py``)
    vllm          vLLM, weights reloaded in place (``vllm.py``; the ``vllm`` extra)

Adding an engine is three steps:

1. its config class in ``echo2/config/engines.py`` (a new ``kind``), added to the ``EngineConfig`` union;
2. one file here, a subclass of ``base.Engine`` that imports from ``echo2.rollout.engines.base`` only;
3. one branch in ``make_engine`` below that builds it from its config.
"""

from __future__ import annotations

from pathlib import Path

from echo2.config import Config, TransformersEngineConfig, VllmEngineConfig
from echo2.rollout.engines.base import Completion, Engine, SamplingParams, check_weights_fit


def make_engine(config: Config, model_dir: Path, tokenizer, *, seed: int) -> Engine:
    """The engine ``config.rollout.engine`` names, for the model whose config and tokenizer files are
    in ``model_dir`` (weights come later, through ``load_weights``). ``seed`` is the actor's own: the
    transformers engine samples from torch's global generator, which the actor seeds with it; vLLM
    takes it as its engine seed. Each engine is imported only when chosen (vLLM's lives in an
    environment of its own)."""
    engine = config.rollout.engine
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if isinstance(engine, TransformersEngineConfig):
        from echo2.rollout.engines.transformers import TransformersEngine

        return TransformersEngine(model_dir, eos_token_id=eos, pad_token_id=pad, batch_size=engine.batch_size,
                                  dtype=engine.dtype, device=engine.device)
    if isinstance(engine, VllmEngineConfig):
        from echo2.rollout.engines.vllm import VllmEngine

        return VllmEngine(model_dir, engine, eos_token_id=eos, seed=seed, lora_rank=config.train.lora_rank)
    raise ValueError(f"unknown engine kind {engine.kind!r}")


__all__ = ["Completion", "Engine", "SamplingParams", "check_weights_fit", "make_engine"]
