"""Tasks: prompts, episodes, verifiable rewards and held-out sets. One task per file, chosen by config
(``task.name``); this factory is the only place that maps a config to its task."""

from __future__ import annotations

from echo2.config import ArithmeticTaskConfig, CodeTaskConfig, MathTaskConfig, PokerTaskConfig, TaskConfig
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
    if isinstance(config, CodeTaskConfig):
        from echo2.tasks.code import CodeTask

        return CodeTask(config)
    raise ValueError(f"no task for config {type(config).__name__}")


def check_machine(config: TaskConfig) -> None:
    """What the task needs of this machine, checked before a run starts anything: one line
    (``Echo2InputError``) where it is missing. The code task runs a program in its sandbox."""
    if isinstance(config, CodeTaskConfig):
        from echo2.tasks.sandbox import Limits, Sandbox

        sandbox = Sandbox(Limits(), mode=config.sandbox, parallelism=1)
        try:
            sandbox.check()
        finally:
            sandbox.close()


__all__ = ["Episode", "ForgedEpisode", "Problem", "Sample", "Sampler", "Task", "UnknownProblem", "check_machine",
           "make_task", "pass_at_k", "prompt_token_ids"]
