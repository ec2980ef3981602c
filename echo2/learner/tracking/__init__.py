"""Experiment trackers: where the learner's per-step numbers and completions tables go (the ``logging`` section,
``LoggingConfig``). The interface is ``base.py``; one implementation per file, each importing its library only
when the config names it; ``make_trackers`` is the only place that maps a backend's name to its implementation.

    base         Tracker (log scalars at a step, log a completions table, sync, close) and TrackerRun
    completions  a step's completions table: rows of its rollout files, decoded; its JSONL in ``reports/``
    tensorboard  event files in the run's local folder, copied into the store at each checkpoint and the end
    wandb        Weights & Biases: one W&B run per echo2 run (id = run id, resumed on ``--resume``)
    mlflow       MLflow: an experiment per project, one run per echo2 run found again by tag

``learner/metrics.py`` (``MetricsSink``) fans the learner's numbers out to the trackers built here.
"""

from __future__ import annotations

import importlib.util

from echo2.config import LoggingConfig
from echo2.errors import Echo2InputError
from echo2.learner.tracking.base import COMPLETION_COLUMNS, Tracker, TrackerRun

_LIBRARY = {"tensorboard": ("tensorboard", "learner"), "wandb": ("wandb", "tracking"),
            "mlflow": ("mlflow", "tracking")}
"""backend -> (the module it imports, the pip extra of echo2 that installs it)."""


def check_installed(settings: LoggingConfig) -> None:
    """One ``Echo2InputError`` line for the first backend named whose library is not installed: the run stops
    before it creates or changes anything, rather than at its first step."""
    for name in settings.backends:
        module, extra = _LIBRARY[name]
        if importlib.util.find_spec(module) is None:
            raise Echo2InputError(f"logging.backends names {name}, but {module} is not installed here: "
                                  f"pip install 'echo2[{extra}]' (or leave {name} out of logging.backends)")


def make_trackers(run: TrackerRun) -> list[Tracker]:
    """The trackers ``run.settings.backends`` names, in that order (libraries imported here, when named)."""
    check_installed(run.settings)
    trackers: list[Tracker] = []
    try:
        for name in run.settings.backends:
            trackers.append(_make(name, run))
    except BaseException:  # the ones already open are not left half-written (a W&B run, a writer's thread)
        for tracker in trackers:
            tracker.close()
        raise
    return trackers


def _make(name: str, run: TrackerRun) -> Tracker:
    if name == "tensorboard":
        from echo2.learner.tracking.tensorboard import TensorBoardTracker

        return TensorBoardTracker(run)
    if name == "wandb":
        from echo2.learner.tracking.wandb import WandbTracker

        return WandbTracker(run)
    if name == "mlflow":
        from echo2.learner.tracking.mlflow import MlflowTracker

        return MlflowTracker(run)
    raise ValueError(f"no tracker for backend {name!r}")  # LoggingConfig refuses any other name


__all__ = ["COMPLETION_COLUMNS", "Tracker", "TrackerRun", "check_installed", "make_trackers"]
