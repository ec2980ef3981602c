"""The ``Engine`` interface: sample completions with per-token behavior log-probabilities.

An engine owns the policy weights of one actor. It is told about new weights as (name, tensor)
pairs in Hugging Face naming, so the same dissemination code feeds every engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class SamplingParams:
    n: int
    """Completions per prompt."""
    max_new_tokens: int
    temperature: float = 1.0
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    """Sampled tokens, including the end-of-sequence token when one was produced."""
    logprobs: list[float]
    """log mu(token | prefix) of each sampled token under the tempered sampling distribution, fp32."""
    finish_reason: str
    """"stop" (end-of-sequence produced) or "length" (cut at max_new_tokens)."""


class Engine(ABC):
    @abstractmethod
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the policy weights (all of them) with verified tensors, copying them: the caller
        changes them in place afterwards (a sparse delta applied to the weights it holds)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, ``params.n`` sampled completions."""
