"""Prefect beyond localhost (docs/prefect.md, "Deploy to your server"): the worker's SkyPilot task, prefect.yaml's
deployments registered on a real (loopback) Prefect server, the git deployment's pull steps, and secrets read from
Prefect Secret blocks (echo2/flows/secret_blocks.py). What needs a real cloud or Prefect Cloud account is not run
here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import prefect_server
import pytest
from conftest import REPO

from echo2.errors import Echo2InputError
from echo2.flows import secret_blocks

WORKER_TASK = REPO / "infra" / "prefect" / "worker-task.yaml"


def _fake_venv(tmp_path, inspect_rc: int):
    """A venv whose `prefect` records its arguments, and answers `work-pool inspect` with ``inspect_rc``."""
    venv, calls = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "prefect"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n[ "$1 $2" = "work-pool inspect" ] && exit {inspect_rc}\n'
                    'exit 0\n')
    fake.chmod(0o755)
    return venv, calls


@pytest.mark.e2e
def test_the_worker_task_is_a_skypilot_task_that_serves_its_pool(tmp_path):
    import yaml
    from conftest import sky_task  # SkyPilot's own parser, in its environment (.venv-sky); skipped without

    described = sky_task({"config": yaml.safe_load(WORKER_TASK.read_text())})
    task = described["yaml"]
    assert task["name"] == "echo2-prefect-worker" and described["workdir"] == "."
    assert "prefect worker start" in task["run"] and set(task["envs"]) >= {"PREFECT_API_URL", "ECHO2_POOL",
                                                                          "ECHO2_VENV"}
    assert all(not r["use_spot"] for r in described["resources"])  # a worker taken away takes the learner with it
    for inspect_rc, created in ((1, True), (0, False)):  # the pool made when the server has none of that name
        venv, calls = _fake_venv(tmp_path / str(inspect_rc), inspect_rc)
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **task["envs"], "ECHO2_VENV": str(venv),
               "PREFECT_API_URL": "http://10.0.0.4:4200/api"}
        proc = subprocess.run(["bash", "-c", task["run"]], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        lines = calls.read_text().splitlines()
        assert lines[-1] == "worker start --pool echo2-cloud --type process"
        assert ("work-pool create echo2-cloud --type process" in lines) == created
    env = {"PATH": os.environ["PATH"], **task["envs"], "ECHO2_VENV": str(venv)}  # no API: refused, in one line
    proc = subprocess.run(["bash", "-c", task["run"]], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "PREFECT_API_URL" in proc.stderr


def test_secret_block_pairs_are_checked_before_any_server_is_asked(monkeypatch):
    assert secret_blocks.parse_secret_blocks(" ECHO2_RUN_KEY=echo2-run-key, AWS_SECRET_ACCESS_KEY=aws-2 ,") == {
        "ECHO2_RUN_KEY": "echo2-run-key", "AWS_SECRET_ACCESS_KEY": "aws-2"}
    for bad in ("ECHO2_RUN_KEY", "ECHO2_RUN_KEY=Echo2_Key", "1X=key", "X=key with space"):
        with pytest.raises(Echo2InputError, match="NAME=block-name"):
            secret_blocks.parse_secret_blocks(bad)
    monkeypatch.setenv("ECHO2_RUN_KEY", "set by the operator")
    assert secret_blocks.load_secret_blocks("ECHO2_RUN_KEY=echo2-run-key") == []  # the environment wins: no lookup
    monkeypatch.delenv(secret_blocks.SECRET_BLOCKS_ENV, raising=False)
    assert secret_blocks.load_secret_blocks() == []


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, env = prefect_server.start(tmp_path_factory.mktemp("prefect") / "home")
    yield env
    prefect_server.stop(proc)


SECRETS = r'''
import os, sys, types
from prefect.blocks.system import Secret
from echo2.errors import Echo2InputError
from echo2.flows.secret_blocks import load_secret_blocks

Secret(value="seed-from-the-block").save("echo2-run-key")
Secret(value="aws-secret-from-the-block").save("echo2-aws-secret")
Secret(value={"not": "text"}).save("echo2-json")
os.environ["AWS_ACCESS_KEY_ID"] = "from-the-environment"
print(load_secret_blocks("AWS_SECRET_ACCESS_KEY=echo2-aws-secret,AWS_ACCESS_KEY_ID=echo2-aws-secret"))
print(os.environ["AWS_SECRET_ACCESS_KEY"], os.environ["AWS_ACCESS_KEY_ID"])
for spec in ("X_KEY=no-such-block", "X_KEY=echo2-json"):
    try:
        load_secret_blocks(spec)
    except Echo2InputError as exc:
        print("refused:", exc)

import echo2.flows.train as t  # the flow reads them before it resolves its launch (which opens the store)
class Seen(Exception):
    pass
def launch(*args):
    raise Seen(os.environ.get("ECHO2_RUN_KEY") == "seed-from-the-block")
t._launch = launch
os.environ["ECHO2_SECRET_BLOCKS"] = "ECHO2_RUN_KEY=echo2-run-key"
try:
    t.train()
except Seen as seen:
    print("flow saw the block's key:", seen)
'''


@pytest.mark.e2e
def test_secrets_come_from_prefect_secret_blocks_in_the_flow(server, tmp_path):
    unset = ("ECHO2_RUN_KEY", "AWS_SECRET_ACCESS_KEY", "ECHO2_SECRET_BLOCKS")
    env = {k: v for k, v in server.items() if k not in unset}
    out = subprocess.run([sys.executable, "-c", SECRETS], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "['AWS_SECRET_ACCESS_KEY']"  # AWS_ACCESS_KEY_ID was set: left as it is
    assert lines[1] == "aws-secret-from-the-block from-the-environment"
    assert lines[2].startswith("refused:") and "'no-such-block'" in lines[2] and "X_KEY" in lines[2]
    assert lines[3].startswith("refused:") and "holds no text" in lines[3]
    assert lines[-1] == "flow saw the block's key: True"
    assert "seed-from-the-block" not in out.stderr  # a value is never logged


@pytest.mark.e2e
def test_prefect_yaml_deploys_all_three_deployments_and_the_git_one_clones(server, tmp_path):
    env = dict(server, ECHO2_HOME=str(REPO))
    for pool in ("echo2-local", "echo2-cloud"):  # as `make ui` (infra/ui.sh) makes them
        subprocess.run([prefect_server.PREFECT, "work-pool", "create", pool, "--type", "process"], env=env,
                       check=True, capture_output=True, timeout=120)
    out = subprocess.run([prefect_server.PREFECT, "--no-prompt", "deploy", "--all"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    deployments = {d["name"]: d for d in httpx.post(f"{env['PREFECT_API_URL']}/deployments/filter", json={},
                                                    timeout=30).json()}
    assert set(deployments) == {"quickstart", "spot-multicloud", "spot-multicloud-git"}
    git = deployments["spot-multicloud-git"]
    assert git["work_pool_name"] == "echo2-cloud" and deployments["quickstart"]["work_pool_name"] == "echo2-local"
    clone, install = git["pull_steps"]
    assert clone["prefect.deployments.steps.git_clone"]["repository"].endswith(".git")
    step = install["prefect.deployments.steps.run_shell_script"]
    assert step["directory"] == "{{ clone.directory }}"  # resolved on the worker, from the clone step's output
    assert "pip install" in step["script"] and "--no-deps" in step["script"]
    assert json.dumps(deployments["quickstart"]["pull_steps"]).count(str(REPO)) == 1  # the checkout's, unchanged
