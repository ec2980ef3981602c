"""The learner as a SkyPilot managed job (issue 23, item 2; ``echo2/fleet/learner_job.py``): the shipped task file
built into a real ``sky.Task`` in SkyPilot's own environment (spot, any of several clouds and GPUs, SkyPilot's own
recovery including the learner's "reclaimed" exit, the run id fixed at launch, the run's key as a SkyPilot secret
only), and a command that works at every start (``--start-or-resume``). ``_Jobs`` is a test double of the one call
that reaches SkyPilot's API server (``sky.jobs.launch``): no cloud is reachable from here."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import sky_task
from typer.testing import CliRunner

from echo2.config import load_config
from echo2.data import layout
from echo2.data.run_folder import create_run
from echo2.data.run_key import key_path, run_key
from echo2.data.store import open_store
from echo2.errors import Echo2InputError
from echo2.fleet import learner_job
from echo2.launch import run_exists


class _Jobs:
    """Test double of ``sky.jobs.launch``: records what reached the "API server", and the files of the workdir it
    would have uploaded (SkyPilot packs the workdir within the launch request)."""

    def __init__(self):
        self.launched: list[tuple[dict, str]] = []
        """Each task as SkyPilot built it (``sky_bridge.describe_task``), and its job's name."""
        self.uploaded: list[set[str]] = []

    def launch(self, task, name):
        task = sky_task(task)
        self.launched.append((task, name))
        root = Path(task["workdir"])
        self.uploaded.append({str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()})
        return 7


class _SecretsDouble:
    """Test double of a secret store (``learner_job.KeySecrets``; AWS Secrets Manager in use)."""

    def __init__(self):
        self.entries: dict[str, str] = {}

    def put(self, name, value):
        if self.entries.setdefault(name, value) != value:
            raise Echo2InputError(f"the secret {name} holds another key")

    def get(self, name):
        return self.entries[name]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv("ECHO2_RUN_KEY", raising=False)
    work = tmp_path / "checkout"
    (work / "configs").mkdir(parents=True)
    (work / "configs" / "spot.yaml").write_text("run: {name: spotty}\nstore: {url: s3://bucket/echo2}\n")
    return work


def test_the_learner_job_is_a_spot_managed_job_that_recovers_and_carries_the_key_as_a_secret(workdir):
    jobs = _Jobs()
    job = learner_job.launch_learner_job("configs/spot.yaml", ["train.max_steps=9"], workdir=workdir, api=jobs)
    [(task, name)] = jobs.launched
    assert name == job.name == f"echo2-learner-{job.run_id}" and job.job_id == 7
    assert job.run_id.startswith("spotty-") and job.created_key and key_path(job.run_id).exists()
    assert {r["cloud"] for r in task["resources"]} == {"aws", "gcp"}  # any of several clouds
    assert {g for r in task["resources"] for g in r["accelerators"]} == {"H100", "A100-80GB"}
    for r in task["resources"]:
        assert r["use_spot"]
        assert r["job_recovery"]["recover_on_exit_codes"] == [learner_job.RECLAIMED_EXIT]
        assert r["job_recovery"]["strategy"] == "EAGER_NEXT_REGION"
        assert r["job_recovery"]["max_restarts_on_errors"] >= 1
    envs = task["yaml"]["envs"]
    assert envs["ECHO2_RUN_ID"] == job.run_id and envs["ECHO2_CONFIG"] == "configs/spot.yaml"
    assert envs["ECHO2_SETTINGS"].split() == ["train.max_steps=9", "learner.market=spot"]
    assert envs["ECHO2_PREEMPTION_SOURCE"] == "auto"
    # the key: a SkyPilot secret, never an env, and redacted where SkyPilot shows the task
    key = key_path(job.run_id).read_text().strip()
    assert task["yaml"]["secrets"]["ECHO2_RUN_KEY"] == key
    assert key not in str(task["yaml"]["envs"]) and key not in str(task["shown"])
    assert "--start-or-resume" in task["yaml"]["run"] and '--set "run.id=$ECHO2_RUN_ID"' in task["yaml"]["run"]
    assert Path(task["workdir"]).name.startswith("echo2-learner-source-")  # staged, never the launch folder
    # a second launch of the same run (a job cancelled by hand, launched again) takes the same key
    again = learner_job.launch_learner_job("configs/spot.yaml", [], run_id=job.run_id, workdir=workdir, api=jobs)
    assert not again.created_key and jobs.launched[1][0]["yaml"]["secrets"]["ECHO2_RUN_KEY"] == key


def test_the_jobs_command_creates_the_run_at_its_first_start_and_resumes_it_at_every_later_one(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    settings = [f"store.url={tmp_path / 'store'}", "run.id=relaunched"]
    assert run_exists(None, settings) is False  # first start: --start-or-resume creates
    runs = open_store(str(tmp_path / "store")).child(layout.RUNS)
    config = load_config(None, settings)
    create_run(runs.child("relaunched"), "relaunched", config.model_dump(mode="json"),
               key=run_key("relaunched", create=True), echo2_version="test")
    assert run_exists(None, settings) is True  # every later start: resumes
    with pytest.raises(Echo2InputError, match="run.id"):
        run_exists(None, [f"store.url={tmp_path / 'store'}"])


def test_bad_learner_jobs_are_refused_in_one_line(workdir, tmp_path):
    jobs = _Jobs()
    with pytest.raises(Echo2InputError, match="folder of this machine"):
        learner_job.launch_learner_job("configs/spot.yaml", [f"store.url={tmp_path}"], workdir=workdir, api=jobs)
    with pytest.raises(Echo2InputError, match="not inside the workdir"):
        learner_job.launch_learner_job(str(tmp_path / "elsewhere.yaml"), [], workdir=workdir, api=jobs)
    no_recovery = tmp_path / "task.yaml"
    no_recovery.write_text("resources: {use_spot: true}\nrun: echo2 learner x\n")
    with pytest.raises(Echo2InputError, match="recover_on_exit_codes must name 75"):
        learner_job.launch_learner_job("configs/spot.yaml", [], task_file=no_recovery, workdir=workdir, api=jobs)
    with pytest.raises(Echo2InputError, match="without spaces"):
        learner_job.launch_learner_job("configs/spot.yaml", ["a=b c"], workdir=workdir, api=jobs)
    assert not jobs.launched


def test_echo2_fleet_learner_job(workdir, monkeypatch):
    from echo2.cli import app

    jobs = _Jobs()
    monkeypatch.setattr(learner_job, "SkyJobs", lambda: jobs)
    result = CliRunner().invoke(app, ["fleet", "learner-job", "configs/spot.yaml", "--workdir", str(workdir),
                                      "--run-id", "r-cli"])
    assert result.exit_code == 0, result.output
    assert "managed job echo2-learner-r-cli (id 7) trains run r-cli in s3://bucket/echo2" in result.output
    assert jobs.launched[0][0]["yaml"]["envs"]["ECHO2_RUN_ID"] == "r-cli"
    bad = CliRunner().invoke(app, ["fleet", "learner-job", "configs/spot.yaml", "--workdir", str(workdir),
                                   "--set", "store.url=/tmp/x"])
    assert bad.exit_code == 2 and "error: store.url" in bad.output


def test_the_job_uploads_echo2_s_source_staged_alone_never_the_folder_it_was_launched_from(workdir):
    """Launched from a folder that also holds cloud credentials and run keys (as $HOME does): what the job uploads is
    echo2's own code, configs and task files, and the config named."""
    (workdir / ".aws").mkdir()
    (workdir / ".aws" / "credentials").write_text("[default]\naws_secret_access_key = hunter2\n")
    (workdir / ".config" / "echo2" / "keys").mkdir(parents=True)
    (workdir / ".config" / "echo2" / "keys" / "old-run.key").write_text("00" * 32)
    (workdir / "notes.txt").write_text("private")
    jobs = _Jobs()
    learner_job.launch_learner_job("configs/spot.yaml", [], workdir=workdir, api=jobs, api_is_local=lambda: True)
    [files] = jobs.uploaded
    assert "configs/spot.yaml" in files and "echo2/__init__.py" in files and "echo2/flows/train.py" in files
    assert "infra/skypilot/actor.yaml" in files and "pyproject.toml" in files
    leaked = [f for f in files if f.startswith(".") or "/." in f or f.endswith(".key") or f == "notes.txt"]
    assert not leaked, leaked
    assert not Path(jobs.launched[0][0]["workdir"]).exists()  # removed once the launch request went


def test_the_run_key_travels_through_a_secret_store_entry_and_never_in_the_request(workdir, monkeypatch):
    """With $ECHO2_RUN_KEY_SECRET the key goes to the secret store (a test double: no cloud is reachable here) and
    the task carries the entry's name only, on that store's cloud; the node reads it back at every start."""
    monkeypatch.setenv(learner_job.KEY_SECRET_ENV, "aws-sm:us-east-1/echo2/spotty")
    jobs, secrets = _Jobs(), _SecretsDouble()
    job = learner_job.launch_learner_job("configs/spot.yaml", [], workdir=workdir, api=jobs, secrets=secrets,
                                         api_is_local=lambda: False)
    [(task, _)] = jobs.launched
    key = key_path(job.run_id).read_text().strip()
    assert secrets.entries == {"echo2/spotty": key}
    assert "ECHO2_RUN_KEY" not in (task["yaml"].get("secrets") or {})
    assert task["yaml"]["envs"][learner_job.KEY_SECRET_ENV] == "aws-sm:us-east-1/echo2/spotty"
    assert key not in str(task["yaml"]) and key not in str(task["yaml"]["envs"])
    assert {r["cloud"] for r in task["resources"]} == {"aws"}  # where the entry can be read
    assert "fetch-key" in task["yaml"]["run"]
    assert learner_job.fetch_key("aws-sm:us-east-1/echo2/spotty", secrets=secrets) == key
    with pytest.raises(Echo2InputError, match="another key"):  # an entry of another run is never overwritten
        secrets.entries["echo2/spotty"] = "ab" * 32
        learner_job.launch_learner_job("configs/spot.yaml", [], run_id=job.run_id, workdir=workdir, api=jobs,
                                       secrets=secrets, api_is_local=lambda: False)


def test_a_remote_api_server_is_refused_the_key_unless_told(workdir, monkeypatch):
    """Without a secret store, the key would sit in SkyPilot's request log: only an API server on this machine (which
    holds the key already) gets it, or one the user names with ECHO2_ALLOW_KEY_IN_SKYPILOT=1."""
    jobs = _Jobs()
    with pytest.raises(Echo2InputError, match="not on this machine"):
        learner_job.launch_learner_job("configs/spot.yaml", [], workdir=workdir, api=jobs, api_is_local=lambda: False)
    assert not jobs.launched
    monkeypatch.setenv(learner_job.ALLOW_KEY_ENV, "1")
    learner_job.launch_learner_job("configs/spot.yaml", [], workdir=workdir, api=jobs, api_is_local=lambda: False)
    assert jobs.launched[0][0]["yaml"]["secrets"]["ECHO2_RUN_KEY"]


def test_hf_token_set_here_is_a_secret_of_the_learner_task_and_never_in_a_file(workdir, monkeypatch):
    """A gated model: the learner's nodes download it with $HF_TOKEN, given to the task as a SkyPilot secret (redacted
    where SkyPilot shows the task) when this machine's environment has one, with either way the run key travels."""
    token = "hf_" + "x" * 34
    monkeypatch.setenv("HF_TOKEN", token)
    for secret_store in (None, "aws-sm:us-east-1/echo2/spotty"):
        jobs = _Jobs()
        if secret_store:
            monkeypatch.setenv(learner_job.KEY_SECRET_ENV, secret_store)
        learner_job.launch_learner_job("configs/spot.yaml", [], workdir=workdir, api=jobs,
                                       secrets=_SecretsDouble(), api_is_local=lambda: True)
        [(task, _)] = jobs.launched
        assert task["yaml"]["secrets"]["HF_TOKEN"] == token
        assert token not in str(task["yaml"]["envs"]) and token not in str(task["shown"])
        assert not any(token in p.read_text(errors="replace") for p in workdir.rglob("*") if p.is_file())
    monkeypatch.delenv("HF_TOKEN")
    jobs = _Jobs()
    learner_job.launch_learner_job("configs/spot.yaml", [], workdir=workdir, api=jobs, secrets=_SecretsDouble())
    assert "HF_TOKEN" not in (jobs.launched[0][0]["yaml"].get("secrets") or {})  # none here: the task asks for none
