"""TensorBoard: event files under the run's local folder (``tensorboard/``), torch's ``SummaryWriter``.

With a remote store the local folder is ``./echo2-logs/<run>/`` on the learner's machine, which a spot learner loses
with the machine: ``sync`` (each checkpoint, and ``close``) copies every event file that changed since the last sync
to ``tensorboard/`` in the run folder of the store, whole (an event file only grows, and one of scalars stays
small). A resumed learner writes a new event file beside the old ones; TensorBoard reads them all as one run.
"""

from __future__ import annotations

from typing import Any

from echo2.data import layout
from echo2.learner.tracking.base import Tracker, TrackerRun
from echo2.learner.tracking.completions import markdown_table


class TensorBoardTracker(Tracker):
    def __init__(self, run: TrackerRun):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = run.local_dir / layout.TENSORBOARD
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.mirror = run.mirror
        self._copied: dict[str, tuple[int, int]] = {}
        """Each event file's (size, mtime) when it was last copied to the store."""

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("completions", markdown_table(rows), step)
        self.writer.flush()

    def sync(self) -> None:
        self.writer.flush()
        if self.mirror is None or not self.dir.is_dir():
            return
        for path in sorted(p for p in self.dir.rglob("*") if p.is_file()):
            name = path.relative_to(self.dir).as_posix()
            stat = path.stat()
            if self._copied.get(name) == (stat.st_size, stat.st_mtime_ns):
                continue
            self.mirror.put(layout.tensorboard_key(name), path.read_bytes(), if_absent=False)
            self._copied[name] = (stat.st_size, stat.st_mtime_ns)

    def close(self) -> None:
        self.writer.close()
        self.sync()
