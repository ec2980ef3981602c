"""Resolving what a launch means, shared by ``echo2 run`` and the Prefect deployment.

A config file plus ``key=value`` overrides; with ``resume``, the run's own ``run.json`` config
(the run named by ``run.id``, else the newest unfinished run) plus the same overrides. The store
is probed, the model resolved and a resume checked (its key, and no override of a field the
actors read) before anything starts, so bad input fails in one line.
"""

from __future__ import annotations

from pathlib import Path

from echo2.config import Config, config_from_dict, frozen_changes, load_config, overridden_config
from echo2.config.train import upgraded
from echo2.data import layout
from echo2.data.run_folder import check_run_key, find_resumable_run, new_run_id, read_run_record
from echo2.data.run_key import MissingRunKey, run_key
from echo2.data.store import StoreError
from echo2.data.store.fsspec_store import FsspecStore
from echo2.errors import Echo2InputError, StoreUnreachable
from echo2.models import hub_commit, is_commit, resolve_model
from echo2.tasks import check_machine, check_task_code


def resolve_launch(config_path: str | Path, overrides: list[str], resume: bool, *, dry_run: bool = False) -> Config:
    """The config a launch runs with; ``dry_run`` checks the model is there without converting it."""
    config = load_config(config_path, overrides)
    try:
        store = FsspecStore(config.store.url, config.store.options)
        store.check()
    except StoreError as exc:
        raise StoreUnreachable(str(exc)) from None
    if resume:
        config = resume_config(store.child(layout.RUNS), config.run.id, overrides)
    check_devices(config)
    check_user_code(config)
    if not dry_run:
        check_machine(config.task)  # a task's own needs (the code task's sandbox): one line, before anything starts
    # fail before starting anything; converts the default once
    model_dir = resolve_model(config.model.name, revision=config.model.revision, convert=not dry_run)
    commit = hub_commit(model_dir)
    if commit is not None:  # the run's every load of the model, on every rank and every resume, reads this commit
        config.model.revision = commit
    if config.run.id is None:
        config.run.id = new_run_id(config.run.name)
    return config


def check_devices(config: Config) -> None:
    """The learner's device (and backend), and a local actor's engine device, exist on this machine: one line
    (``Echo2InputError``) before anything starts, not a traceback from inside the flow."""
    from echo2.config import TransformersEngineConfig
    from echo2.devices import resolve_device
    from echo2.learner.process_group import backend_for

    device = resolve_device(config.learner.device, what="learner.device")
    if config.learner.nproc * config.learner.nnodes > 1:
        backend_for(device, config.learner.dist_backend)
    engine = config.rollout.engine
    if config.fleet.backend == "local" and isinstance(engine, TransformersEngineConfig):
        resolve_device(getattr(engine, "device", "auto"), what="rollout.engine.device")


def check_user_code(config: Config) -> None:
    """A ``plugin`` or ``reward_fn`` task imports here (the learner's interpreter) and its config validates, and
    local actors, which echo2 installs nothing for, can import it and have ``fleet.extra_packages``: one line
    (``Echo2InputError``) before anything starts. SkyPilot actors install the packages in their setup."""
    from echo2.config import LocalFleetConfig
    from echo2.fleet.extra_packages import check_local_actors

    modules = check_task_code(config.task)
    if isinstance(config.fleet, LocalFleetConfig) and (modules or config.fleet.extra_packages):
        check_local_actors(config.fleet.extra_packages, modules, config.fleet.actor_python)


def run_exists(config_path: str | Path, overrides: list[str]) -> bool:
    """Whether the run the config names already has its ``run.json`` in the store: ``--start-or-resume``, the one
    command of a relaunched learner (a SkyPilot managed job's every start creates the run first, then resumes it)."""
    config = load_config(config_path, overrides)
    if config.run.id is None:
        raise Echo2InputError("--start-or-resume needs the run's id fixed (--set run.id=ID): every start must name "
                              "the same run")
    try:
        store = FsspecStore(config.store.url, config.store.options)
        store.check()
        return store.child(layout.RUNS).child(config.run.id).exists(layout.RUN_JSON)
    except StoreError as exc:
        raise StoreUnreachable(str(exc)) from None


def resume_config(runs, run_id: str | None, overrides: list[str]) -> Config:
    """The config of the run to resume with ``overrides`` applied; refuses what would split learner and actors."""
    run_id = run_id or find_resumable_run(runs)
    record = read_run_record(runs, run_id)
    try:
        key = run_key(run_id)
    except MissingRunKey:
        key = None
    check_run_key(record, key)  # first: run.json is the one the run's learner signed, before its config is read
    source = f"{runs.url}/{run_id}/{layout.RUN_JSON}"
    data = upgraded(record["config"])  # a run created before train's split reads as written now
    original = config_from_dict(data, source)
    config = overridden_config(data, overrides, source)  # ECHO2_SET__ variables too, as a new run
    if config.model.revision != original.model.revision and is_commit(original.model.revision):
        # the run resolved its revision to this commit when it was created; an unchanged launch command (a learner
        # job's every start) still names the branch or tag, and the run keeps the commit it began with
        config.model.revision = original.model.revision
    changed = frozen_changes(original, config)
    if changed:
        raise Echo2InputError(f"--resume cannot change {', '.join(changed)}: the run's actors read it from "
                              f"run.json, which is written once; start a new run instead")
    return config
