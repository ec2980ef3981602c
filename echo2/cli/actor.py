"""``echo2 actor``: one rollout actor, started by the fleet. Imports no Prefect, flows or learner (an actor's
machine may not have them: ``pip install echo2[actor]``)."""

from __future__ import annotations

import logging
from typing import Optional

import typer

from echo2.cli.common import quiet_transformers, store_options_from_env


def actor(
    run: str = typer.Option(..., "--run", help="Run root: STORE/runs/ID."),
    actor_id: str = typer.Option(..., "--actor-id", help="Unique id of this actor (names its rollout files)."),
    parent_pid: Optional[int] = typer.Option(None, "--parent-pid", help="Exit when this process is gone."),
) -> None:
    """Run one rollout actor until the run ends or it is told to stop (started by the fleet)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("echo2").setLevel(logging.INFO)
    quiet_transformers()
    from echo2.rollout.actor import run_actor

    run_actor(run, actor_id, store_options_from_env(), parent_pid=parent_pid)
