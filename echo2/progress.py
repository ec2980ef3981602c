"""How a run reports progress: a rich progress bar in a terminal, plain lines when the output
is a file or a pipe, log lines elsewhere.

The flow calls the current reporter; the CLI installs the one ``make_reporter`` picks before it
runs the flow. The plain lines (stdout, flushed, one per event) are a stable, greppable format:

    run <run_id>: training to step <max_steps> (from step <first_step>)
    eval <label>: <metric> <score %.3f> on <n> held-out problems [, illegal_action_rate <%.3f>]
    step <step>/<max_steps>: reward <%.3f>, lag <mean %.1f> (max <int>), <n> completions, <seconds %.1f>s
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("echo2")


class Reporter:
    """Log-line reporter (the default, e.g. under a Prefect worker)."""

    def start(self, run_id: str, max_steps: int, first_step: int) -> None:
        log.info("run %s: training to step %d", run_id, max_steps)

    def eval(self, label: str, result: dict) -> None:
        pass  # the learner logs every evaluation itself

    def step(self, metrics: dict, fleet: dict) -> None:
        log.info("step %d: reward %.3f, lag mean %.2f max %d, %d completions, %.1fs", metrics["step"],
                 metrics["reward"], metrics["lag_mean"], metrics["lag_max"], metrics["rollouts"], metrics["seconds"])

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
        self.task_id = self.progress.add_task(run_id, total=max_steps, completed=first_step,
                                              status="waiting for rollouts")
        self._last = time.time()

    def eval(self, label: str, result: dict) -> None:
        self.console.print(f"eval {label}: {eval_line(result, bold=True)}")

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


class PlainReporter(Reporter):
    """One plain, flushed line per event on ``stream`` (stdout by default): for ``make run > file``,
    ``nohup`` and pipes, where a live progress bar would print nothing until the end."""

    def __init__(self, stream: TextIO | None = None):
        self._stream = stream
        self.max_steps: int | None = None

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout  # resolved late: capsys, redirects

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def start(self, run_id: str, max_steps: int, first_step: int) -> None:
        self.max_steps = max_steps
        self._print(f"run {run_id}: training to step {max_steps} (from step {first_step})")

    def eval(self, label: str, result: dict) -> None:
        self._print(f"eval {label}: {eval_line(result)}")

    def step(self, metrics: dict, fleet: dict) -> None:
        self._print(format_step(metrics, self.max_steps))


def format_step(metrics: dict, max_steps: int | None) -> str:
    """``step 3/16: reward 0.412, lag 1.0 (max 2), 8 completions, 21.3s`` (``step 3/?`` if max is unknown).

    ``metrics["rollouts"]`` counts the step's rows, i.e. completions (the summary's
    ``completions_used``), not rollout files (its ``rollouts_used``)."""
    total = "?" if max_steps is None else max_steps
    return (f"step {metrics['step']}/{total}: reward {metrics['reward']:.3f}, lag {metrics['lag_mean']:.1f} "
            f"(max {int(metrics['lag_max'])}), {metrics['rollouts']} completions, {metrics['seconds']:.1f}s")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def make_reporter(stream: TextIO | None = None, bar_stream: TextIO | None = None) -> Reporter:
    """The live rich bar (drawn on ``bar_stream``, stderr) when both ``stream`` (stdout) and
    ``bar_stream`` are terminals; otherwise plain lines on ``stream``."""
    out = sys.stdout if stream is None else stream
    bar_stream = sys.stderr if bar_stream is None else bar_stream
    if _isatty(out) and _isatty(bar_stream):
        from rich.console import Console

        return RichReporter(Console(file=bar_stream))
    # no stream given: PlainReporter finds sys.stdout at each line, since the reporter (a global) can outlive
    # the stdout it was made under: `echo2 run` called in-process (typer's CliRunner) closes its own on return
    return PlainReporter(stream)


_current: Reporter = Reporter()


def set_reporter(reporter: Reporter) -> None:
    global _current
    _current = reporter


def reporter() -> Reporter:
    return _current


def eval_line(result: dict, *, bold: bool = False) -> str:
    """One evaluation as a line: its headline metric, the held-out size, and the illegal-action rate of
    tasks that have one."""
    name = result.get("metric", "accuracy")
    label = "greedy accuracy" if name == "accuracy" else name
    value = f"{result.get('score', result.get('accuracy')):.3f}"
    line = f"{label} {'[bold]' + value + '[/]' if bold else value} on {result['n']} held-out problems"
    if "illegal_action_rate" in result:
        line += f", illegal_action_rate {result['illegal_action_rate']:.3f}"
    return line
