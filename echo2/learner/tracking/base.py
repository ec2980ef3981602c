"""What every experiment tracker does (``Tracker``), and what it is told about the run (``TrackerRun``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2.config import LoggingConfig
from echo2.data.store.base import ObjectStore

COMPLETION_COLUMNS = ("step", "actor_id", "version", "reward", "finish_reason", "prompt", "completion")
"""The columns of a completions table, in order: every tracker's table and each ``reports/completions/`` line."""


@dataclass(frozen=True)
class TrackerRun:
    """The run a tracker records: its id, its resolved config (the ``run.json`` dict), the ``logging`` section, the
    learner's local folder of the run, and ``mirror``: the run's store where what a tracker keeps in that folder
    must be copied to outlive the machine (None where the local folder is the run folder, a local store)."""

    run_id: str
    config: dict[str, Any]
    settings: LoggingConfig
    local_dir: Path
    mirror: ObjectStore | None = None


class Tracker(ABC):
    """One backend of ``logging.backends``: built once per learner incarnation, on rank 0 only."""

    @abstractmethod
    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Numbers of ``step`` by name (``train/reward``, ``publish/bytes``, ``eval/accuracy_after`` ...)."""

    @abstractmethod
    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A table of decoded completions the step trained on, each row keyed by ``COMPLETION_COLUMNS``."""

    def sync(self) -> None:
        """Copy what the tracker keeps on the learner's disk to the run's store (at each checkpoint): a spot
        learner's machine goes, the store stays. Nothing, for a tracker that keeps nothing locally."""

    @abstractmethod
    def close(self) -> None:
        """Flush, sync and end the tracker's run (a resumed learner continues it)."""
