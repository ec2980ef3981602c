"""The control room: a real Prefect server and process worker on loopback, the deployments of
prefect.yaml, `prefect deployment run`, artifacts read back through the API, and the flow run
page rendered in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e


NO_BROWSER = ("no browser for the UI page test: install one with `sudo apt-get install chromium` "
              "(`make test` does it when run as root) or set ECHO2_CHROMIUM=/path/to/chromium")


def chromium_path() -> str | None:
    """$ECHO2_CHROMIUM, else `chromium` on PATH (Debian's package; playwright downloads no browser)."""
    return os.environ.get("ECHO2_CHROMIUM") or shutil.which("chromium")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    state = tmp_path_factory.mktemp("ui-state")
    port = free_port()
    env = dict(os.environ, ECHO2_UI_STATE=str(state), ECHO2_UI_PORT=str(port), BIN=str(Path(sys.executable).parent),
               PREFECT_WORKER_QUERY_SECONDS="2")
    env.pop("PREFECT_HOME", None)
    subprocess.run(["bash", "infra/ui.sh", "start"], cwd=REPO, env=env, check=True, timeout=300)
    api = dict(env, PREFECT_API_URL=f"http://127.0.0.1:{port}/api", PREFECT_HOME=str(state / "prefect-home"))
    pids = [int((state / f"{n}.pid").read_text()) for n in ("server", "worker")]
    yield api, port, state
    subprocess.run(["bash", "infra/ui.sh", "stop"], cwd=REPO, env=env, check=True, timeout=120)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def prefect(api, *args, timeout=600):
    return subprocess.run([str(Path(sys.executable).parent / "prefect"), *args], cwd=REPO, env=api,
                          capture_output=True, text=True, timeout=timeout)


def test_deployment_run_reports_progress_metrics_and_cost(ui, tiny_model, tmp_path):
    api, port, state = ui
    listed = prefect(api, "deployment", "ls")
    assert "echo2-train/quickstart" in listed.stdout.replace(" ", "") or "quickstart" in listed.stdout
    assert "spot-multicloud" in listed.stdout
    overrides = [f"store.url={tmp_path}", "run.id=deployed", "rollout.group_size=4", "rollout.groups_per_batch=2",
                 "train.groups_per_step=2", "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "task.eval_size=10",
                 "train.checkpoint_every=2"]
    run = prefect(api, "deployment", "run", "echo2-train/quickstart", "--param", f"model={tiny_model}",
                  "--param", "max_steps=4", "--param", f"overrides={json.dumps(overrides)}", "--watch",
                  "--watch-timeout", "400")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "runs" / "deployed" / "reports" / "summary.json").exists()

    code = r'''
import json, sys
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, ArtifactFilter, ArtifactFilterFlowRunId
with get_client(sync_client=True) as c:
    runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["deployed"])))
    run = runs[0]
    arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    print(json.dumps({"id": str(run.id), "state": run.state.type.value, "tags": run.tags,
                      "artifacts": [{"key": a.key, "type": a.type, "data": a.data, "created": a.created.timestamp()}
                                    for a in sorted(arts, key=lambda a: a.created)]}, default=str))
'''
    out = subprocess.run([sys.executable, "-c", code], env=api, capture_output=True, text=True, timeout=60, check=True)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["state"] == "COMPLETED"
    assert {"echo2", "task:arithmetic", "fleet:local"} <= set(info["tags"])
    by_type = {}
    for a in info["artifacts"]:
        by_type.setdefault(a["type"], []).append(a)
    assert by_type["progress"][-1]["data"] == 100.0
    # one metrics table, updated in place (it used to be a new version every 2 steps, and one more at the end)
    assert len(by_type["table"]) == 1 and len(by_type["progress"]) == 1, [a["key"] for a in info["artifacts"]]
    table = by_type["table"][-1]["data"]
    table = json.loads(table) if isinstance(table, str) else table
    assert [row["step"] for row in table] == [1, 2, 3, 4]
    assert table[-1]["eval_accuracy"] is not None and table[-1]["actors_alive"] == 1
    assert table[-1]["full_mb"] > 0 and table[-1]["sent_mb"] is not None  # what the step's publish moved
    assert {"changed_share", "encode_s", "apply_s"} <= table[-1].keys()
    assert any("Cost" in a["data"] for a in by_type["markdown"])
    (state / "flow_run_id").write_text(info["id"])  # the page test needs the run, whatever its logs say
    # actor logs reached the flow run's log. The run's log lines are shipped in batches by a thread of the flow's
    # process, which may still be draining them after `--watch` saw COMPLETED
    from helpers import wait_until

    wait_until(lambda: "[actor0-" in prefect(api, "flow-run", "logs", info["id"]).stdout, 120,
               "the actors' lines in the flow run's log")


@pytest.mark.skipif(chromium_path() is None, reason=NO_BROWSER)
def test_flow_run_page_renders_the_artifacts(ui, tmp_path):
    """Open the flow run page in headless Chromium, click its Artifacts tab, check, screenshot.

    The screenshot goes to the test's tmp dir; ECHO2_REFRESH_SCREENSHOT=1 also copies it over the
    README's image, docs/prefect-flow-run.png (a deliberate refresh, never a side effect)."""
    from playwright.sync_api import sync_playwright

    api, port, state = ui
    browser_path = chromium_path()
    flow_run_id = (state / "flow_run_id").read_text()
    shot = tmp_path / "prefect-flow-run.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
            page.get_by_text("deployed", exact=True).first.wait_for(timeout=30_000)  # the run is named by its id
            page.locator("li#artifacts").click()  # the Artifacts tab of the run page
            for key in ("deployed-metrics", "deployed-cost-report", "deployed-progress"):
                page.get_by_text(key).first.wait_for(timeout=30_000)
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 20_000
    if os.environ.get("ECHO2_REFRESH_SCREENSHOT") == "1":
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copyfile(shot, REPO / "docs" / "prefect-flow-run.png")


def flow_run_state(api, flow_run_id: str) -> tuple[str, int]:
    """The flow run's state type and how many times it has run."""
    code = ("import sys; from prefect import get_client\n"
            "with get_client(sync_client=True) as c:\n"
            "    r = c.read_flow_run(sys.argv[1]); print(r.state.type.value, r.run_count)")
    out = subprocess.run([sys.executable, "-c", code, flow_run_id], env=api, capture_output=True, text=True,
                         timeout=60, check=True)
    state, runs = out.stdout.strip().splitlines()[-1].split()
    return state, int(runs)


def test_retrying_a_crashed_flow_run_resumes_its_run(ui, tiny_model, tmp_path):
    """The UI's Retry on a crashed deployment run (the same API call) reruns the same flow run: it must
    continue the run it started from its last checkpoint, not start another run at step 0."""
    from helpers import wait_until

    api, port, state = ui
    overrides = [f"store.url={tmp_path}", "rollout.group_size=4", "rollout.groups_per_batch=2",  # no run.id
                 "train.groups_per_step=2", "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "task.eval_size=10",
                 "train.checkpoint_every=2", "eval.before=false", "eval.after=false"]
    # the first attempt's learner is killed at the 7th pass of its `step` failpoint (two a step: in step 4,
    # after checkpoint 2); the retry resumes at 2 and finishes step 5 within six passes
    started = prefect(api, "deployment", "run", "echo2-train/quickstart", "--param", f"model={tiny_model}",
                      "--param", "max_steps=5", "--param", f"overrides={json.dumps(overrides)}",
                      "--job-variable", 'env={"ECHO2_FAILPOINTS": "step:7"}')
    assert started.returncode == 0, started.stdout + started.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
    wait_until(lambda: flow_run_state(api, flow_run_id)[0] == "CRASHED", 300, "the first attempt to crash")
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "checkpoints" / "step-000002" / "manifest.json").exists()
    assert not (run / "reports" / "summary.json").exists()

    code = ("import sys; from prefect import get_client; from prefect.states import AwaitingRetry\n"
            "with get_client(sync_client=True) as c:\n"
            "    c.set_flow_run_state(sys.argv[1], AwaitingRetry(message='Retry from the UI'), force=True)")
    subprocess.run([sys.executable, "-c", code, flow_run_id], env=api, check=True, timeout=60)
    final = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
    wait_until(lambda: (lambda st: st[0] in final and st[1] >= 2)(flow_run_state(api, flow_run_id)), 400,
               "the retry to end")
    assert flow_run_state(api, flow_run_id)[0] == "COMPLETED"
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run.name]  # the same run, no second one
    summary = json.loads((run / "reports" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["run_id"] == run.name
    events = [json.loads(p.read_text()) for p in (run / "ledger" / "events").glob("*.json")]
    resumed = [e for e in events if e["kind"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] == 2, resumed
    attempts = sorted((e["attempt"], e["step"]) for e in events if e["kind"] == "flow_run" and
                      e["flow_run_id"] == flow_run_id)
    assert attempts == [(1, 0), (2, 2)], attempts


def test_cancelling_from_the_api_stops_actors_checkpoints_and_resume_continues(ui, tiny_model, tmp_path):
    """What the UI's Cancel button does (it calls the same API): actors stop, a checkpoint is written, resume works."""
    import re
    import time

    api, port, state = ui
    overrides = [f"store.url={tmp_path}", "run.id=cancelme", "rollout.group_size=4", "rollout.groups_per_batch=2",
                 "train.groups_per_step=2", "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "task.eval_size=10",
                 "train.checkpoint_every=1000", "eval.before=false"]
    started = prefect(api, "deployment", "run", "echo2-train/quickstart", "--param", f"model={tiny_model}",
                      "--param", "max_steps=100000", "--param", f"overrides={json.dumps(overrides)}")
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
    run = tmp_path / "runs" / "cancelme"
    deadline = time.time() + 240
    while not (run / "ledger" / "consumed" / "step-000003.json").exists():
        assert time.time() < deadline, "training did not start"
        time.sleep(0.5)
    pids = [json.loads(p.read_text())["pid"] for p in (run / "ledger" / "events").glob("*.json")
            if json.loads(p.read_text())["kind"] == "launch"]
    cancel = prefect(api, "flow-run", "cancel", flow_run_id)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    deadline = time.time() + 120
    while True:
        inspect = prefect(api, "flow-run", "inspect", flow_run_id)
        if "CANCELLED" in inspect.stdout:
            break
        assert time.time() < deadline, inspect.stdout[-2000:]
        time.sleep(1)
    deadline = time.time() + 60
    while any(Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z" for p in pids):
        assert time.time() < deadline, "actors outlived the cancelled run"
        time.sleep(0.5)
    ckpts = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").iterdir() if (p / "manifest.json").exists())
    assert ckpts and ckpts[-1] >= 3  # written on cancellation, not by schedule
    assert not (run / "reports" / "summary.json").exists()
    kinds = [json.loads(p.read_text())["kind"] for p in (run / "ledger" / "events").glob("*.json")]
    assert "interrupted" in kinds

    resume = [f"store.url={tmp_path}", "run.id=cancelme"]
    done = prefect(api, "deployment", "run", "echo2-train/quickstart", "--param", "resume=true",
                   "--param", f"max_steps={ckpts[-1] + 2}", "--param", f"overrides={json.dumps(resume)}", "--watch",
                   "--watch-timeout", "400")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((run / "reports" / "summary.json").read_text())
    assert summary["steps"] == ckpts[-1] + 2 and summary["run_id"] == "cancelme"
