"""Tasks: prompts, verifiable rewards and held-out sets. One task per file, chosen by config."""

from __future__ import annotations

from echo2.config import TaskConfig
from echo2.tasks.base import Problem, Task, UnknownProblem, prompt_token_ids


def make_task(config: TaskConfig) -> Task:
    if config.name == "arithmetic":
        from echo2.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(digits=config.digits, eval_size=config.eval_size)
    raise ValueError(f"unknown task {config.name!r}")


__all__ = ["Problem", "Task", "UnknownProblem", "make_task", "prompt_token_ids"]
