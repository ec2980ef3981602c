"""The fleet manager (desired against actual, offers, budget, events) and the local backend's
reclaim injector, with real processes."""

from __future__ import annotations

import sys
import time

import pytest
from fleet_shared import OFFERS, FakeCloud, manager

from echo2.config import LocalFleetConfig
from echo2.data.ledger import read_events
from echo2.data.run_key import run_key
from echo2.data.store.fsspec_store import FsspecStore
from echo2.fleet.backends.base import ActorLaunch, ActorOffer, ActorState, ActorStatus
from echo2.fleet.bill.ledger import fleet_usd
from echo2.fleet.make import make_fleet
from echo2.fleet.manager import FleetFailed, FleetManager

SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.1)"]


def kinds(store):
    return [e["kind"] for e in sorted(read_events(store), key=lambda e: e["ts"])]


def test_cheapest_offer_first_and_the_next_one_when_it_has_no_capacity(tmp_path):
    cloud = FakeCloud(no_capacity={"g2-standard-4"})
    fleet, store = manager(tmp_path, cloud, actors=2)
    fleet.start()
    # the GCP offer is cheaper but has no capacity: both actors run on the AWS one
    assert [s.offer.instance_type for s in fleet.slots] == ["g6.xlarge", "g6.xlarge"]
    events = read_events(store)
    # the second launch does not ask the offer that just had no capacity again (unavailable_retry_s)
    assert sum(e["kind"] == "unavailable" for e in events) == 1
    launches = [e for e in events if e["kind"] == "launch"]
    assert {e["price_usd_per_hour"] for e in launches} == {0.30} and all(e["cluster"] for e in launches)
    assert fleet.usd_per_hour() == pytest.approx(0.60)
    again = FleetManager(FakeCloud(no_capacity={"g2-standard-4"}), LocalFleetConfig(actors=2), store,
                         launch_spec=fleet.launch_spec, offers=OFFERS, unavailable_retry_s=0)
    again.start()  # with no wait it is asked at every launch
    assert sum(e["kind"] == "unavailable" for e in read_events(store)) == 3


def test_a_reclaimed_actor_is_replaced_and_never_counts_as_a_crash(tmp_path):
    cloud = FakeCloud()
    fleet, store = manager(tmp_path, cloud, actors=1, max_restarts=0)
    fleet.start()
    for _ in range(3):
        cloud.states[fleet.slots[0].actor_id] = ActorStatus(ActorState.RECLAIMED, "Server.SpotInstanceTermination")
        status = fleet.reconcile()
        assert status["actors_alive"] == 1
    assert kinds(store).count("reclaimed") == 3 and kinds(store).count("launch") == 4
    cloud.states[fleet.slots[0].actor_id] = ActorStatus(ActorState.CRASHED, "exit code 1")
    with pytest.raises(FleetFailed, match="crashed"):
        fleet.reconcile()


def test_the_budget_is_never_exceeded(tmp_path):
    cloud = FakeCloud()
    fleet, store = manager(tmp_path, cloud, actors=3, max_usd_per_hour=0.5)
    fleet.start()
    assert len(fleet.slots) == 2 and fleet.usd_per_hour() <= 0.5  # a third at $0.22/h would exceed it
    assert "budget" in kinds(store)
    fleet.resize(1, "test")
    assert len(fleet.slots) == 1 and len(cloud.terminated) == 1
    fleet.stop()
    assert len(cloud.terminated) == 2 and kinds(store).count("terminated") == 2


@pytest.mark.e2e
def test_reclaim_injector_takes_real_processes_and_the_manager_replaces_them(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    store = FsspecStore(str(tmp_path / "run"), {})
    config = LocalFleetConfig(actors=2, reclaim_rate=60.0, notice_s=0.5, seed=1)  # ~1/s each
    fleet = make_fleet(config, store, store_options={}, log_dir=tmp_path / "logs", run_key=run_key("r", create=True),
                       actor_command=SLEEPER)
    fleet.start()
    try:
        deadline = time.time() + 60
        while kinds(store).count("reclaimed") < 3 and time.time() < deadline:
            fleet.reconcile()
            time.sleep(0.2)
    finally:
        fleet.stop()
    events = sorted(read_events(store), key=lambda e: e["ts"])
    reclaimed = [e for e in events if e["kind"] == "reclaimed"]
    assert len(reclaimed) >= 3
    # every reclaim is followed by a launch that replaces it
    for r in reclaimed:
        assert any(e["kind"] == "launch" and e["ts"] >= r["ts"] for e in events)
    # a sleeper ignores nothing: SIGTERM ends it, or SIGKILL after the notice; nothing is left running
    assert all(p.poll() is not None for p in fleet.backend.procs.values())
    assert fleet_usd(store) == 0.0  # local processes are free


def test_an_actor_whose_credentials_expire_is_replaced_before_they_do(tmp_path):
    cloud = FakeCloud()
    store = FsspecStore(str(tmp_path / "run"), {})
    lifetimes = iter([60.0, 3600.0])  # the first actor's scoped credentials end within the margin
    spec = lambda actor_id, offer: ActorLaunch(actor_id, store.url, ["echo2", "actor"], offer=offer,  # noqa: E731
                                               expires_at=time.time() + next(lifetimes))
    fleet = FleetManager(cloud, LocalFleetConfig(actors=1, max_restarts=0), store, launch_spec=spec, offers=OFFERS)
    fleet.start()
    first = fleet.slots[0].actor_id
    fleet.reconcile()
    assert cloud.terminated == [first] and fleet.slots[0].actor_id != first and fleet.slots[0].crashes == 0
    terminated = [e for e in read_events(store) if e["kind"] == "terminated"]
    assert [(e["actor_id"], e["reason"]) for e in terminated] == [(first, "credentials expire")]
    fleet.reconcile()  # the replacement's credentials last: it stays
    assert len(cloud.launched) == 2


def test_an_ended_actor_is_released_and_a_launch_names_interchangeable_offers_within_budget(tmp_path):
    cloud = FakeCloud()
    store = FsspecStore(str(tmp_path / "run"), {})
    dear = ActorOffer(provider="aws", instance_type="g6.xlarge", gpu="L4", gpu_count=1, region="eu-west-1", spot=True,
                 usd_per_hour=0.9, on_demand_usd_per_hour=1.2)
    spec = lambda actor_id, offer: ActorLaunch(actor_id, store.url, ["echo2", "actor"], offer=offer)  # noqa: E731
    fleet = FleetManager(cloud, LocalFleetConfig(actors=1, max_usd_per_hour=0.5), store, launch_spec=spec,
                         offers=[*OFFERS, dear], alternatives=7)
    fleet.start()
    # cheapest (GCP) first; the AWS L4 is interchangeable and fits; the eu-west-1 one would exceed the budget
    assert cloud.launched[0].offer == OFFERS[1] and cloud.launched[0].alternatives == (OFFERS[0],)
    cloud.states[fleet.slots[0].actor_id] = ActorStatus(ActorState.CRASHED, "job FAILED")
    fleet.reconcile()
    assert cloud.terminated == [cloud.launched[0].actor_id]  # what is left of it (a VM) goes too


def test_local_actors_run_under_the_configured_interpreter(tmp_path, monkeypatch):
    """``fleet.actor_python``: local actors in an actor-only environment (vLLM's), the learner in its own."""
    import sys

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    store = FsspecStore(str(tmp_path / "run"), {})
    for python, expected in ((None, sys.executable), ("/opt/actor-env/bin/python", "/opt/actor-env/bin/python")):
        config = LocalFleetConfig(actor_python=python)
        fleet = make_fleet(config, store, store_options={}, log_dir=tmp_path / "logs",
                           run_key=run_key("r", create=True))
        spec = fleet.launch_spec("a0", None)  # an unpriced local actor
        assert spec.command[:4] == [expected, "-m", "echo2.cli", "actor"]
        assert "ECHO2_SITE" not in spec.env  # no offer, no placement: its site is not known


def test_a_clean_exit_is_replaced_but_never_counts_as_a_crash(tmp_path):
    """An actor that exits 0 (it left on a spot notice, or the learner went quiet) did nothing wrong: three of
    them must not make the first real crash end the run."""
    cloud = FakeCloud()
    fleet, store = manager(tmp_path, cloud, actors=1, max_restarts=1)
    fleet.start()
    for _ in range(3):
        cloud.states[fleet.slots[0].actor_id] = ActorStatus(ActorState.EXITED, "job SUCCEEDED")
        fleet.reconcile()
    assert fleet.slots[0].crashes == 0 and kinds(store).count("exited") == 3
    cloud.states[fleet.slots[0].actor_id] = ActorStatus(ActorState.CRASHED, "job FAILED")
    fleet.reconcile()  # the first crash of the slot: replaced (max_restarts 1)
    assert fleet.slots[0].crashes == 1
    cloud.states[fleet.slots[0].actor_id] = ActorStatus(ActorState.CRASHED, "job FAILED")
    with pytest.raises(FleetFailed, match="crashed"):
        fleet.reconcile()


def test_a_throttled_sts_delays_a_launch_and_never_ends_the_run(tmp_path):
    """STS answers Throttling (botocore's own retries spent): no actor is launched without its credentials,
    nothing is billed, and the next reconcile launches it; a refusal (AccessDenied) is not hidden."""
    import datetime

    import boto3
    from botocore.exceptions import ClientError
    from botocore.stub import Stubber

    from echo2.fleet.credentials import mint_actor_credentials

    sts = boto3.client("sts", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    stub = Stubber(sts)  # AWS's STS is out of reach here: botocore's own stub of its answers
    expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    ok = {"Credentials": {"AccessKeyId": "ASIA" + "A" * 16, "SecretAccessKey": "s" * 40, "SessionToken": "t" * 40,
                          "Expiration": expires}}
    stub.add_client_error("assume_role", service_error_code="Throttling", service_message="Rate exceeded",
                          http_status_code=400)
    stub.add_response("assume_role", ok)
    stub.add_client_error("assume_role", service_error_code="AccessDenied", service_message="not allowed",
                          http_status_code=403)
    stub.activate()
    store = FsspecStore(str(tmp_path / "runs" / "r1"), {})

    def spec(actor_id, offer):
        creds = mint_actor_credentials("s3://bucket/runs/r1", "r1", actor_id, role_arn="arn:aws:iam::1:role/a",
                                       hours=1, sts_client=sts)
        return ActorLaunch(actor_id, store.url, ["echo2", "actor"], secrets=creds.env, offer=offer,
                           expires_at=creds.expires_at.timestamp())

    cloud = FakeCloud()
    fleet = FleetManager(cloud, LocalFleetConfig(actors=1), store, launch_spec=spec, offers=OFFERS)
    fleet.start()
    assert fleet.slots == [] and cloud.launched == [] and kinds(store) == []  # nothing requested, nothing billed
    assert fleet.reconcile()["actors_alive"] == 1
    assert cloud.launched[0].secrets["AWS_SESSION_TOKEN"] == "t" * 40 and kinds(store) == ["requested", "launch"]
    cloud.states[fleet.slots[0].actor_id] = ActorStatus(ActorState.RECLAIMED, "Server.SpotInstanceTermination")
    with pytest.raises(ClientError, match="AccessDenied"):
        fleet.reconcile()


def test_stop_tells_every_actor_to_stop_before_it_waits_for_any(tmp_path):
    """A cancelled flow run has Prefect's 30 s grace for its checkpoint and the whole teardown: `stop` must
    signal every actor at once, not one grace period (10 s locally, a `sky down` on a cloud) after another.
    Real processes: each one, told to stop, exits cleanly only once all three were told; stopped one at a
    time, the first waits out its grace and is killed."""
    import json as json_

    from helpers import wait_until

    from echo2.fleet.backends.local import LocalBackend

    told, up = tmp_path / "told", tmp_path / "up"
    told.mkdir()
    up.mkdir()
    body = f"""
import os, pathlib, signal, sys, time
told, up = pathlib.Path({str(told)!r}), pathlib.Path({str(up)!r})
def on_term(*_):
    (told / str(os.getpid())).touch()
    while len(list(told.iterdir())) < 3:
        time.sleep(0.05)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
(up / str(os.getpid())).touch()
while True:
    time.sleep(0.1)
"""
    store = FsspecStore(str(tmp_path / "run"), {})
    backend = LocalBackend(LocalFleetConfig(), tmp_path / "logs")
    spec = lambda actor_id, offer: ActorLaunch(actor_id, store.url, [sys.executable, "-c", body], offer=offer)  # noqa: E731
    fleet = FleetManager(backend, LocalFleetConfig(actors=3), store, launch_spec=spec)
    fleet.start()
    try:
        wait_until(lambda: len(list(up.iterdir())) == 3, 60, "every actor to have its handler in place")
    finally:
        fleet.stop()
    codes = {actor_id: proc.returncode for actor_id, proc in backend.procs.items()}
    assert codes and set(codes.values()) == {0}, codes  # -9: waited out its grace, then killed
    ended = [e["actor_id"] for e in read_events(store) if e["kind"] == "terminated"]
    assert sorted(ended) == sorted(codes), json_.dumps(ended)


@pytest.mark.parametrize("s3", [False, True], ids=["local-store", "s3-store"])
def test_a_local_actor_gets_only_the_environment_it_needs(tmp_path, monkeypatch, request, s3):
    """The local backend is not a trust boundary (README), but an actor still gets no more of the learner's
    environment than it needs: not the operator's secrets, not where the run keys live; the credentials of
    its own store's cloud only (an s3:// store's ``AWS_*``). A real actor process reports its environment."""
    import json as json_
    import os

    from helpers import wait_until

    from echo2.data.relay_certs import RELAY_TLS_ENV
    from echo2.data.relay_tokens import RELAY_TOKEN_ENV

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    if not s3:  # the operator's AWS keys, of no use to an actor of a local store
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "operator-aws-secret")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "operator-aws-key-id")
    monkeypatch.setenv("OPERATOR_DB_PASSWORD", "operator-db-password")
    monkeypatch.setenv("HF_TOKEN", "hf_operator_token")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/home/operator/gcp.json")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("ECHO2_TEST_TAG", "env-test")
    dump = [sys.executable, "-c", "import json, os, sys; open(sys.argv[1], 'w').write(json.dumps(dict(os.environ)))",
            str(tmp_path / "env.json")]
    # on moto's S3 on loopback, whose client reads the AWS_* credentials of the environment
    store = request.getfixturevalue("s3_store").child("runs/r") if s3 else FsspecStore(str(tmp_path / "run"), {})
    fleet = make_fleet(LocalFleetConfig(), store, store_options={"endpoint_url": "http://127.0.0.1:9"},
                       log_dir=tmp_path / "logs", run_key=run_key("r", create=True), actor_command=dump)
    fleet.start()
    try:
        wait_until(lambda: (tmp_path / "env.json").exists() and (tmp_path / "env.json").read_text().endswith("}"),
                   60, "the actor to report its environment")
    finally:
        fleet.stop()
    env = json_.loads((tmp_path / "env.json").read_text())
    for name in ("ECHO2_SECRETS", "OPERATOR_DB_PASSWORD", "HF_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS",
                 "PREFECT_HOME", "ECHO2_RUN_KEY"):
        assert name not in env, name
    assert ("AWS_SECRET_ACCESS_KEY" in env and "AWS_ACCESS_KEY_ID" in env) is s3, sorted(env)
    assert env["PATH"] == os.environ["PATH"] and env["HOME"] == os.environ["HOME"]
    assert env["HF_HUB_OFFLINE"] == "1" and env["OMP_NUM_THREADS"] == "1" and env["ECHO2_TEST_TAG"] == "env-test"
    assert json_.loads(env["ECHO2_STORE_OPTIONS"]) == {"endpoint_url": "http://127.0.0.1:9"}
    assert env["ECHO2_SITE"] == "local/local"  # where the ledger places it: a joiner's leaf is found there
    assert env[RELAY_TOKEN_ENV] and env[RELAY_TLS_ENV]  # its own secrets, through its environment


def test_a_fleet_that_fits_no_offer_stops_before_its_backend_starts_anything(tmp_path, monkeypatch):
    """``make_fleet`` asks the backend for its offers before anything of it runs: a local fleet priced as an
    offer the catalog does not have stops with no reclaim injector started; a fitting one starts it in
    ``start``, not when it is built."""
    import threading

    from echo2.errors import Echo2InputError

    def injectors():
        return [t for t in threading.enumerate() if t.name == "echo2-reclaim-injector"]

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    store = FsspecStore(str(tmp_path / "run"), {})
    before = len(injectors())
    with pytest.raises(Echo2InputError, match="fleet.price_as: no offer"):
        make_fleet(LocalFleetConfig(reclaim_rate=60.0, price_as="nowhere/none@void:spot"), store, store_options={},
                   log_dir=tmp_path / "logs", run_key=run_key("r", create=True))
    assert len(injectors()) == before
    fleet = make_fleet(LocalFleetConfig(reclaim_rate=60.0), store, store_options={}, log_dir=tmp_path / "logs",
                       run_key=run_key("r", create=True), actor_command=SLEEPER)
    assert len(injectors()) == before and fleet.backend.manager_options() == {}
    fleet.start()
    assert len(injectors()) == before + 1
    fleet.stop()
    assert len(injectors()) == before


def test_stopping_the_fleet_bills_what_its_actors_read_since_the_last_publish(tmp_path):
    """An actor removes its peer record when it stops, and the learner folds the counters only at a publish:
    without a fold in ``stop`` the bytes read after the last publish (about one version per actor) were lost
    to the bill."""
    from echo2.broadcast import topology
    from echo2.fleet.bill.egress import ReadBytes, read_snapshots

    cloud = FakeCloud()
    fleet, store = manager(tmp_path, cloud, actors=2)
    fleet.start()
    ids = [slot.actor_id for slot in fleet.slots]
    for n, actor in enumerate(ids):
        topology.register(store, actor, "http://127.0.0.1:9", 3, read_bytes={"store": 1000 + n, "peers": {"": 7}})
    fleet.stop()
    assert read_snapshots(store) == {actor: ReadBytes(1000 + n, {"": 7}) for n, actor in enumerate(ids)}
