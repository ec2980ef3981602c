"""The transformers engine (``rollout.engine.kind: transformers``): batched sampling on CPU (or one
GPU) with Hugging Face ``generate``.

Weights and arithmetic are fp32 or bf16 (``dtype``). Behavior log-probabilities are computed in fp32
from the raw logits of every step
(``output_logits``), divided by the temperature: exactly the distribution the token was drawn
from, since sampling runs with no top-k/top-p truncation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from echo2.rollout.engines.base import Completion, Engine, SamplingParams, check_weights_fit


class TransformersEngine(Engine):
    def __init__(self, model_dir: Path, *, eos_token_id: int, pad_token_id: int, batch_size: int = 64,
                 dtype: str = "float32"):
        config = AutoConfig.from_pretrained(model_dir)
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype).eval()
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.batch_size = batch_size

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = dict(tensors)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        # check everything before copying anything: a half-applied version is never generated from
        check_weights_fit({k: v.shape for k, v in self.model.state_dict().items()}, state, tied=tied)
        self.model.load_state_dict({k: v.to(self.dtype) if v.is_floating_point() else v for k, v in state.items()},
                                   strict=False)
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

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        gen_config = GenerationConfig(
            do_sample=True, temperature=params.temperature, top_k=0, top_p=1.0,
            max_new_tokens=params.max_new_tokens, eos_token_id=self.eos, pad_token_id=self.pad,
            output_logits=True, return_dict_in_generate=True,
        )
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
        tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float() / params.temperature  # (B, T, V)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        completions = []
        for row_tokens, row_lp in zip(tokens.tolist(), logprobs.tolist()):
            if self.eos in row_tokens:
                end = row_tokens.index(self.eos) + 1
                completions.append(Completion(row_tokens[:end], row_lp[:end], "stop"))
            else:
                completions.append(Completion(row_tokens, row_lp, "length"))
        return completions
