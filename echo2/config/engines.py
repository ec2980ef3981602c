"""Inference engine sections (``rollout.engine``; ``echo2/rollout/engines/``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from echo2.config._base import _Section, check_device_name


class TransformersEngineConfig(_Section):
    kind: Literal["transformers"] = "transformers"
    """Hugging Face ``generate`` inside the actor process (``echo2/rollout/engines/transformers.py``): CPU or
    one GPU, nothing to install beyond echo2."""
    device: str = "auto"
    """Where the model runs and samples: "auto" = the GPU where CUDA is available (``cuda:LOCAL_RANK``), else
    the CPU; "cuda", "cuda:N" or "cpu" to choose ("meta" exists only for the tests' placement check). A GPU
    asked for where CUDA is not available is refused when the engine is built (``echo2/devices.py``)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights and arithmetic of sampling: "auto" = bfloat16 on a GPU, float32 elsewhere. bfloat16 halves the
    weights' memory; the behavior logprobs are still taken in fp32 from its logits (they differ from the
    learner's fp32 ones by a few hundredths of a nat, which the clipped ratio and the spot check's
    threshold allow)."""
    batch_size: int = Field(64, ge=1)
    """Sequences per ``generate`` call: a batch's groups_per_batch x group_size completions are sampled this many
    at a time."""

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        """A name only: whether CUDA is there is the engine's check, on the machine that runs it."""
        return check_device_name(value)


class VllmEngineConfig(_Section):
    kind: Literal["vllm"]
    """vLLM (``echo2/rollout/engines/vllm.py``): install ``echo2[vllm]`` in an actor-only environment (vLLM and
    Prefect cannot share one). New versions are loaded into the running engine; LoRA versions become LoRA requests."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of vLLM's weights and activations ("auto": vLLM's choice from the model config's ``dtype``, a
    float32 one downcast to the platform's preferred dtype). Behavior logprobs are those of the distribution
    sampled in this dtype. Each version's weights file is written in it ("auto": the config's dtype)."""
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
