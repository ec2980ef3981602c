"""The ``Engine`` interface: sample completions with per-token behavior log-probabilities (the
implementations and the factory that picks one are the package's: ``echo2/rollout/engines/__init__.py``).

An engine owns the policy weights of one actor. It is told about new weights as (name, tensor)
pairs in Hugging Face naming, so the same dissemination code feeds every engine. A LoRA version
is merged into its base by the actor, unless the engine says it applies adapters itself
(``native_lora``, e.g. vLLM's LoRA requests): then the actor loads the base once and hands the
engine each adapter as it arrives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator, TypeVar

import torch

K = TypeVar("K", bound=Hashable)
"""The caller's key of a prompt group in ``Engine.generate_stream``."""


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
    native_lora: bool = False
    """Whether this engine applies LoRA adapter versions itself (``load_lora``). If not, the actor
    merges each adapter into its base and calls ``load_weights`` with the full weights."""

    @abstractmethod
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the policy weights (all of them) with verified tensors, copying them: the caller
        changes them in place afterwards (a sparse delta applied to the weights it holds)."""

    def load_lora(self, adapter: dict[str, torch.Tensor], *, version: int, rank: int, alpha: float) -> None:
        """Generate from now on with the weights of the last ``load_weights`` plus this peft adapter
        (``W + (alpha / rank) B A``; keys as ``get_peft_model_state_dict`` names them). Called only
        where ``native_lora`` is true."""
        raise NotImplementedError(f"{type(self).__name__} does not apply LoRA adapters itself")

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, ``params.n`` sampled completions."""

    def generate_stream(self, groups: Iterator[tuple[K, list[int]]], params: SamplingParams, *,
                        window: int) -> Iterator[tuple[K, list[Completion]]]:
        """Refill (``rollout.refill``): ``params.n`` completions of each ``(key, prompt)`` that ``groups`` yields,
        each group yielded with its key as soon as its n completions are done, in the order they finish. A group
        is taken from ``groups`` only when fewer than ``window`` are in flight, so the caller decides at every
        take whether to go on (flow control, a new version); when ``groups`` is exhausted the groups in flight
        are finished and the stream ends. Weights must not change while a stream is open: every group of a
        stream is sampled from the weights it started with.

        This default keeps no engine full: it takes ``window`` groups, generates them in one ``generate`` call
        and yields them, batch by batch, for an engine with no stream of its own."""
        while True:
            batch: list[tuple[K, list[int]]] = []
            for item in groups:
                batch.append(item)
                if len(batch) == window:
                    break
            if not batch:
                return
            done = self.generate([prompt for _, prompt in batch], params)
            yield from zip((key for key, _ in batch), done)
            if len(batch) < window:
                return

    def close(self) -> None:
        """Release what the engine holds outside this process (vLLM's engine process); idempotent."""


def check_weights_fit(shapes: dict[str, torch.Size], state: dict[str, torch.Tensor], *, tied: bool) -> None:
    """Raise unless ``state`` holds exactly the model's tensors (``shapes``: its Hugging Face state dict),
    each of its shape; a tied ``lm_head.weight`` may be absent. Engines call it before loading anything,
    so a half-applied version is never generated from."""
    missing = [k for k in shapes if k not in state and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in state if k not in shapes]
    misshapen = [k for k in state if k in shapes and state[k].shape != shapes[k]]
    if missing or unexpected or misshapen:
        raise ValueError(f"weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                         f"wrong shape {misshapen[:3]}")
