"""The ``Task`` interface: what actors need to make prompts and score completions, and what the
learner needs to evaluate."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


class UnknownProblem(ValueError):
    """A prompt id that the task never issues for training."""


@dataclass(frozen=True)
class Problem:
    """One prompt with what its reward function needs."""

    id: str
    messages: tuple[dict[str, str], ...]
    answer: Any
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


class Task(ABC):
    name: str
    reward_range: tuple[float, float] = (0.0, 1.0)
    """Every reward lies in [low, high]; the learner rejects rollout files outside it."""
    verifiable: bool = True
    """The learner can re-score a completion itself (cheaply) and rejects files whose rewards disagree."""
    max_env_tokens: int = 0
    """Environment tokens a multi-turn episode may add to a completion (completion_mask = 0)."""

    @abstractmethod
    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` training problems (never from the held-out set)."""

    @abstractmethod
    def problem(self, prompt_id: str) -> Problem:
        """The training problem named ``prompt_id``, re-derived from the task alone.

        The learner uses it to check that a rollout's prompt is one the task issued: an actor must not
        train the policy on text of its choosing, nor on the held-out set. Raises ``UnknownProblem``.
        """

    @abstractmethod
    def eval_set(self) -> list[Problem]:
        """The fixed held-out problems."""

    @abstractmethod
    def reward(self, problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
        """Verifiable reward of ``completion`` and a JSON-able detail of how it was judged."""


def prompt_token_ids(tokenizer: Any, problem: Problem) -> list[int]:
    """Token ids of the problem's chat, rendered with the model's chat template, ready for the reply."""
    text = tokenizer.apply_chat_template(list(problem.messages), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
