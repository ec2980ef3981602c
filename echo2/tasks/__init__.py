"""Tasks: prompts, episodes, verifiable rewards and held-out sets. One task per file, chosen by config
(``task.name``); this factory is the only place that maps a config to its task."""

from __future__ import annotations

from echo2.config import ArithmeticTaskConfig, MathTaskConfig, PokerTaskConfig, TaskConfig
from echo2.tasks.base import (
    Episode,
    ForgedEpisode,
    Problem,
    Sample,
    Sampler,
    Task,
    UnknownProblem,
    pass_at_k,
    prompt_token_ids,
)


def make_task(config: TaskConfig) -> Task:
    if isinstance(config, ArithmeticTaskConfig):
        from echo2.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(digits=config.digits, eval_size=config.eval_size)
    if isinstance(config, MathTaskConfig):
        from echo2.tasks.math import MathTask

        return MathTask(config)
    if isinstance(config, PokerTaskConfig):
        from echo2.tasks.poker import PokerTask

        return PokerTask(config)
    raise ValueError(f"no task for config {type(config).__name__}")


__all__ = ["Episode", "ForgedEpisode", "Problem", "Sample", "Sampler", "Task", "UnknownProblem", "make_task",
           "pass_at_k", "prompt_token_ids"]
