"""The learner as a SkyPilot managed job on spot machines (issue 23, item 2): ``echo2 fleet learner-job``.

Model. SkyPilot's jobs controller runs the job's task on a spot cluster and, when the cluster is reclaimed or the job
exits with a code its ``job_recovery.recover_on_exit_codes`` names, launches it again on another cluster (the next
region first: ``EAGER_NEXT_REGION``; any of the task's clouds and GPUs). The task's command is the same at every start
(``echo2 learner --start-or-resume`` with ``run.id`` fixed here, at launch): the first start creates the run, every
later one resumes it from its newest checkpoint and adopts the actors that kept running. A learner that hears a notice
checkpoints and exits ``notice.RECLAIMED_EXIT`` (75), the code the shipped task file recovers on
(``infra/skypilot/learner-spot.yaml``), so a notice that comes before the machine goes is a recovery too.

Assumptions: the run's store is reachable from the cloud (an ``s3://``/``gs://`` URL, not a local folder); the run's
signing key is this machine's (``$ECHO2_RUN_KEY`` or the secrets file, made here for a new run) and travels as the
SkyPilot secret ``ECHO2_RUN_KEY``, which SkyPilot's API server and jobs controller keep (they relaunch with it):
run them where the key may be. The launch itself is one request to SkyPilot's API server (``SkyJobs``); the tests put
a test double in its place (no cloud is reachable from here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from echo2 import shipped
from echo2.data.run_key import KEY_ENV, run_key
from echo2.errors import Echo2InputError

DEFAULT_LEARNER_JOB_FILE = shipped.path("skypilot", "learner-spot.yaml")
RECLAIMED_EXIT = 75
"""``echo2.learner.notice.RECLAIMED_EXIT`` (not imported: this module must load without the learner's packages)."""
SPOT_SETTINGS = ("train.market=spot",)
"""What every start of the job trains with, whatever the config says: a notice is a spot learner's."""


class LearnerJobApi(Protocol):
    """The call that reaches SkyPilot's API server."""

    def launch(self, task: Any, name: str) -> int | None:
        """Submit ``task`` as a managed job named ``name``; its job id (None if SkyPilot gives none)."""


class SkyJobs:
    """``LearnerJobApi`` through SkyPilot's client SDK (``sky.jobs.launch``)."""

    def __init__(self):
        from echo2.fleet.backends.skypilot_api import import_sky

        self.sky = import_sky()

    def launch(self, task: Any, name: str) -> int | None:
        from sky import jobs

        job_ids, _handle = self.sky.get(jobs.launch(task, name=name))
        return job_ids[0] if job_ids else None


@dataclass(frozen=True)
class LearnerJob:
    """What was launched: the job, the run it trains and where."""

    name: str
    job_id: int | None
    run_id: str
    store_url: str
    created_key: bool
    """A new signing key was made for the run here (kept in the secrets folder)."""

    def as_dict(self) -> dict:
        return {"name": self.name, "job_id": self.job_id, "run_id": self.run_id, "store_url": self.store_url,
                "created_key": self.created_key}


def job_name(run_id: str) -> str:
    return f"echo2-learner-{run_id}"[:63]


def _task_config(task_file: Path | None) -> dict:
    from echo2.fleet.prices.catalog import read_yaml

    config = read_yaml(Path(task_file) if task_file else DEFAULT_LEARNER_JOB_FILE, "learner job file")
    if not isinstance(config, dict) or not isinstance(config.get("run"), str):
        raise Echo2InputError(f"learner job file {task_file or DEFAULT_LEARNER_JOB_FILE}: a SkyPilot task with a "
                              "`run` command is needed")
    return config


def _check_recovery(config: dict, where: str) -> None:
    """A task that would not be relaunched after the learner's notice exit is refused (one line)."""
    resources = config.get("resources") or {}
    recovery = resources.get("job_recovery") or {}
    codes = recovery.get("recover_on_exit_codes") if isinstance(recovery, dict) else None
    codes = [codes] if isinstance(codes, int) else list(codes or [])
    if RECLAIMED_EXIT not in codes:
        raise Echo2InputError(f"{where}: resources.job_recovery.recover_on_exit_codes must name {RECLAIMED_EXIT}, the "
                              "exit of a learner that left on a spot notice, or SkyPilot would not relaunch it")


def build_learner_task(config_path: str, settings: list[str], *, run_id: str, key_hex: str, workdir: Path,
                       task_config: dict):
    """The managed job's ``sky.Task``: the task file with the run id, the config and its settings as envs, the run's
    key as a secret, and ``workdir`` (the checkout whose ``configs/`` and code the learner runs)."""
    from echo2.fleet.backends.skypilot_api import import_sky

    sky = import_sky()
    base = dict(task_config)
    base["workdir"] = str(workdir)
    envs = {"ECHO2_CONFIG": config_path, "ECHO2_RUN_ID": run_id,
            "ECHO2_SETTINGS": " ".join([*settings, *SPOT_SETTINGS])}
    return sky.Task.from_yaml_config(base, env_overrides=list(envs.items()), secrets_overrides=[(KEY_ENV, key_hex)])


def launch_learner_job(config_path: str, settings: list[str], *, run_id: str | None = None,
                       task_file: Path | None = None, workdir: Path = Path("."),
                       api: LearnerJobApi | None = None) -> LearnerJob:
    """Fix the run id, find or make the run's key, build the task and launch it as a managed job."""
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    from echo2.config import load_config
    from echo2.data.run_folder import new_run_id
    from echo2.data.run_key import key_path

    bad = [s for s in settings if " " in s or "=" not in s]
    if bad:
        raise Echo2InputError(f"--set {bad[0]!r}: one key=value without spaces (the job passes settings in one env)")
    workdir = workdir.resolve()
    path = Path(config_path)
    try:  # the job runs the config from its copy of the workdir: a path inside it
        relative = (path.resolve() if path.is_absolute() else (workdir / path).resolve()).relative_to(workdir)
    except ValueError:
        raise Echo2InputError(f"{config_path} is not inside the workdir {workdir}: the job runs it from "
                              "there") from None
    config = load_config(workdir / relative, [*settings, *SPOT_SETTINGS])
    run_id = run_id or config.run.id or new_run_id(config.run.name)
    if "://" not in config.store.url or config.store.url.startswith("file://"):
        raise Echo2InputError(f"store.url {config.store.url!r} is a folder of this machine: a learner relaunched on "
                              "another machine cannot reach it (use s3:// or gs://)")
    task_config = _task_config(task_file)
    _check_recovery(task_config, str(task_file or DEFAULT_LEARNER_JOB_FILE))
    created = not os.environ.get(KEY_ENV) and not key_path(run_id).exists()
    key = run_key(run_id, create=True)  # the same key at every start: actors verify versions with its public half
    key_hex = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()).hex()
    settings = [s for s in settings if not s.startswith("run.id=")]
    task = build_learner_task(str(relative), settings, run_id=run_id, key_hex=key_hex, workdir=workdir,
                              task_config=task_config)
    name = job_name(run_id)
    job_id = (api or SkyJobs()).launch(task, name)
    return LearnerJob(name, job_id, run_id, config.store.url, created)
