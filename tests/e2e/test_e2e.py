"""End to end through the real CLI: Prefect flow, learner, a real actor process, a real store."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from conftest import REPO
from e2e_runs import QUICKSTART, TINY, echo2, sets
from helpers import ledger_audit, reap_session, wait_until

from echo2.data.store import open_store

pytestmark = pytest.mark.e2e


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def actor_pids(run_dir: Path) -> list[int]:
    events = [json.loads(p.read_text()) for p in (run_dir / "ledger" / "events").glob("*.json")]
    return [e["pid"] for e in events if e["kind"] == "launch"]


@pytest.mark.prefect_ephemeral  # a user's `make run`: the run starts Prefect's temporary server
def test_run_end_to_end_with_a_tiny_model(tiny_model, tmp_path):
    proc = echo2("run", QUICKSTART, *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=e2e", *TINY,
                                          "logging.completions_every=2", "logging.completions_rows=3"))
    summary = json.loads((tmp_path / "runs" / "e2e" / "reports" / "summary.json").read_text())
    for field in ("run_id", "steps", "wall_seconds", "eval_before", "eval_after", "staleness_bound", "max_lag_used",
                  "rollouts_used", "rollouts_dropped_stale", "rollouts_quarantined"):
        assert field in summary, field
    assert summary["run_id"] == "e2e" and summary["steps"] == 4 and summary["staleness_bound"] == 2
    assert 0 <= summary["max_lag_used"] <= 2
    assert summary["rollouts_used"] >= 4  # one 2-group file per step at least... each step needs 2 groups
    assert "held-out greedy accuracy" in proc.stdout
    # it ends with two lines, the metric with its intervals and where the reports are; the JSON is summary.json
    assert re.search(r"^held-out greedy accuracy: [0-9.]+ \[95% [0-9.]+, [0-9.]+\] -> .*; 4 steps, .*$", proc.stdout,
                     re.M) and proc.stdout.rstrip().splitlines()[-1] == \
        f"run e2e: reports in {tmp_path}/runs/e2e/reports/ (summary.json, curves.png, cost.md)"
    assert "{" not in proc.stdout and summary["cost_priced"] is False  # the quickstart prices nothing
    # stdout is a pipe here, as under nohup or `make run > file`: one plain line per step, no live bar
    steps = re.findall(r"^step (\d+)/4: reward [0-9.]+, lag [0-9.]+ \(max \d+\), \d+ completions, [0-9.]+s$",
                       proc.stdout, re.M)
    assert steps == ["1", "2", "3", "4"], proc.stdout

    run = tmp_path / "runs" / "e2e"
    assert json.loads((run / "run.json").read_text())["config"]["run"]["id"] == "e2e"
    assert json.loads((run / "policy" / "LATEST").read_text()) == {"version": 4}
    assert (run / "policy" / "v000004" / "manifest.json").exists()
    assert sorted(p.name for p in (run / "ledger" / "consumed").iterdir()) == [
        "final.json", *(f"step-00000{i}.json" for i in range(1, 5))]
    problems, counts = ledger_audit(open_store(str(run)))
    assert not problems and counts["used"] >= 4, (problems, counts)  # every committed file once in the ledger
    assert {p.name for p in (run / "checkpoints").iterdir()} == {"step-000002", "step-000004"}
    assert (run / "reports" / "curves.png").stat().st_size > 1000
    assert "## Cost" in (run / "reports" / "cost.md").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/reward")] == [1, 2, 3, 4]
    assert "eval/accuracy_after" in events.Tags()["scalars"]
    # a completions table every 2 steps, decoded, from what the step trained on
    tables = sorted((run / "reports" / "completions").iterdir())
    assert [p.name for p in tables] == ["step-000002.jsonl", "step-000004.jsonl"]
    for step, path in ((2, tables[0]), (4, tables[1])):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == 3 and all(r["step"] == step and 0 <= step - 1 - r["version"] <= 2 for r in rows), rows
        assert all(r["actor_id"] and "What is" in r["prompt"] and isinstance(r["completion"], str) for r in rows)
    assert "completions/text_summary" in events.Tags()["tensors"]
    # every lag recorded in the ledger is within the bound
    for step_file in (run / "ledger" / "consumed").iterdir():
        record = json.loads(step_file.read_text())
        assert all(0 <= u["lag"] <= 2 for u in record["used"])
    # a rollout file is plain Arrow IPC
    arrow = next((run / "rollouts").glob("v*/*.arrow"))
    table = ipc.open_file(pa.memory_map(str(arrow))).read_all()
    assert table.num_rows == 8 and len(table.to_pandas()) == 8
    # the actor process is gone
    pids = actor_pids(run)
    assert pids and not any(pid_alive(p) for p in pids)

    # export a checkpoint and the latest version; both load with from_pretrained
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for args, name in ((["--step", "2"], "ckpt2"), ([], "latest")):
        echo2("export", str(run), str(tmp_path / name), *args)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        AutoTokenizer.from_pretrained(tmp_path / name)
        assert model.config.vocab_size == 300
        assert not (tmp_path / name / "optimizer.pt").exists()


def test_resume_after_the_learner_is_killed(tiny_model, tmp_path):
    args = ["run", QUICKSTART, *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=crash", *TINY,
                                      "train.max_steps=200", "eval.before=false")]
    # its own session, so that what SIGKILL leaves behind (Prefect's ephemeral server) can be reaped after
    learner = subprocess.Popen([sys.executable, "-m", "echo2.cli", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    run = tmp_path / "runs" / "crash"
    try:
        wait_until(lambda: (run / "checkpoints" / "step-000002" / "manifest.json").exists(), 240, "checkpoint 2")
        wait_until(lambda: (run / "ledger" / "consumed" / "step-000003.json").exists(), 60, "step 3 to start")
    finally:
        learner.send_signal(signal.SIGKILL)  # the learner alone: its actors must notice by themselves
        learner.wait()
    pids = actor_pids(run)
    try:
        wait_until(lambda: not any(pid_alive(p) for p in pids), 30, "actors to die with their learner")
    finally:
        reap_session(learner)
    assert not (run / "reports" / "summary.json").exists()
    ckpt = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").iterdir() if (p / "manifest.json").exists())
    consumed = run / "ledger" / "consumed"
    lost = sorted(p.name for p in consumed.iterdir() if int(p.stem.split("-")[1]) > ckpt)

    # resume: the newest unfinished run is found without naming it; max_steps is overridden on the way
    target = ckpt + 2
    proc = echo2("run", QUICKSTART, *sets(f"store.url={tmp_path}", f"train.max_steps={target}"), "--resume")
    summary = json.loads((run / "reports" / "summary.json").read_text())
    assert summary["steps"] == target and summary["run_id"] == "crash"
    assert summary["eval_before"] is None  # the killed run skipped it; resume does not invent one
    assert summary["eval_after"] is not None and "held-out greedy accuracy" not in proc.stdout
    assert max(p.name for p in (run / "checkpoints").iterdir()) == f"step-{target:06d}"
    # the lost timeline (ledger entries after the checkpoint) was moved aside, not deleted
    orphaned = {p.name for p in (run / "orphaned").rglob("step-*.json")} if lost else set()
    assert set(lost) <= orphaned
    assert sorted(p.name for p in consumed.iterdir()) == ["final.json",
                                                          *(f"step-{i:06d}.json" for i in range(1, target + 1))]
    problems, counts = ledger_audit(open_store(str(run)))
    assert not problems, problems
    events = [json.loads(p.read_text())["kind"] for p in (run / "ledger" / "events").glob("*.json")]
    assert "resume" in events


@pytest.mark.parametrize("args, message", [
    (["--set", "train.lr=fast"], "train.lr"),
    (["--set", "train.bogus=1"], "train.bogus: unknown key"),
    (["--set", "model.name=/nonexistent/model"], "model"),
    (["--set", "store.url=/proc/echo2-not-writable"], "store"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    proc = echo2("run", QUICKSTART, *args, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], proc.stderr


def test_unreachable_s3_store_exits_2(monkeypatch):
    env = dict(os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1")
    proc = echo2("run", QUICKSTART, "--set", "store.url=s3://bucket/echo2", "--set",
                 "store.options={endpoint_url: 'http://127.0.0.1:9'}", check=False, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: store s3://bucket/echo2 is unreachable"), proc.stderr


def test_dry_run_prints_the_resolved_config_and_starts_nothing(tmp_path):
    cache = tmp_path / "cache"  # the default model is checked, not converted (half a GB written, a minute)
    proc = echo2("run", QUICKSTART, "--dry-run", "--set", f"store.url={tmp_path}", "--set", "train.staleness=0",
                 env=dict(os.environ, ECHO2_CACHE=str(cache)))
    assert "staleness: 0" in proc.stdout
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert not cache.exists() or not any(cache.rglob("*.safetensors"))


def test_run_on_s3_against_moto(tiny_model, s3_store, s3_server, tmp_path):
    """Learner and actor process both talk S3 (moto's server on loopback) and nothing else."""
    bucket = s3_store.root.split("/")[0]
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    echo2("run", QUICKSTART, *sets(f"model.name={tiny_model}", f"store.url=s3://{bucket}/echo2", "run.id=s3run",
                                    f"store.options={{endpoint_url: '{s3_server}'}}", *TINY, "train.max_steps=3"),
          env=env, cwd=tmp_path)
    from echo2.data.rollouts import decode_rollouts
    from echo2.data.store import open_store

    run = open_store(f"s3://{bucket}/echo2/runs/s3run", {"endpoint_url": s3_server})
    summary = run.get_json("reports/summary.json")
    assert summary["steps"] == 3 and summary["rollouts_used"] >= 3
    keys = run.list()
    assert "policy/v000003/manifest.json" in keys and "checkpoints/step-000003/manifest.json" in keys
    arrow = [k for k in keys if k.endswith(".arrow")]
    assert arrow and decode_rollouts(run.get(arrow[0])).num_rows == 8
    assert (tmp_path / "echo2-logs" / "s3run").is_dir()  # actor logs stay local for remote stores


@pytest.mark.prefect_ephemeral  # the temporary server is among what must not outlive the learner
@pytest.mark.parametrize("stop, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_every_process(tiny_model, tmp_path, stop, code):
    """Ctrl-C, and SIGTERM (`kill`, a supervisor, a CI timeout) the same way: checkpoint, actors stopped, and
    nothing left running (SIGTERM's default action used to end the learner at once, its Prefect server left)."""
    args = ["run", QUICKSTART, *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=intr", *TINY,
                                      "train.max_steps=500", "eval.before=false")]
    # output to files, not pipes: a pipe is held open by every child that inherited it, so reading it to
    # the end would wait for the children too, and we want to see the learner's own exit
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        # started with SIGINT ignored, as a job a shell script puts in the background inherits it (CI,
        # `make test &`): Ctrl-C / kill -INT must stop the run all the same
        # PYTHONFAULTHANDLER: a learner that does not exit is sent SIGABRT below and prints every thread's stack
        learner = subprocess.Popen([sys.executable, "-m", "echo2.cli", *args], cwd=REPO, stdout=out, stderr=err,
                                   start_new_session=True, env=dict(os.environ, PYTHONFAULTHANDLER="1"),
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    run = tmp_path / "runs" / "intr"
    try:
        wait_until(lambda: (run / "ledger" / "consumed" / "step-000002.json").exists(), 240, "training to start")
        pids = actor_pids(run)
        assert pids and all(pid_alive(p) for p in pids)
        learner.send_signal(stop)
        try:
            learner.wait(timeout=90)
        except subprocess.TimeoutExpired:  # what holds it: its threads' stacks (seen once, under load, 2026-12-03)
            learner.send_signal(signal.SIGABRT)
            learner.wait(timeout=30)
            stacks = err_path.read_text()[-20000:]
            pytest.fail(f"the learner had not exited 90 s after the signal; its stderr:\n{stacks}")
        # nothing the learner started outlives it for long (actors, Prefect's ephemeral server)
        wait_until(lambda: not session_pids(learner.pid), 30, "the learner's processes to exit")
    finally:
        reap_session(learner)
    err = err_path.read_text()
    assert learner.returncode == code, err
    assert "--resume" in err
    assert not any(pid_alive(p) for p in pids)
    kinds = [json.loads(p.read_text())["kind"] for p in (run / "ledger" / "events").glob("*.json")]
    assert "terminated" in kinds


RETRIED_FLOW = """
import json, os, sys
for key, value in {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "DO_NOT_TRACK": "1", "PREFECT_LOGGING_LEVEL": "WARNING"}.items():
    os.environ.setdefault(key, value)
import echo2.learner.run as run_module
import echo2.flows.train
from echo2.launch import resolve_launch

failed = []
original = run_module.LearnerRun.update


def update(self, selection):  # the first attempt fails in step 3, after checkpoint 2
    if self.step == 2 and not failed:
        failed.append(True)
        raise RuntimeError("injected: the first attempt fails in step 3")
    return original(self, selection)


run_module.LearnerRun.update = update
cfg = resolve_launch(sys.argv[1], sys.argv[2:], False)  # what `echo2 run` hands the flow: run.id resolved
summary = echo2.flows.train.train.with_options(retries=1, retry_delay_seconds=0)(config=cfg.model_dump(mode="json"))
print("SUMMARY " + json.dumps(summary))
"""


def test_a_retried_flow_run_resumes_its_run(tiny_model, tmp_path):
    """A flow-run retry (the same flow run, run again) continues the run that flow run started, from its last
    checkpoint: with `echo2 run`'s resolved run.id it used to fail with "already exists"."""
    proc = subprocess.run([sys.executable, "-c", RETRIED_FLOW, QUICKSTART,
                           f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=retried", *TINY,
                           "eval.before=false", "eval.after=false"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(proc.stdout.split("SUMMARY ", 1)[1])
    assert summary["run_id"] == "retried" and summary["steps"] == 4
    run = tmp_path / "runs" / "retried"
    events = [json.loads(p.read_text()) for p in (run / "ledger" / "events").glob("*.json")]
    assert [e["step"] for e in events if e["kind"] == "resume"] == [2]
    attempts = sorted((e["attempt"], e["step"]) for e in events if e["kind"] == "flow_run")
    assert [step for _, step in attempts] == [0, 2] and len({e["flow_run_id"] for e in events
                                                              if e["kind"] == "flow_run"}) == 1, attempts
    problems, _ = ledger_audit(open_store(str(run)))
    assert not problems, problems


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (zombies excluded)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(stat.parent.name))
    return out


def test_two_actors_relay_versions_to_each_other(tiny_model, tmp_path):
    echo2("run", str(REPO / "configs" / "quickstart-relay.yaml"),
          # tiny steps take well under a poll interval: publish every 3rd step so that both actors see
          # each version, instead of racing past versions the other one never fetched
          *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=relay", *TINY, "train.max_steps=9",
                "publish.every=3", "train.checkpoint_every=9", "rollout.groups_per_batch=1",
                # mutual TLS as across hosts (loopback alone would be plain HTTP): certificates from the fleet
                "broadcast.tls=on"))
    run = tmp_path / "runs" / "relay"
    logs = "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert logs.count("received and verified") >= 6
    assert re.search(r"from actor\d-\w+ at https://127\.0\.0\.1", logs)  # at least one version came through a peer
    assert "relay refused" not in logs
    manifest = json.loads((run / "policy" / "v000009" / "manifest.json").read_text())
    assert manifest["signature"] and {p["id"][:6] for p in manifest["relay"]["peers"]} == {"actor0", "actor1"}
    assert not list(run.glob("peers/*.json"))  # actors unregister when they stop


def test_lora_run_publishes_only_the_adapter(tiny_model, tmp_path):
    echo2("run", QUICKSTART, *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=lora", *TINY,
                                    "train.lora_rank=4", "train.max_steps=3", "train.checkpoint_every=2"))
    run = tmp_path / "runs" / "lora"
    base = json.loads((run / "policy" / "v000000" / "manifest.json").read_text())
    last = json.loads((run / "policy" / "v000003" / "manifest.json").read_text())
    assert base["weights"] == "full" and last["weights"] == "lora" and last["base_version"] == 0
    shard_bytes = lambda m: sum(f["size"] for f in m["files"] if f["kind"] == "shard")  # noqa: E731
    assert shard_bytes(last) < shard_bytes(base) / 3  # only the adapter travelled
    logs = "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert re.search(r"now generating with policy v[12] ", logs)  # an adapter version, merged by the actor
    # the adapter version exports through the real CLI (whether the merge is right is checked against
    # a trained adapter in tests/e2e/test_learner.py: this run's rewards may carry no signal, leaving B = 0)
    from transformers import AutoModelForCausalLM

    echo2("export", str(run), str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in merged


def test_synchronous_run_generates_nothing_that_is_thrown_away(tiny_model, tmp_path):
    # staleness 0: only rollouts of the learner's current version are usable; an actor must wait for
    # the next version instead of generating a batch that the learner can only drop as stale
    echo2("run", QUICKSTART, *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=sync", *TINY,
                                    "train.staleness=0", "train.max_steps=5", "eval.before=false", "eval.after=false"))
    run = tmp_path / "runs" / "sync"
    entries = [json.loads(p.read_text()) for p in sorted((run / "ledger" / "consumed").glob("step-*.json"))]
    assert len(entries) == 5 and all(e["used"] for e in entries)
    stale = [d for e in entries for d in e["dropped"]]
    assert not stale, stale
    final = json.loads((run / "ledger" / "consumed" / "final.json").read_text())
    assert len(final["dropped"]) <= 1  # at most the batch of the last version, started as the run ended
    # what the run recorded fits the capacity model's inputs (echo2 plan --from-run)
    from echo2.fleet.sizing.fit import fit_run, open_run

    fit = fit_run(open_run(str(run)), skip_steps=1)
    assert fit.workload.staleness == 0 and fit.measured_lag == {0: 1.0} and len(fit.batch_seconds) == 1
    assert fit.workload.dissemination_seconds > 0  # the actor measured how long each version took to arrive
    assert 0 < fit.measured_utilization <= 1 and fit.steps == 3


def test_a_step_larger_than_the_backlog_bound_still_fills(tiny_model, tmp_path):
    # one actor, one group per file, two groups per step, at most one file waiting: the backlog bound
    # must never stop the fleet short of what one step needs, or the learner waits forever
    echo2("run", QUICKSTART, *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=small", *TINY,
                                    "rollout.groups_per_batch=1", "rollout.max_pending_batches=1",
                                    "train.max_steps=2", "train.rollout_timeout_s=30", "eval.before=false",
                                    "eval.after=false"), timeout=240)
    assert (tmp_path / "runs" / "small" / "reports" / "summary.json").exists()


def test_auto_fleet_is_sized_by_the_capacity_model(tiny_model, tmp_path):
    echo2("run", QUICKSTART, *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=auto", *TINY,
                                    "fleet.actors=auto", "fleet.max_actors=2", "train.max_steps=6",
                                    "eval.before=false", "eval.after=false"), timeout=300)
    run = tmp_path / "runs" / "auto"
    events = [json.loads(p.read_text()) for p in (run / "ledger" / "events").glob("*.json")]
    resizes = [e for e in events if e["kind"] == "resize"]
    # sized once (at step 4), by the model fitted to the run, within the cap; the tiny model trains in
    # milliseconds while a version takes a poll interval to arrive, so the model usually asks for the cap
    assert len(resizes) == 1 and resizes[0]["actors_from"] == 1 and resizes[0]["actors_to"] in (1, 2), resizes
    assert "capacity model" in resizes[0]["reason"]
    assert len([e for e in events if e["kind"] == "launch"]) == resizes[0]["actors_to"]


def test_reclaimed_actors_lose_no_rollout_are_replaced_and_a_priced_run_is_billed_as_simulated(tiny_model, tmp_path):
    """The fleet issue's acceptance on the tiny model: spot-like reclaims mid-run (SIGTERM, notice, SIGKILL),
    every one replaced, every committed rollout file accounted for, and local actors priced as a catalog
    offer so the cost report is realistic and says its prices are simulated."""
    echo2("run", QUICKSTART, *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=spot", *TINY,
                                    "fleet.actors=2", "train.max_steps=8", "fleet.reclaim_rate=4",
                                    "fleet.reclaim_burst=0.3", "fleet.notice_s=1", "fleet.seed=3",
                                    "fleet.price_as=aws/g6.xlarge@us-east-1", "fleet.learner_usd_per_hour=1.5",
                                    "eval.before=false", "eval.after=false"), timeout=600)
    run = tmp_path / "runs" / "spot"
    audit = json.loads(echo2("audit", str(run), "--json").stdout)
    assert audit["finished"] and audit["lost"] == 0 and audit["used_twice"] == 0, audit
    assert audit["reclaims"] >= 1 and audit["replacements"] >= audit["reclaims"] and not audit["unreplaced"], audit
    cost = json.loads((run / "reports" / "cost.json").read_text())
    assert cost["simulated_prices"] is True and "simulated prices" in (run / "reports" / "cost.md").read_text()
    assert cost["by_gpu"].get("L4", {}).get("usd", 0) > 0 and cost["by_role"]["learner"]["usd"] > 0
