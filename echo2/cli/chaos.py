"""``echo2 chaos``: the chaos suite (``echo2/chaos/runner.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from echo2.cli.common import CtrlC, fail


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
        fail(f"echo2 chaos needs the dev and learner extras ({', '.join(missing)} not installed): "
             "pip install -e '.[learner,dev]'")
    from echo2.chaos.runner import as_json as to_json
    from echo2.chaos.runner import failed, print_table, run_scenarios

    # SIGTERM stops the suite as Ctrl-C does: its default action would end this process alone and leave the
    # scenarios' runs, in sessions of their own, running
    CtrlC.install()
    try:
        rows = run_scenarios(scenario, quick=quick, keep=keep, jobs=jobs,
                             progress=lambda line: typer.echo(line, err=True))
    except ValueError as exc:
        fail(str(exc))
    except KeyboardInterrupt:  # the suite has stopped every process its scenarios started
        typer.echo("interrupted: every scenario's processes were stopped", err=True)
        raise typer.Exit(CtrlC.exit_code()) from None
    typer.echo(to_json(rows)) if as_json else print_table(rows)
    if any(failed(r) for r in rows):
        raise typer.Exit(1)
