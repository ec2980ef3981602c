"""Notable ledger events reach Prefect as events (echo2/flows/events.py) through the ledger's listener hook: the hook
itself (a failing listener never fails the write), the mapping, and the real thing: the echo2-train flow against a
local Prefect server, its events read back from the server's API."""

from __future__ import annotations

import http.server
import json
import logging
import subprocess
import sys
import threading
import time

import prefect_server
import pytest
import yaml
from conftest import REPO

from echo2.data import ledger
from echo2.data.store import open_store
from echo2.flows import events


@pytest.fixture
def heard():
    records: list[dict] = []
    ledger.event_listeners.append(records.append)
    yield records
    ledger.event_listeners.remove(records.append)


def test_ledger_listeners_hear_events_and_new_bans_after_the_write(tmp_path, heard):
    store = open_store(str(tmp_path))
    ledger.write_event(store, "reclaimed", "actor0-abc123", detail="spot")
    ledger.write_ban(store, "actor1-def456", "forged digest", 3)
    ledger.write_ban(store, "actor1-def456", "again, after a resume", 5)  # already banned: no second notice
    assert [(r["kind"], r["actor_id"]) for r in heard] == [("reclaimed", "actor0-abc123"), ("banned", "actor1-def456")]
    assert heard[1]["reason"] == "forged digest" and heard[1]["step"] == 3
    assert heard[0] in ledger.read_events(store)  # the listener got what the ledger holds


def test_a_failing_listener_is_logged_once_and_never_fails_the_write(tmp_path, heard, caplog):
    def broken(record):
        raise RuntimeError("no Prefect API")

    ledger.event_listeners.insert(0, broken)
    store = open_store(str(tmp_path))
    try:
        with caplog.at_level(logging.WARNING, logger="echo2.data.ledger"):
            for n in range(3):
                ledger.write_event(store, "budget", "fleet", n=n)
    finally:
        ledger.event_listeners.remove(broken)
    assert len(ledger.read_events(store)) == 3 and [r["n"] for r in heard] == [0, 1, 2]
    assert len([r for r in caplog.records if "listener" in r.getMessage()]) == 1


def test_only_notable_kinds_map_to_prefect_events_with_run_actor_and_a_bounded_payload():
    assert events.prefect_event("r1", {"kind": "launch", "actor_id": "actor0-aaaaaa", "ts": 1.0}) is None
    event = events.prefect_event("r1", {"kind": "reclaimed", "actor_id": "actor0-aaaaaa", "ts": 1.7e9,
                                        "detail": "x" * 5000, "nan": float("nan"), "ids": list(range(500)),
                                        "obj": object()})
    assert event["event"] == "echo2.actor.reclaimed"
    assert event["resource"] == {"prefect.resource.id": "echo2.run.r1", "prefect.resource.name": "r1"}
    assert event["related"] == [{"prefect.resource.id": "echo2.run.r1.actor.actor0-aaaaaa",
                                 "prefect.resource.role": "actor", "prefect.resource.name": "actor0-aaaaaa"}]
    payload = event["payload"]
    assert len(payload["detail"]) <= events.MAX_TEXT + 3 and payload["nan"] == "nan"
    assert len(payload["ids"]) == events.MAX_ITEMS and isinstance(payload["obj"], str)
    json.dumps(payload)
    assert event["occurred"].timestamp() == 1.7e9
    assert events.prefect_event("r1", {"kind": "budget", "actor_id": "fleet"})["related"] == []
    learner = events.prefect_event("r1", {"kind": "learner_left", "actor_id": "learner"})
    assert learner["event"] == "echo2.learner.left" and learner["related"][0]["prefect.resource.role"] == "learner"


FLOW_RUN = r'''
import sys, types
import echo2.flows.train as t
from echo2.data.ledger import write_ban, write_event
from echo2.data.store import open_store

store = open_store(sys.argv[1])
cfg = types.SimpleNamespace(run=types.SimpleNamespace(id="evrun"), learner=types.SimpleNamespace(market="on-demand"))
t._launch = lambda *args: (cfg, False)


class Stages(Exception):
    """Ends the flow where its training would begin: only the events it forwards matter here."""


def watch(cfg):  # the flow's first stage inside its forwarding: the events a run writes, then out
    write_event(store, "reclaimed", "actor0-abc123", detail="preempted " + "x" * 2000, cloud="aws")
    write_event(store, "launch", "actor1-def456")  # routine: the ledger only
    write_ban(store, "actor2-0a0b0c", "forged digest", 3)
    write_ban(store, "actor2-0a0b0c", "banned again by a resumed learner", 4)
    write_event(store, "expelled", "actor2-0a0b0c", reason="banned")
    write_event(store, "budget", "fleet", max_usd_per_hour=1.0, usd_per_hour=0.9, wanted=0.5)
    write_event(store, "learner_notice", "learner", step=3, source="sigterm", deadline_s=30)
    write_event(store, "learner_left", "learner", step=3, reason="notice", checkpoint_step=3)
    raise Stages()


t.RunWatch = watch
try:
    t.train()
except Stages:
    pass
write_event(store, "reclaimed", "actor9-999999")  # after the flow run: not forwarded
print("flow done")
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, env = prefect_server.start(tmp_path_factory.mktemp("prefect") / "home")
    yield env
    prefect_server.stop(proc)


@pytest.mark.e2e
def test_the_flow_sends_notable_events_to_a_prefect_server(server, tmp_path):
    out = subprocess.run([sys.executable, "-c", FLOW_RUN, str(tmp_path / "store")], cwd=REPO, env=server,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "flow done" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    wanted = ["echo2.actor.reclaimed", "echo2.actor.banned", "echo2.actor.expelled", "echo2.fleet.budget",
              "echo2.learner.notice", "echo2.learner.left"]
    got = [e for e in prefect_server.read_events(server, "echo2.", len(wanted))
           if e["resource"]["prefect.resource.id"] == "echo2.run.evrun"]
    assert sorted(e["event"] for e in got) == sorted(wanted), [e["event"] for e in got]
    by_name = {e["event"]: e for e in got}
    reclaimed = by_name["echo2.actor.reclaimed"]
    assert reclaimed["resource"] == {"prefect.resource.id": "echo2.run.evrun", "prefect.resource.name": "evrun"}
    related = {r["prefect.resource.id"]: r for r in reclaimed["related"]}
    assert related["echo2.run.evrun.actor.actor0-abc123"]["prefect.resource.role"] == "actor"
    assert any(r["prefect.resource.role"] == "flow-run" for r in reclaimed["related"])  # Prefect links the flow run
    assert reclaimed["payload"]["actor_id"] == "actor0-abc123" and reclaimed["payload"]["cloud"] == "aws"
    assert len(reclaimed["payload"]["detail"]) <= events.MAX_TEXT + 3
    banned = by_name["echo2.actor.banned"]["payload"]
    assert banned["reason"] == "forged digest" and banned["step"] == 3  # the first ban only
    assert by_name["echo2.fleet.budget"]["payload"]["max_usd_per_hour"] == 1.0
    assert by_name["echo2.learner.left"]["payload"]["checkpoint_step"] == 3


BAN = r'''
import sys
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from echo2.data.ledger import write_ban
from echo2.data.store import open_store
from echo2.flows.events import forward_run_events

if sys.argv[1] == "block":  # where the notification goes: the test's own loopback listener
    hook = CustomWebhookNotificationBlock(name="echo2-test", url=sys.argv[2], json_data={"subject": "{{subject}}",
                                          "body": "{{body}}"}, allow_private_urls=True)
    print(hook.save("echo2-test-hook"))
else:
    with forward_run_events("autorun"):
        write_ban(open_store(sys.argv[2]), "actor3-abcdef", "forged digest", 7)
'''


@pytest.mark.e2e
def test_the_shipped_automation_notifies_of_a_banned_actor(server, tmp_path):
    """infra/prefect/automation-actor-banned.yaml, its block id filled in, created with Prefect's CLI; a ban in the
    ledger reaches a webhook notification block served on loopback, through the server's triggers and actions."""
    received: list[dict] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        def script(*args):
            out = subprocess.run([sys.executable, "-c", BAN, *args], cwd=REPO, env=server, capture_output=True,
                                 text=True, timeout=300)
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
            return out.stdout.strip()

        block_id = script("block", f"http://127.0.0.1:{httpd.server_address[1]}/hook").splitlines()[-1]
        automation = yaml.safe_load((REPO / "infra" / "prefect" / "automation-actor-banned.yaml").read_text())
        automation["actions"][0]["block_document_id"] = block_id
        path = tmp_path / "automation.yaml"
        path.write_text(yaml.safe_dump(automation))
        subprocess.run([prefect_server.PREFECT, "automation", "create", "--from-file", str(path)], env=server,
                       check=True, capture_output=True, timeout=120)
        time.sleep(2)  # the server's triggers load the new automation
        script("ban", str(tmp_path / "store"))
        deadline = time.monotonic() + 90
        while not received and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        httpd.shutdown()
    assert received, "no notification reached the webhook"
    assert received[0]["subject"] == "echo2 run autorun: actor actor3-abcdef banned"
    assert received[0]["body"] == "Banned at step 7: forged digest"
