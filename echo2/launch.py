"""Resolving what a launch means, shared by ``echo2 run`` and the Prefect deployment.

A config file plus ``key=value`` overrides; with ``resume``, the run's own ``run.json`` config
(the run named by ``run.id``, else the newest unfinished run) plus the same overrides. The store
is probed and the model resolved before anything starts, so bad input fails in one line.
"""

from __future__ import annotations

from pathlib import Path

from echo2.config import Config, apply_overrides, config_from_dict, load_config
from echo2.data.fsspec_store import FsspecStore
from echo2.data.store import NotFound, StoreError
from echo2.errors import Echo2InputError, StoreUnreachable
from echo2.models import resolve_model


def resolve_launch(config_path: str | Path, overrides: list[str], resume: bool) -> Config:
    from echo2.learner.run import find_resumable_run, new_run_id

    config = load_config(config_path, overrides)
    try:
        store = FsspecStore(config.store.url, config.store.options)
        store.check()
    except StoreError as exc:
        raise StoreUnreachable(str(exc)) from None
    if resume:
        runs = store.child("runs")
        run_id = config.run.id or find_resumable_run(runs)
        try:
            data = runs.child(run_id).get_json("run.json")["config"]
        except NotFound:
            raise Echo2InputError(f"--resume: no run {run_id} under {runs.url}") from None
        config = config_from_dict(apply_overrides(data, overrides), f"{runs.url}/{run_id}/run.json")
    resolve_model(config.model.name)  # fail before starting anything; converts the default once
    if config.run.id is None:
        config.run.id = new_run_id(config.run.name)
    return config
