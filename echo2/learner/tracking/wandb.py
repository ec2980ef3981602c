"""Weights & Biases: one W&B run per echo2 run, its id the run id (``resume="allow"``: a resumed learner, on any
machine, continues it), its config the resolved run config. Tables are ``wandb.Table``. ``WANDB_MODE=offline``
writes the run under ``$WANDB_DIR`` for a later ``wandb sync``; credentials come from ``wandb login`` or
``$WANDB_API_KEY``, never from the config."""

from __future__ import annotations

from typing import Any

from echo2.learner.tracking.base import COMPLETION_COLUMNS, Tracker, TrackerRun


class WandbTracker(Tracker):
    def __init__(self, run: TrackerRun):
        import wandb

        s = run.settings
        self._wandb = wandb
        self.run = wandb.init(project=s.project, entity=s.entity, group=s.group, tags=list(s.tags) or None,
                              name=s.run_name or run.run_id, id=run.run_id, resume="allow", config=run.config)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self._wandb.Table(columns=list(COMPLETION_COLUMNS),
                                  data=[[row[c] for c in COMPLETION_COLUMNS] for row in rows])
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()
