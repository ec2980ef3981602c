"""How a run reports progress: a rich progress bar in a terminal, log lines elsewhere.

The flow calls the current reporter; the CLI installs a ``RichReporter`` before it runs the flow.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("echo2")


class Reporter:
    """Log-line reporter (the default, e.g. under a Prefect worker)."""

    def start(self, run_id: str, max_steps: int, first_step: int) -> None:
        log.info("run %s: training to step %d", run_id, max_steps)

    def eval(self, label: str, result: dict) -> None:
        pass  # the learner logs every evaluation itself

    def step(self, metrics: dict, fleet: dict) -> None:
        log.info("step %d: reward %.3f, lag mean %.2f max %d, %d rollouts, %.1fs", metrics["step"], metrics["reward"],
                 metrics["lag_mean"], metrics["lag_max"], metrics["rollouts"], metrics["seconds"])

    def stop(self) -> None:
        pass


class RichReporter(Reporter):
    def __init__(self, console=None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"), console=self.console, transient=False,
        )
        self.task_id = None
        self._last = time.time()

    def start(self, run_id: str, max_steps: int, first_step: int) -> None:
        self.progress.start()
        self.task_id = self.progress.add_task(run_id, total=max_steps, completed=first_step, status="waiting for rollouts")
        self._last = time.time()

    def eval(self, label: str, result: dict) -> None:
        self.console.print(f"eval {label}: greedy accuracy [bold]{result['accuracy']:.3f}[/] on {result['n']} held-out problems")

    def step(self, metrics: dict, fleet: dict) -> None:
        now = time.time()
        tok_s = metrics["completion_tokens"] / max(now - self._last, 1e-9)
        self._last = now
        status = (f"reward {metrics['reward']:.2f} | lag {metrics['lag_mean']:.1f} (max {metrics['lag_max']}) | "
                  f"{tok_s:.0f} tok/s | actors {fleet.get('actors_alive', '?')}")
        self.progress.update(self.task_id, completed=metrics["step"], status=status)

    def stop(self) -> None:
        if self.task_id is not None:
            self.progress.stop()


_current: Reporter = Reporter()


def set_reporter(reporter: Reporter) -> None:
    global _current
    _current = reporter


def reporter() -> Reporter:
    return _current
