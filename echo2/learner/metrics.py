"""Per-step metrics and sample completions, fanned out to the experiment trackers the ``logging`` section names
(``learner/tracking/``: TensorBoard, Weights & Biases, MLflow), and a completions table every
``logging.completions_every`` steps, also written to ``reports/completions/`` in the run folder."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from echo2.config import LoggingConfig
from echo2.data.store import ObjectStore
from echo2.learner.tracking import TrackerRun, make_trackers
from echo2.learner.tracking.completions import completion_rows, write_completions

log = logging.getLogger("echo2.learner")

_SCALARS = ("reward", "loss", "lag_mean", "lag_max", "clip_fraction", "ratio_mean", "kl_behavior", "grad_norm",
            "groups_with_signal", "completion_tokens", "seconds", "wait_seconds", "list_seconds", "dropped_stale",
            "quarantined")
_PUBLISH = ("full_bytes", "bytes", "delta_bytes", "changed_fraction", "encode_seconds", "apply_seconds", "seconds",
            "keyframe")
"""What each publish recorded (``publish_<name>`` in the step's metrics; ``learner/publisher.py``), as
``publish/<name>``."""


class MetricsSink:
    def __init__(self, local_dir: Path, run_id: str, config: dict, *, settings: LoggingConfig | None = None,
                 store: ObjectStore | None = None):
        """``config``: the resolved run config (``run.json``'s); ``settings``: its ``logging`` section (read from
        ``config`` when not given); ``store``: the run folder, where completions tables go and where TensorBoard's
        event files are copied unless ``local_dir`` is that folder already (a local store)."""
        self.settings = settings or LoggingConfig.model_validate(config.get("logging") or {})
        self.store = store
        mirror = None if store is None or _same_folder(store, local_dir) else store
        self.trackers = make_trackers(TrackerRun(run_id=run_id, config=config, settings=self.settings,
                                                 local_dir=local_dir, mirror=mirror))
        self.closed = False

    def log(self, step: int, metrics: dict) -> None:
        scalars = {f"train/{k}": float(metrics[k]) for k in _SCALARS if k in metrics}
        scalars.update({f"publish/{k}": float(metrics[f"publish_{k}"]) for k in _PUBLISH if f"publish_{k}" in metrics})
        self._scalars(step, scalars)

    def log_eval(self, label: str, step: int, score: float, metrics: dict[str, float] | None = None) -> None:
        """``score``: the task's headline metric (``eval/accuracy_<label>``, its name since the first task);
        ``metrics``: every number of the evaluation, as ``eval/<name>``."""
        self._scalars(step, {f"eval/accuracy_{label}": score, **{f"eval/{k}": v for k, v in (metrics or {}).items()}})

    def completions_due(self, step: int) -> bool:
        every = self.settings.completions_every
        return every > 0 and step > 0 and step % every == 0

    def log_completions(self, step: int, tables: list[pa.Table], tokenizer: Any) -> list[dict[str, Any]]:
        """On a step ``logging.completions_every`` divides: a few of the completions ``tables`` (the step's rollout
        files) hold, decoded with ``tokenizer``, to every tracker and ``reports/completions/``; returns the rows
        (none on other steps)."""
        if not self.completions_due(step):
            return []
        rows = completion_rows(step, tables, tokenizer, self.settings.completions_rows)
        if not rows:
            return []
        if self.store is not None:
            write_completions(self.store, step, rows)
        for tracker in self.trackers:
            tracker.log_completions(step, rows)
        return rows

    def sync(self) -> None:
        """Copy what trackers keep on this machine into the store (TensorBoard's event files): at each checkpoint."""
        if self.closed:  # closed has synced: a checkpoint after a notice's close has nothing new to copy
            return
        for tracker in self.trackers:
            tracker.sync()

    def close(self) -> None:
        """Sync and end every tracker's run; a second call does nothing (a run left on a notice closes it before
        the flow's own ending does)."""
        if self.closed:
            return
        self.closed = True
        for tracker in self.trackers:
            tracker.close()

    def _scalars(self, step: int, scalars: dict[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log_scalars(step, scalars)


def _same_folder(store: ObjectStore, local_dir: Path) -> bool:
    """Whether ``store`` (a run folder) is ``local_dir`` itself: then the local files are in the store already."""
    url = store.url
    if url.startswith("file://"):
        url = url[len("file://"):]
    elif "://" in url:
        return False
    return Path(url).resolve() == Path(local_dir).resolve()
