"""Per-step metrics to the tools users already compare runs with: TensorBoard event files under
the run's local folder (``tensorboard/``), and Weights & Biases when it is installed and
configured (``WANDB_API_KEY`` or ``WANDB_MODE`` set)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from echo2.data import layout

log = logging.getLogger("echo2.learner")

_SCALARS = ("reward", "loss", "lag_mean", "lag_max", "clip_fraction", "ratio_mean", "kl_behavior", "grad_norm",
            "groups_with_signal", "completion_tokens", "seconds", "wait_seconds", "list_seconds", "dropped_stale",
            "quarantined")
_PUBLISH = ("full_bytes", "bytes", "delta_bytes", "changed_fraction", "encode_seconds", "apply_seconds", "seconds",
            "keyframe")
"""What each publish recorded (``publish_<name>`` in the step's metrics; ``learner/publisher.py``), as
``publish/<name>``."""


class MetricsSink:
    def __init__(self, local_dir: Path, run_id: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard_dir = local_dir / layout.TENSORBOARD
        self.writer = SummaryWriter(log_dir=str(self.tensorboard_dir))
        self.wandb = None
        if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
            try:
                import wandb
            except ImportError:
                log.warning("WANDB_* is set but wandb is not installed; metrics go to TensorBoard only")
            else:
                self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "echo2"), name=run_id, id=run_id,
                                        resume="allow", config=config)

    def log(self, step: int, metrics: dict) -> None:
        scalars = {f"train/{k}": float(metrics[k]) for k in _SCALARS if k in metrics}
        scalars.update({f"publish/{k}": float(metrics[f"publish_{k}"]) for k in _PUBLISH if f"publish_{k}" in metrics})
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def log_eval(self, label: str, step: int, score: float, metrics: dict[str, float] | None = None) -> None:
        """``score``: the task's headline metric (TensorBoard ``eval/accuracy_<label>``, its name since
        the first task); ``metrics``: every number of the evaluation, as ``eval/<name>``."""
        scalars = {f"eval/accuracy_{label}": score, **{f"eval/{k}": v for k, v in (metrics or {}).items()}}
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
