"""Inference engine sections (``rollout.engine``; ``echo2/rollout/engines/``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from echo2.config._base import _Section


class TransformersEngineConfig(_Section):
    kind: Literal["transformers"] = "transformers"
    """Hugging Face ``generate`` inside the actor process (``echo2/rollout/engines/transformers.py``): CPU or
    one GPU, nothing to install beyond echo2."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and arithmetic of sampling. bfloat16 samples ~1.6x faster on this CPU and halves memory; the
    behavior logprobs are still taken in fp32 from its logits (they differ from the learner's fp32 ones by a
    few hundredths of a nat, which the clipped ratio and the behavior audit's threshold allow)."""
    batch_size: int = Field(64, ge=1)
    """Sequences per ``generate`` call: a batch's groups_per_batch x group_size completions are sampled this many
    at a time."""


class VllmEngineConfig(_Section):
    kind: Literal["vllm"]
    """vLLM (``echo2/rollout/engines/vllm.py``): install ``echo2[vllm]`` in an actor-only environment (vLLM and
    Prefect cannot share one). New versions are loaded into the running engine; LoRA versions become LoRA requests."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of vLLM's weights and activations ("auto": the model config's ``torch_dtype``; the embedded model's
    is fp32). Behavior logprobs are those of the distribution sampled in this dtype."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Share of the GPU's memory vLLM takes for weights and KV cache (ignored on CPU)."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """KV cache size, GiB (vLLM's ``kv_cache_memory_bytes``; on a GPU it replaces the share that
    gpu_memory_utilization leaves). None: vLLM's default (on its CPU build, 4 GiB or ``$VLLM_CPU_KVCACHE_SPACE``)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt plus completion (None: the model's ``max_position_embeddings``)."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Sequences vLLM schedules at once (None: vLLM's default)."""
    enforce_eager: bool = False
    """Run without CUDA graphs: faster start, slower decoding."""
    native_lora: bool = True
    """LoRA runs (``train.lora_rank > 0``): apply each adapter version as a vLLM LoRA request on the base weights
    (False: the actor merges the adapter and loads full weights, as for the transformers engine)."""
    extra_args: dict[str, Any] = Field(default_factory=dict)
    """More keyword arguments of ``vllm.LLM(...)``, passed as they are (e.g. ``tensor_parallel_size: 2``); they
    override echo2's own."""


EngineConfig = Annotated[TransformersEngineConfig | VllmEngineConfig, Field(discriminator="kind")]
"""Which inference engine the actors run (``echo2/rollout/engines/__init__.py: make_engine``), with its own settings."""
