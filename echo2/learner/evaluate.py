"""Evaluation on the task's held-out set: the learner's before/after/periodic evaluation and ``echo2 eval``.

The task plays the held-out episodes (``Task.evaluate``) with samplers over the learner's own model:
a greedy one (pass@1; poker's bb/100) and, with ``k > 1``, one that samples at ``temperature``
(pass@k). Prompts are left-padded so that every prompt ends where generation starts. The model generates on its
own device (the learner's policy: ``Learner.eval_model``, in the compute dtype, no copy), the padded prompts are
built there, and each batch's tokens are read back once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from echo2.tasks import Task


@dataclass
class GeneratedReply:
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str


class ModelSampler:
    """A task ``Sampler`` over a Hugging Face causal LM: greedy (``temperature=None``) or sampled."""

    def __init__(self, model, tokenizer, *, temperature: float | None, batch_size: int):
        """``model``: anything with ``generate`` (a transformers model, ``Learner.eval_model()``) and a ``device``."""
        self.model, self.tokenizer = model, tokenizer
        self.device = model.device
        self.temperature, self.batch_size = temperature, batch_size
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[GeneratedReply]:
        out: list[GeneratedReply] = []
        for start in range(0, len(prompts), self.batch_size):
            out.extend(self._batch(prompts[start:start + self.batch_size], max_new_tokens))
        return out

    def _batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[GeneratedReply]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        sampling = {"do_sample": False} if self.temperature is None else {
            "do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
        seqs = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                   pad_token_id=self.pad, eos_token_id=self.eos, **sampling)
        replies = []
        for row in seqs[:, width:].tolist():
            if self.eos in row:
                replies.append(GeneratedReply(row[:row.index(self.eos) + 1], None, "stop"))
            else:
                replies.append(GeneratedReply(row, None, "length"))
        return replies


class Generating:
    """The learner's policy as evaluation generates with it (``ModelSampler``): ``generate`` on the device, in the
    compute dtype; a sharded model's root unit is gathered for the call (its embedding and head), its layers gather
    as they run. On several ranks the followers run the same call (``distributed.py``), so FSDP's collectives meet."""

    def __init__(self, learner):
        """``learner``: a ``Learner`` (``Learner.eval_model``)."""
        self.learner = learner
        self.device = learner.device
        self.training = False

    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self

    def generate(self, **kwargs) -> torch.Tensor:
        return self.learner.generate(kwargs)


def evaluate_policy(model, tokenizer, task: Task, *, max_new_tokens: int, batch_size: int, k: int = 1,
                    temperature: float = 1.0) -> dict[str, Any]:
    """The task's held-out metrics for ``model``; ``score`` is the task's headline metric."""
    was_training = model.training
    model.eval()
    try:
        greedy = ModelSampler(model, tokenizer, temperature=None, batch_size=batch_size)
        sampled = ModelSampler(model, tokenizer, temperature=temperature, batch_size=batch_size) if k > 1 else None
        result = task.evaluate(greedy, sampled, tokenizer, k=k, max_new_tokens=max_new_tokens)
    finally:
        model.train(was_training)
    result["metric"] = task.headline
    result["score"] = result[task.headline]
    return result


def flat_metrics(result: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of an evaluation result as dotted names (``opponents.call_station.bb_per_100``)."""
    out: dict[str, float] = {}
    for key, value in result.items():
        if key in ("samples", "at_step", "seconds"):
            continue
        if isinstance(value, dict):
            out.update(flat_metrics(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out
