"""The learner as a SkyPilot managed job on spot machines: ``echo2 fleet learner-job``.

Model. SkyPilot's jobs controller runs the job's task on a spot cluster and, when the cluster is reclaimed or the job
exits with a code its ``job_recovery.recover_on_exit_codes`` names, launches it again on another cluster (the next
region first: ``EAGER_NEXT_REGION``; any of the task's clouds and GPUs). The task's command is the same at every start
(``echo2 learner --start-or-resume`` with ``run.id`` fixed here, at launch): the first start creates the run, every
later one resumes it from its newest checkpoint and adopts the actors that kept running. A learner that hears a notice
checkpoints and exits ``notice.RECLAIMED_EXIT`` (75), the code the shipped task file recovers on
(``infra/skypilot/learner-spot.yaml``), so a notice that comes before the machine goes is a recovery too.

Assumptions: the run's store is reachable from the cloud (an ``s3://``/``gs://`` URL, not a local folder); the run's
signing key is this machine's (``$ECHO2_RUN_KEY`` or the secrets file, made here for a new run). The launch itself is
one request to SkyPilot's API server (``SkyJobs``); the tests put a test double in its place (no cloud is reachable).

Where the run's key travels. SkyPilot keeps every launch request, secrets included, in its API server's request log
in plain text, and its jobs controller keeps the task to relaunch it. So the key does not go into the request when
``$ECHO2_RUN_KEY_SECRET`` (or ``key_secret``) names a secret store entry, ``aws-sm:[REGION/]NAME`` (AWS Secrets
Manager): the launch puts the key there (create-if-absent; an entry holding another key is refused) and the task
carries only the entry's name; at every start the learner's node reads it with its own machine identity
(``fetch-key``, in the task's ``run``) into ``$ECHO2_RUN_KEY`` of the learner's process, and the job runs on that
store's cloud only. Who may read the entry is the entry's resource policy: grant the learner node's role alone
(docs/security.md). Without a secret store the key is a SkyPilot secret as before, and only through an API server on
this machine, which already holds the key: a remote one is refused unless ``$ECHO2_ALLOW_KEY_IN_SKYPILOT`` is ``1``.

What the job uploads: not the folder it was started from (``workdir: .`` would rsync whatever is there: started from
``$HOME`` that is ``~/.aws`` and ``~/.config/echo2/keys``), but a folder staged here as the actors' is
(``stage_learner_source``): echo2's own checkout's project files and its ``echo2/``, ``infra/`` and ``configs/`` files
of known kinds, plus the config file named, from the workdir.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from echo2 import shipped
from echo2.data.run_key import KEY_ENV, run_key
from echo2.errors import Echo2InputError

DEFAULT_LEARNER_JOB_FILE = shipped.path("skypilot", "learner-spot.yaml")
RECLAIMED_EXIT = 75
"""``echo2.learner.notice.RECLAIMED_EXIT`` (not imported: this module must load without the learner's packages)."""
SPOT_SETTINGS = ("learner.market=spot",)
"""What every start of the job trains with, whatever the config says: a notice is a spot learner's."""
KEY_SECRET_ENV = "ECHO2_RUN_KEY_SECRET"
"""The secret store entry the run's key travels through (``aws-sm:[REGION/]NAME``), at launch and on the node."""
ALLOW_KEY_ENV = "ECHO2_ALLOW_KEY_IN_SKYPILOT"
"""``1``: send the key as a SkyPilot secret through an API server on another machine (it keeps it in its log)."""
HF_TOKEN_ENV = "HF_TOKEN"
"""The Hugging Face token (``echo2.models.TOKEN_ENV``): a SkyPilot secret of the task when set here, never a file."""
SOURCE_DIRS = ("echo2", "infra", "configs")
"""The checkout's folders the learner runs from."""
SOURCE_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "requirements-constraints.txt",
                "requirements-sky-constraints.txt")
"""Beside them, what its ``pip install -e .`` and the task's ``setup`` read."""
SOURCE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".csv", ".md", ".txt", ".sh", ".typed")
"""The kinds of file staged from those folders (code, configs, prices, profiles, task files): no keys, no caches."""


class KeySecrets(Protocol):
    """A secret store the run's key travels through (``AwsSecrets``; the tests use a test double)."""

    def put(self, name: str, value: str) -> None:
        """Create the entry ``name`` holding ``value``, or accept it if it holds ``value`` already; Echo2InputError
        where it holds something else."""

    def get(self, name: str) -> str:
        """The value of the entry ``name``."""


class AwsSecrets:
    """``KeySecrets`` over AWS Secrets Manager (boto3, with whatever identity this machine has)."""

    def __init__(self, region: str | None = None):
        import boto3

        self.client = boto3.client("secretsmanager", region_name=region)

    def put(self, name: str, value: str) -> None:
        try:
            self.client.create_secret(Name=name, SecretString=value,
                                      Description="echo2 run signing key (read by the learner's node only)")
        except self.client.exceptions.ResourceExistsException:
            if self.get(name) != value:
                raise Echo2InputError(f"the secret {name} holds another key than this run's: name another entry "
                                      f"in ${KEY_SECRET_ENV}") from None

    def get(self, name: str) -> str:
        return self.client.get_secret_value(SecretId=name)["SecretString"]


def parse_key_secret(spec: str) -> tuple[str, str | None, str]:
    """``aws-sm:[REGION/]NAME`` -> (cloud, region or None, name); one line for anything else. A first part that is
    an AWS region name is the region (``aws-sm:us-east-1/echo2/run-1``); otherwise it is part of the name."""
    kind, _, rest = spec.partition(":")
    first, _, after = rest.partition("/")
    region, name = (first, after) if re.fullmatch(r"[a-z]{2}(-[a-z]+)+-\d+", first) and after else ("", rest)
    if kind != "aws-sm" or not name or not all(c.isalnum() or c in "-_+=.@/" for c in name):
        raise Echo2InputError(f"${KEY_SECRET_ENV}={spec!r}: expected aws-sm:[REGION/]NAME (AWS Secrets Manager; "
                              "the only secret store supported)")
    return "aws", region or None, name


def key_secrets(spec: str) -> KeySecrets:
    _, region, _ = parse_key_secret(spec)
    return AwsSecrets(region)


class LearnerJobApi(Protocol):
    """The call that reaches SkyPilot's API server."""

    def launch(self, task: dict, name: str) -> int | None:
        """Submit ``task`` (``build_learner_task``) as a managed job named ``name``; its job id (None if SkyPilot
        gives none)."""


class SkyJobs:
    """``LearnerJobApi`` through SkyPilot's client SDK (``sky.jobs.launch``), in SkyPilot's own environment
    (``echo2/fleet/backends/sky_bridge.py``)."""

    def __init__(self):
        from echo2.fleet.backends.skypilot_api import sky_python

        sky_python()  # SkyPilot's environment missing is one line now

    def launch(self, task: dict, name: str) -> int | None:
        from echo2.fleet.backends.skypilot_api import bridge

        return bridge("jobs_launch", {"task": task, "name": name})


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


def build_learner_task(config_path: str, settings: list[str], *, run_id: str, key_hex: str | None, workdir: Path,
                       task_config: dict, key_secret: str | None = None) -> dict:
    """The managed job's task, as ``sky_bridge.py`` builds it into ``sky.Task``: the task file with the run id, the
    config and its settings as envs, and ``workdir`` (the staged source the learner runs). The run's key: the name
    of its secret store entry (``key_secret``: an env, the task on that store's cloud only), else the key itself as
    a SkyPilot secret."""
    base = dict(task_config)
    base["workdir"] = str(workdir)
    envs = {"ECHO2_CONFIG": config_path, "ECHO2_RUN_ID": run_id,
            "ECHO2_SETTINGS": " ".join([*settings, *SPOT_SETTINGS])}
    secrets = {}
    if key_secret is not None:
        envs[KEY_SECRET_ENV] = key_secret
        base["resources"] = _on_cloud(base.get("resources") or {}, parse_key_secret(key_secret)[0])
        base["secrets"] = {k: v for k, v in (base.get("secrets") or {}).items() if k != KEY_ENV}
    else:
        secrets = {KEY_ENV: key_hex}
    if os.environ.get(HF_TOKEN_ENV):  # a gated or private model: the learner's nodes download it (actors never do)
        secrets[HF_TOKEN_ENV] = os.environ[HF_TOKEN_ENV]
    return {"config": base, "envs": envs, "secrets": secrets}


def _on_cloud(resources: dict, cloud: str) -> dict:
    """``resources`` with its ``any_of`` cut to ``cloud``: the key's secret store is readable there only."""
    any_of = resources.get("any_of")
    if not any_of:
        return {**resources, "infra": cloud}
    kept = [r for r in any_of if str(r.get("infra", r.get("cloud", ""))).split("/")[0].lower() == cloud]
    if not kept:
        raise Echo2InputError(f"the run's key is kept in a {cloud} secret store, but the learner job file runs on "
                              f"none of {cloud}'s infra: add {cloud} to resources.any_of")
    return {**resources, "any_of": kept}


def stage_learner_source(root: Path, config_relative: Path, workdir: Path) -> Path:
    """A fresh folder holding what the learner's node runs, and nothing else (see the module docstring): the
    checkout ``root``'s ``SOURCE_FILES`` and its ``SOURCE_DIRS`` files of ``SOURCE_SUFFIXES`` (no symlinks, caches or
    hidden files), then the config file from ``workdir``. The caller removes it."""
    missing = [name for name in ("pyproject.toml", "setup.py", "echo2") if not (root / name).exists()]
    if missing:
        raise Echo2InputError(f"the learner job installs echo2 from its source, but {root} has no "
                              f"{', '.join(missing)}: launch it from a source checkout")
    dest = Path(tempfile.mkdtemp(prefix="echo2-learner-source-"))
    for name in SOURCE_FILES:
        if (root / name).is_file() and not (root / name).is_symlink():
            shutil.copy2(root / name, dest / name)
    for folder in SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*")):
            relative = path.relative_to(root)
            if (path.is_symlink() or not path.is_file() or path.suffix not in SOURCE_SUFFIXES
                    or any(part == "__pycache__" or part.startswith(".") for part in relative.parts)):
                continue
            (dest / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / relative)
    (dest / config_relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(workdir / config_relative, dest / config_relative)
    return dest


def _api_server_is_local() -> bool:
    from echo2.fleet.backends.skypilot_trust import api_server_is_local

    return api_server_is_local()


def launch_learner_job(config_path: str, settings: list[str], *, run_id: str | None = None,
                       task_file: Path | None = None, workdir: Path = Path("."),
                       api: LearnerJobApi | None = None, key_secret: str | None = None,
                       secrets: KeySecrets | None = None, source_root: Path | None = None,
                       api_is_local: Callable[[], bool] = _api_server_is_local) -> LearnerJob:
    """Fix the run id, find or make the run's key, put it where it travels (a secret store entry, else a SkyPilot
    secret through a local API server), stage the source, build the task and launch it as a managed job.
    ``secrets``, ``source_root`` (echo2's checkout) and ``api_is_local``: what the tests replace."""
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
    key_secret = key_secret or os.environ.get(KEY_SECRET_ENV) or None
    if key_secret is not None:
        parse_key_secret(key_secret)
    elif os.environ.get(ALLOW_KEY_ENV) != "1" and not api_is_local():
        raise Echo2InputError(f"SkyPilot's API server is not on this machine, and it would keep the run's key in its "
                              f"request log: name a secret store entry for the key (${KEY_SECRET_ENV}=aws-sm:NAME), or "
                              f"set {ALLOW_KEY_ENV}=1 to send it there anyway")
    created = not os.environ.get(KEY_ENV) and not key_path(run_id).exists()
    key = run_key(run_id, create=True)  # the same key at every start: actors verify versions with its public half
    key_hex = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()).hex()
    if key_secret is not None:  # the key goes to the store; the task names the entry only
        (secrets or key_secrets(key_secret)).put(parse_key_secret(key_secret)[2], key_hex)
    settings = [s for s in settings if not s.startswith("run.id=")]
    staged = stage_learner_source(source_root or _checkout(), relative, workdir)
    try:  # SkyPilot uploads the workdir within the launch request
        task = build_learner_task(str(relative), settings, run_id=run_id,
                                  key_hex=None if key_secret else key_hex, workdir=staged, task_config=task_config,
                                  key_secret=key_secret)
        name = job_name(run_id)
        job_id = (api or SkyJobs()).launch(task, name)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return LearnerJob(name, job_id, run_id, config.store.url, created)


def _checkout() -> Path:
    """The source checkout echo2 runs from."""
    import echo2

    return Path(echo2.__file__).resolve().parents[1]


def fetch_key(spec: str, secrets: KeySecrets | None = None) -> str:
    """On the learner's node: the run's key from its secret store entry, checked to be a key."""
    value = (secrets or key_secrets(spec)).get(parse_key_secret(spec)[2]).strip()
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value.lower()):
        raise Echo2InputError(f"the secret {spec} does not hold an echo2 run key (64 hex digits)")
    return value


def main(argv: list[str]) -> int:
    """``python -m echo2.fleet.learner_job fetch-key SPEC``: the key on stdout, for the task's ``run`` to export."""
    if len(argv) != 2 or argv[0] != "fetch-key":
        print("usage: python -m echo2.fleet.learner_job fetch-key aws-sm:[REGION/]NAME", file=sys.stderr)
        return 2
    try:
        print(fetch_key(argv[1]))
    except Exception as exc:  # one line, never the value
        print(f"error: could not read the run's key from {argv[1]}: {type(exc).__name__}: {exc}"[:500],
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
