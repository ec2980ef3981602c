"""``echo2 report`` and ``echo2 audit``: what a run's ledger says, after the run (finished or crashed)."""

from __future__ import annotations

import json

import typer

from echo2.cli.common import fail, need_learner_extra, store_options_from_env


def _open_run(run: str):
    """The store of a run folder (path or URL), or one line and exit 2 when there is no run there."""
    from echo2.data import layout
    from echo2.data.store import StoreError, open_store

    try:
        store = open_store(run, store_options_from_env())
        if not store.exists(layout.RUN_JSON):
            fail(f"{run} is not a run folder (no {layout.RUN_JSON})")
    except StoreError as exc:
        fail(str(exc))
    return store


def report_costs(
    run: str = typer.Argument(..., help="Run folder (path or URL of STORE/runs/ID), finished or crashed."),
) -> None:
    """Recompute the cost report from the run's ledger: reports/cost.json, cost.md, cost.png."""
    need_learner_extra("echo2 report")
    from echo2.fleet.bill.render import cost_markdown
    from echo2.fleet.bill.report import write_cost_reports

    report = write_cost_reports(_open_run(run))
    typer.echo(cost_markdown(report), nl=False)
    typer.echo(f"wrote reports/cost.json, reports/cost.md, reports/cost.png under {run}", err=True)


def audit(
    run: str = typer.Argument(..., help="Run folder (path or URL of STORE/runs/ID)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Account for every committed rollout file from the ledger; exit 1 if one is lost or used twice."""
    from echo2.data.audit import audit_failed, audit_run

    result = audit_run(_open_run(run))
    if as_json:
        typer.echo(json.dumps(result, indent=1))
    else:
        dropped = ", ".join(f"{n} {reason}" for reason, n in result["dropped"].items()) or "none"
        state = "finished" if result["finished"] else "unfinished"
        typer.echo(f"{result['committed']} committed rollout files ({state}"
                   f" run): {result['used']} used, dropped {dropped}, {result['quarantined']} quarantined, "
                   f"{result['pending']} pending, {result['lost']} lost, {result['used_twice']} used twice")
        typer.echo(f"fleet: {result['reclaims']} reclaims, {result['crashes']} crashes, "
                   f"{result['replacements']} replaced" + (f"; not replaced: {', '.join(result['unreplaced'])}"
                                                           if result["unreplaced"] else ""))
        for problem in result["problems"]:
            typer.echo(f"problem: {problem}")
    if audit_failed(result):
        raise typer.Exit(1)
