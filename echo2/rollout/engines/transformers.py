"""The transformers engine (``rollout.engine.kind: transformers``): batched sampling on the CPU or one GPU
with Hugging Face ``generate``.

Device and precision (``rollout.engine.device`` / ``dtype``, resolved by ``echo2.devices``): "auto" is the
GPU where CUDA is available (bfloat16 there), else the CPU (float32). The model is built on its device
(no CPU copy first), the prompts' ids and attention mask are made there, and ``load_weights`` copies each
incoming CPU tensor into its parameter in place, cast to the engine's dtype. float32 on a GPU runs its
matmuls in TF32, as the learner does (``echo2.devices.prepare_device``).

Prefill once per prompt: a GRPO batch holds each prompt G times, so the engine computes the KV cache of each distinct
prompt (all but its last token) once, repeats it for the rows that share it, and lets ``generate`` go on from there
(``_shared_prefill``): the same arithmetic as a prefill per row, G times less of it.

Behavior log-probabilities: a logits processor (``SampledLogprobs``), first in ``generate``'s list, sees
each step's raw logits, takes ``log_softmax(logits / temperature)`` in fp32 (exactly the distribution the
token is drawn from: sampling runs with the temperature warper alone, no top-k/top-p truncation) and keeps
only the sampled token's value, gathered when that token shows up as the newest input on the next step
(the last step's from the returned sequences). So a batch holds one step's B x V log-probabilities at a
time and a B x T tensor of results, never the B x T x V logits of the whole generation (159 GB for 64
sequences of 8k tokens at a 152k vocabulary); the results are read back to the host once per batch.

Refill (``rollout.refill``, ``generate_stream``): a decode loop of the engine's own, ``transformers_refill.py``,
with ``batch_size // G`` group slots: a finished group's rows take the next group at the next step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from echo2.devices import prepare_device, resolve_device, resolve_dtype
from echo2.rollout.engines.base import Completion, Engine, K, SamplingParams, check_weights_fit
from echo2.rollout.engines.transformers_refill import RefillLoop, check_plain_cache


class SampledLogprobs(LogitsProcessor):
    """Records log mu(sampled token) per step, leaving the scores as they are.

    ``generate`` (transformers 5.17, ``_get_logits_processor``) runs, in order: the processors its generation
    config turns on (repetition penalty, minimum length, suppressed tokens...), the caller's list, then the
    sampling warpers (temperature, top-k, top-p...). The engine's config turns none of the first kind on and
    the model's own defaults are cleared (``TransformersEngine.__init__``), so this processor, the caller's
    first, gets the raw logits; the temperature comes after it. The token sampled at step k is the newest
    column of ``input_ids`` at step k + 1. Rows that finished are fed the pad token; their values after the
    end-of-sequence token are cut off with the tokens."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self._pending: torch.Tensor | None = None  # (B, V) fp32: the last step's log-probabilities
        self._columns: list[torch.Tensor] = []  # (B, 1) fp32 each: one per step whose token is known

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._pending is not None:
            self._take(input_ids[:, -1:])
        self._pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        self._columns.append(self._pending.gather(-1, tokens))
        self._pending = None

    def finish(self, tokens: torch.Tensor) -> torch.Tensor:
        """The (B, T) log-probabilities of ``tokens``, the (B, T) generated part of ``generate``'s sequences."""
        steps = tokens.shape[1]
        # The last step's token never came back as an input. (A generate that ran one step past the end and
        # undid it, as its deferred stop check may, has already gathered every kept step: its extra is dropped.)
        if len(self._columns) < steps and self._pending is not None:
            self._take(tokens[:, len(self._columns) : len(self._columns) + 1])
        self._pending = None
        if len(self._columns) < steps:
            raise RuntimeError(f"generate returned {steps} tokens but sampled {len(self._columns)} steps")
        if steps == 0:
            return torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        return torch.cat(self._columns[:steps], dim=1)


class TransformersEngine(Engine):
    def __init__(self, model_dir: Path, *, eos_token_id: int, pad_token_id: int, batch_size: int = 64,
                 dtype: str = "auto", device: str = "auto"):
        self.device = resolve_device(device, what="rollout.engine.device")
        self.dtype = resolve_dtype(dtype, self.device)
        prepare_device(self.device, self.dtype)
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(self.device):  # parameters and buffers allocated there, not on the CPU first
            self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype).eval()
        # Sampling follows the engine's GenerationConfig alone: defaults a model config carries (a repetition
        # penalty, min_p...) would reshape the distribution sampled from and the logprobs would not be its own.
        self.model.generation_config = GenerationConfig()
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.batch_size = batch_size
        self.share_prefill = True
        """Prefill each distinct prompt of a batch once (``_shared_prefill``); off only to compare the two."""

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = dict(tensors)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        # check everything before copying anything: a half-applied version is never generated from
        check_weights_fit({k: v.shape for k, v in self.model.state_dict().items()}, state, tied=tied)
        # load_state_dict copy_s each tensor into its parameter (device and dtype converted on the way): no
        # second full copy of the weights exists at any point
        self.model.load_state_dict(state, strict=False)
        del state
        if tied:
            self.model.tie_weights()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        flat = [p for p in prompts for _ in range(params.n)]
        if params.seed is not None:
            torch.manual_seed(params.seed)
        results: list[Completion] = []
        for start in range(0, len(flat), self.batch_size):
            results.extend(self._generate_batch(flat[start : start + self.batch_size], params))
        return [results[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    @torch.no_grad()
    def generate_stream(self, groups: Iterator[tuple[K, list[int]]], params: SamplingParams, *,
                        window: int) -> Iterator[tuple[K, list[Completion]]]:
        check_plain_cache(self.model)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        # as many groups as a generate batch holds rows (at least one), and no more than the caller lets be in flight
        slots = max(1, min(window, self.batch_size // params.n))
        loop = RefillLoop(self.model, slots=slots, n=params.n, eos=self.eos, pad=self.pad, device=self.device)
        yield from loop.run(groups, params)

    def _left_padded(self, prompts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids and attention mask of ``prompts`` left-padded to ``width``, built on the host and sent to the device in
        one copy each."""
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long,
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long,
                            device=self.device)
        return ids, mask

    def _shared_prefill(self, prompts: list[list[int]], width: int):
        """The KV cache of every prompt but its last token, computed once per distinct prompt and repeated for each
        row that has it (a GRPO batch holds each prompt G times); None when no prompt repeats. ``generate`` then runs
        each row's last prompt token and samples on: the same arithmetic as a prefill per row."""
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        if len(distinct) == len(prompts) or width < 2 or min(len(p) for p in prompts) < 2:
            return None
        heads = [list(p)[:-1] for p in distinct]
        ids, mask = self._left_padded(heads, width - 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers a left-padded row
        cache = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True).past_key_values
        cache.reorder_cache(torch.tensor(rows, device=self.device))
        return cache

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        width = max(len(p) for p in prompts)
        ids, mask = self._left_padded(prompts, width)
        gen_config = GenerationConfig(
            do_sample=True, temperature=params.temperature, top_k=0, top_p=1.0,
            max_new_tokens=params.max_new_tokens, eos_token_id=self.eos, pad_token_id=self.pad,
        )
        recorder = SampledLogprobs(params.temperature)
        cache = self._shared_prefill(prompts, width) if self.share_prefill else None
        sequences = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config,
                                        logits_processor=LogitsProcessorList([recorder]), past_key_values=cache)
        tokens = sequences[:, width:]
        logprobs = recorder.finish(tokens)
        completions = []
        for row_tokens, row_lp in zip(tokens.tolist(), logprobs.tolist()):  # one read-back each per batch
            if self.eos in row_tokens:
                end = row_tokens.index(self.eos) + 1
                completions.append(Completion(row_tokens[:end], row_lp[:end], "stop"))
            else:
                completions.append(Completion(row_tokens, row_lp, "length"))
        return completions
