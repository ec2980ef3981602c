"""Tasks: prompts, episodes, verifiable rewards and held-out sets. One task per file, chosen by config
(``task.name``); this factory is the only place that maps a config to its task."""

from __future__ import annotations

from echo2.config import (
    ArithmeticTaskConfig,
    CodeTaskConfig,
    MathTaskConfig,
    PluginTaskConfig,
    PokerTaskConfig,
    RewardFnTaskConfig,
    TaskConfig,
)
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
    if isinstance(config, PluginTaskConfig):
        from echo2.tasks.plugins import make_plugin_task

        return make_plugin_task(config)
    if isinstance(config, RewardFnTaskConfig):
        from echo2.tasks.reward_fn import RewardFnTask

        return RewardFnTask(config)
    raise ValueError(f"no task for config {type(config).__name__}")


def check_task_code(config: TaskConfig) -> list[str]:
    """A user's own task or reward function (``plugin``, ``reward_fn``) imports here and its config validates:
    one line (``Echo2InputError``) where not, checked before a run starts anything. Returns the modules the
    actors must be able to import too (none for a built-in task)."""
    if isinstance(config, (PluginTaskConfig, RewardFnTaskConfig)):
        from echo2.tasks.plugins import check_task_plugin

        return check_task_plugin(config)
    return []


def check_machine(config: TaskConfig) -> None:
    """What the task needs of this machine, checked before a run starts anything: one line
    (``Echo2InputError``) where it is missing. The code task runs a program in its sandbox."""
    if isinstance(config, CodeTaskConfig):
        from echo2.tasks.sandbox import Limits, Sandbox

        sandbox = Sandbox(Limits(), mode=config.sandbox, parallelism=1)
        try:
            sandbox.verify_runs_here()
        finally:
            sandbox.close()


__all__ = ["Episode", "ForgedEpisode", "Problem", "Sample", "Sampler", "Task", "UnknownProblem", "check_machine",
           "check_task_code", "make_task", "pass_at_k", "prompt_token_ids"]
