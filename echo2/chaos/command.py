"""``echo2 chaos`` (registered on the CLI in ``echo2/cli.py``): the chaos suite, ``runner.py``."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import List, Optional

import typer


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _stop_on_sigterm() -> list[int]:
    """SIGTERM stops the suite as Ctrl-C does (its default action would end this process alone and leave
    the scenarios' runs, in sessions of their own, running); returns a list holding the stopping signal."""
    stopped_by = [int(signal.SIGINT)]

    def interrupt(signum, frame):
        stopped_by[0] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    return stopped_by


def chaos(
    scenario: Optional[List[str]] = typer.Option(None, "--scenario", help="Run only this scenario (repeatable)."),
    quick: bool = typer.Option(False, "--quick", help="The small sizes (what make test runs of some)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per scenario."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Keep the scenarios' runs and logs in this folder."),
    jobs: int = typer.Option(2, "--jobs", help="Scenarios run at a time (the load scenario always runs alone)."),
) -> None:
    """Reclaims, learner kills, hostile peers and files, store faults, liars: real runs; exit 1 on any loss."""
    import importlib.util

    missing = [m for m in ("moto", "prefect") if importlib.util.find_spec(m) is None]
    if missing:
        _fail(f"echo2 chaos needs the dev and learner extras ({', '.join(missing)} not installed): "
              "pip install -e '.[learner,dev]'")
    from echo2.chaos.runner import as_json as to_json, failed, print_table, run_scenarios

    stopped_by = _stop_on_sigterm()
    try:
        rows = run_scenarios(scenario, quick=quick, keep=keep, jobs=jobs, progress=lambda line: typer.echo(line, err=True))
    except ValueError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:  # the suite has stopped every process its scenarios started
        typer.echo("interrupted: every scenario's processes were stopped", err=True)
        raise typer.Exit(128 + stopped_by[0]) from None
    typer.echo(to_json(rows)) if as_json else print_table(rows)
    if any(failed(r) for r in rows):
        raise typer.Exit(1)


