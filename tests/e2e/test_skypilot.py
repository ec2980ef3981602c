"""The SkyPilot fleet backend (echo2/fleet/backends/skypilot.py) on SkyPilot's real Task, Resources, YAML schema and
optimizer, over the fixture catalog that tests/conftest.py seeds, each run in SkyPilot's own environment (.venv-sky)
through echo2's bridge (sky_bridge.py; tests/support/sky_helper.py); with a test double only where SkyPilot would
reach a cloud (launch, status, job status, down: ``FakeLaunchApi``, which also drops requests on demand and
plays a spot notice), and moto's EC2 telling a spot reclaim from a crash."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
from sky_helper import SkySide, run_once

from echo2.fleet.backends import skypilot_api
from echo2.fleet.backends.skypilot_api import SkyPilotUnavailable, sky_error, sky_python

try:
    SKY_PYTHON = sky_python()
except SkyPilotUnavailable as exc:  # `make setup` builds it
    pytest.skip(str(exc), allow_module_level=True)

from echo2.config import ConfigError, SkyPilotFleetConfig, load_config  # noqa: E402
from echo2.data.ledger import read_events  # noqa: E402
from echo2.data.store.fsspec_store import FsspecStore  # noqa: E402
from echo2.fleet.backends import skypilot_trust  # noqa: E402
from echo2.fleet.backends.base import ActorLaunch, ActorOffer, ActorState  # noqa: E402
from echo2.fleet.backends.reclaims import cloud_end_reason  # noqa: E402
from echo2.fleet.backends.skypilot import SkyPilotBackend, fleet_down, offer_of  # noqa: E402
from echo2.fleet.backends.skypilot_api import Cluster, Launched, SkySdk  # noqa: E402
from echo2.fleet.backends.skypilot_task import (  # noqa: E402
    DEFAULT_TASK_FILE,
    RUN_LABEL,
    build_task,
    cluster_name,
    load_task_config,
    run_label,
)
from echo2.fleet.backends.skypilot_trust import allowed_source_file, remove_staged, stage_actor_source  # noqa: E402
from echo2.fleet.manager import FleetManager  # noqa: E402

RUN = "run-20261201-191000-ab12"
L4_EAST = ActorOffer(provider="aws", instance_type="g6.xlarge", gpu="L4", gpu_count=1, region="us-east-1", spot=True,
                      usd_per_hour=0.31, on_demand_usd_per_hour=0.8048, tokens_per_second=1000.0)
L4_WEST = ActorOffer(provider="aws", instance_type="g6.xlarge", gpu="L4", gpu_count=1, region="us-west-2", spot=True,
                      usd_per_hour=0.28, on_demand_usd_per_hour=0.8048, tokens_per_second=1000.0)
L4_GCP = ActorOffer(provider="gcp", instance_type="g2-standard-4", gpu="L4", gpu_count=1, region="us-central1",
                    spot=True, usd_per_hour=0.22, on_demand_usd_per_hour=0.71, tokens_per_second=1000.0)
A10G = ActorOffer(provider="aws", instance_type="g5.xlarge", gpu="A10G", gpu_count=1, region="us-east-1", spot=True,
                   usd_per_hour=0.45, on_demand_usd_per_hour=1.006, tokens_per_second=1100.0)
ROLE = "arn:aws:iam::123456789012:role/echo2-actor"
SECRET = "relay-s3cr3t-value"
TLS_SECRET = "e2rc1.relay-cert-and-k3y"


def spec(actor_id="actor0-abc123", offer=L4_EAST, alternatives=(L4_WEST, L4_GCP)) -> ActorLaunch:
    return ActorLaunch(actor_id, f"s3://bucket/prefix/runs/{RUN}", ["echo2", "actor"],
                       env={"ECHO2_STORE_OPTIONS": "{}"},
                       secrets={"ECHO2_RELAY_TOKEN": SECRET, "ECHO2_RELAY_TLS": TLS_SECRET},
                       offer=offer,
                       alternatives=alternatives)


REAL_ENABLED_CLOUDS = SkySdk.enabled_clouds


@pytest.fixture(autouse=True)
def enabled_clouds(monkeypatch):
    """Test double of ``sky.enabled_clouds()`` for the real SDK: a request to SkyPilot's API server, which would
    start one here and ask it about clouds no test can reach. A test changes the list to change the answer."""
    clouds = ["aws", "gcp"]
    monkeypatch.setattr(SkySdk, "enabled_clouds", lambda self: list(clouds))
    return clouds


_SKY_SIDE: list[SkySide] = []
_ENV = dict(os.environ)
"""The environment SkyPilot's side starts in: the session's, not that of the test that happens to start it."""


def sky_side() -> SkySide:
    """SkyPilot's side of these tests (tests/support/sky_helper.py served by SkyPilot's Python), started once."""
    if not _SKY_SIDE:
        import atexit

        _SKY_SIDE.append(SkySide(SKY_PYTHON, _ENV))
        atexit.register(_SKY_SIDE[0].close)
    return _SKY_SIDE[0]


@pytest.fixture
def offline_optimizer():
    """SkyPilot's optimizer, offline (enabled clouds and AWS zone ids would ask the clouds), in its own
    environment: ``optimize``."""
    return sky_side()


@pytest.fixture(scope="module")
def source():
    """echo2's source, staged as every actor's workdir is."""
    path = stage_actor_source()
    yield path
    remove_staged(path)


def optimize(task: dict) -> dict:
    """The resources SkyPilot's optimizer takes for ``task`` (as ``build_task`` makes it)."""
    return sky_side().call("optimize", task)


def described(task: dict) -> dict:
    """``task`` as SkyPilot built it into ``sky.Task`` (``sky_bridge.describe_task``)."""
    return sky_side().call("task", task)


class FakeLaunchApi:
    """Test double of SkyPilot's provisioning calls (no cloud is reachable from here). ``launch`` runs
    SkyPilot's real optimizer on the real task, as its API server would, and "provisions" the cheapest
    candidate: a cluster that is UP with its job RUNNING; the test then plays the clouds (capacity, job
    ends, reclaims) on ``table`` and ``jobs``. ``hold`` keeps launches in flight until it is set.
    ``calls`` records launches returned, downs and launch cancellations in the order they reached the "API server".
    ``fail(call, times, exc)`` makes the next ``times`` calls of ``launch``, ``clusters`` or ``job_status`` raise
    ``exc``
    (a dropped request); ``spot_notice`` and ``take`` play a reclaim the way it reaches SkyPilot: the actor
    exits 0 on its notice (job SUCCEEDED), then the machine goes (``ec2``: a moto EC2 client whose instance,
    tagged as SkyPilot tags it, is terminated with the spot state reason)."""

    def __init__(self, *, no_capacity_gpus=(), ec2=None):
        self.no_capacity_gpus = set(no_capacity_gpus)
        self.ec2 = ec2
        self.table: dict[str, Cluster] = {}
        self.jobs: dict[str, str] = {}
        self.downs: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self.sent: set[str] = set()
        self.tasks: dict[str, object] = {}
        self.instances: dict[str, str] = {}
        self.status_calls = 0
        self.failures: dict[str, list[BaseException]] = {"launch": [], "clusters": [], "job_status": []}
        self.hold = threading.Event()
        self.hold.set()

    def launch(self, task, cluster_name, *, idle_minutes):
        self.sent.add(cluster_name)  # the request reached the "API server"
        self.hold.wait(30)
        self._maybe_fail("launch")
        self.tasks[cluster_name] = task
        if {g for c in task["candidates"] for g in (c.get("accelerators") or {})} & self.no_capacity_gpus:
            raise sky_error("ResourcesUnavailableError", f"no capacity for {cluster_name} in any candidate")
        best = optimize(task)
        name_on_cloud = f"{cluster_name}-2ea4"
        if self.ec2 is not None:
            ami = self.ec2.describe_images()["Images"][0]["ImageId"]
            reply = self.ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType=best["instance_type"],
                                           InstanceMarketOptions={"MarketType": "spot"},
                                           TagSpecifications=[{"ResourceType": "instance", "Tags": [
                                               {"Key": "skypilot-cluster-name", "Value": name_on_cloud}]}])
            self.instances[cluster_name] = reply["Instances"][0]["InstanceId"]
        self.table[cluster_name] = Cluster(cluster_name, "UP", dict(best["labels"]), name_on_cloud)
        self.jobs[cluster_name] = "RUNNING"
        self.calls.append(("launched", cluster_name))
        return Launched(1, best["cloud"], best["region"], best["instance_type"], best["use_spot"], name_on_cloud)

    def fail(self, call, times, exc):
        self.failures[call].extend([exc] * times)

    def _maybe_fail(self, call):
        if self.failures[call]:
            raise self.failures[call].pop(0)

    def spot_notice(self, cluster_name):
        """The cloud announces the reclaim: the actor stops cleanly and its job ends with exit 0."""
        self.jobs[cluster_name] = "SUCCEEDED"

    def take(self, cluster_name):
        """The cloud takes the machine: EC2 ends the instance with the spot state reason; the cluster is gone."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.ec2.models import ec2_backends
        from moto.ec2.models.instances import StateReason

        iid = self.instances[cluster_name]
        self.ec2.terminate_instances(InstanceIds=[iid])
        ec2_backends[DEFAULT_ACCOUNT_ID]["us-east-1"].get_instance(iid).state_reason = StateReason(
            "Server.SpotInstanceTermination: Spot instance termination", "Server.SpotInstanceTermination")
        self.table.pop(cluster_name)

    def clusters(self, names):
        self.status_calls += 1
        self._maybe_fail("clusters")
        return [c for n, c in list(self.table.items()) if names is None or n in names]

    def job_status(self, cluster_name, job_id):
        self._maybe_fail("job_status")
        return self.jobs.get(cluster_name)

    def down(self, cluster_name):
        self.calls.append(("down", cluster_name))
        self.downs.append(cluster_name)
        self.table.pop(cluster_name, None)

    def cancel_launch(self, cluster_name):
        """Recorded only: the launch in flight goes on (as one the API server had already begun would)."""
        self.calls.append(("cancel_launch", cluster_name))

    def enabled_clouds(self):
        return list(self.enabled)

    enabled = ("aws", "gcp")


def backend_with(api, **config) -> SkyPilotBackend:
    backend = SkyPilotBackend(SkyPilotFleetConfig(status_poll_s=0.0, **config), run_id=RUN, api=api,
                              end_reason=lambda launched, name: ("crashed", "test: no cloud asked"))
    backend.retry_wait_s = 0.01  # a dropped request is asked again at once here
    return backend


def wait_for(predicate, what, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# --- the task ------------------------------------------------------------------------------------------

def test_the_actor_task_is_a_real_sky_task_with_spot_any_of_ports_labels_and_secrets(source):
    task = described(build_task(spec(), SkyPilotFleetConfig(), run_id=RUN, workdir=source))
    assert task["resources_kind"] == "set" and len(task["resources"]) == 3
    assert {(r["cloud"], r["region"], r["instance_type"]) for r in task["resources"]} == {
        ("aws", "us-east-1", "g6.xlarge"), ("aws", "us-west-2", "g6.xlarge"), ("gcp", "us-central1", "g2-standard-4")}
    for r in task["resources"]:
        assert r["use_spot"] and r["ports"] == ["8443"] and r["accelerators"] == {"L4": 1} and r["disk_size"] == 100
        assert r["labels"] == {RUN_LABEL: RUN, "echo2-actor": "actor0-abc123"}
    envs, secrets = task["yaml"]["envs"], task["yaml"]["secrets"]
    assert envs["ECHO2_RUN_URL"] == f"s3://bucket/prefix/runs/{RUN}"
    assert envs["ECHO2_ACTOR_ID"] == "actor0-abc123"
    assert envs["ECHO2_RELAY_HOST"] == "0.0.0.0" and envs["ECHO2_RELAY_PORT"] == "8443"
    assert envs["ECHO2_PREEMPTION_SOURCE"] == "auto" and envs["ECHO2_ADVERTISE_HOST"] == "auto"
    # the secret travels as a SkyPilot secret only: never an env, and redacted where SkyPilot shows the task
    assert SECRET not in str(envs) and "ECHO2_RELAY_TOKEN" in secrets
    assert TLS_SECRET not in str(envs) and "ECHO2_RELAY_TLS" in secrets  # the relay's certificate + key
    assert SECRET not in str(task["shown"]) and TLS_SECRET not in str(task["shown"])
    assert task["yaml"]["run"].strip().endswith('actor --run "$ECHO2_RUN_URL" --actor-id "$ECHO2_ACTOR_ID"')


def test_every_candidate_carries_the_price_the_plan_bought_as_max_hourly_cost(offline_optimizer, source):
    task = build_task(spec(), SkyPilotFleetConfig(), run_id=RUN, workdir=source)
    # the dearest of the launch's offer and its alternatives (the manager names none dearer than the plan's)
    assert {r["max_hourly_cost"] for r in described(task)["resources"]} == {0.31}
    assert optimize(task)["instance_type"] == "g2-standard-4"  # SkyPilot's optimizer takes the ceiling in its stride
    free = ActorOffer(provider="aws", instance_type="g6.xlarge", gpu="L4", gpu_count=1, region="us-east-1")
    assert {r["max_hourly_cost"] for r in described(build_task(spec(offer=free, alternatives=()), SkyPilotFleetConfig(),
                                                               run_id=RUN, workdir=source))["resources"]} == {None}


def test_candidate_clouds_are_those_skypilot_has_enabled(tmp_path, monkeypatch):
    from echo2.errors import Echo2InputError

    api = FakeLaunchApi()
    api.enabled = ("gcp",)
    config = {"providers": None, "gpus": ["L4", "A100"], "allow_broad_vm_identity": True}
    offers = backend_with(api, **config).offers(0.135)
    assert offers and {o.provider for o in offers} == {"gcp"}
    api.enabled = ("aws", "gcp", "kubernetes")
    assert {o.provider for o in backend_with(api, **config).offers(0.135)} == {"aws", "gcp"}
    api.enabled = ("kubernetes",)
    with pytest.raises(Echo2InputError, match="SkyPilot has none of .* enabled .*sky check"):
        backend_with(api, **config).offers(0.135)
    # the real SDK asks its API server (sky.client.sdk.enabled_clouds, then sky.get) through the bridge: the
    # server's answer played in SkyPilot's environment (tests/support/sky_helper.py)
    monkeypatch.setattr(skypilot_api, "bridge",
                        lambda op, request=None: sky_side().call(op, {"answer": ["aws", "lambda"]}))
    assert REAL_ENABLED_CLOUDS(SkySdk()) == ["aws", "lambda"]


def test_a_task_file_resource_that_would_override_the_candidates_is_refused(source):
    with pytest.raises(ValueError, match="region"):
        build_task(spec(), SkyPilotFleetConfig(), run_id=RUN, workdir=source,
                   task_config={"resources": {"region": "eu-west-1"}, "run": "true"})


def test_names_and_labels_follow_the_clouds_rules():
    for run in (RUN, "Run_1.x", "a" * 80):
        label, name = run_label(run), cluster_name(run, "actor12-abcdef")
        assert len(label) <= 63 and all(c.islower() or c.isdigit() or c == "-" for c in label)
        assert name[0].isalpha() and len(name) <= 50 and all(c.islower() or c.isdigit() or c == "-" for c in name)
    assert run_label(RUN) == RUN and run_label("Run_1") != run_label("run-1")  # folded texts stay apart


def test_the_skypilot_optimizer_takes_the_cheapest_candidate_and_the_ledger_bills_it(offline_optimizer, source):
    task = build_task(spec(), SkyPilotFleetConfig(), run_id=RUN, workdir=source)
    best = optimize(task)
    # fixture catalog: GCP L4 0.18 + g2 host 0.04 = 0.22 spot, under AWS us-west-2 0.28 and us-east-1 0.31
    assert (best["cloud"], best["region"], best["instance_type"]) == ("gcp", "us-central1", "g2-standard-4")
    bought = offer_of(Launched(1, "gcp", "us-central1", "g2-standard-4", True), (L4_EAST, L4_WEST, L4_GCP))
    assert bought == L4_GCP


# --- the backend behind the manager --------------------------------------------------------------------

def manager(tmp_path, api, *, offers=(L4_EAST, L4_WEST, L4_GCP, A10G), sky_config=None, **fleet):
    store = FsspecStore(str(tmp_path / "run"), {})
    make = lambda actor_id, offer: spec(actor_id, offer, ())  # noqa: E731
    backend = backend_with(api, **(sky_config or {}))
    return FleetManager(backend, SkyPilotFleetConfig(**fleet), store, launch_spec=make, offers=list(offers),
                        alternatives=7, unavailable_retry_s=3600), store, backend


def events(store, kind=None):
    out = sorted(read_events(store), key=lambda e: e["ts"])
    return [e for e in out if kind is None or e["kind"] == kind]


def test_launch_starts_then_runs_on_the_offer_skypilot_bought(tmp_path, offline_optimizer):
    api = FakeLaunchApi()
    api.hold.clear()
    fleet, store, backend = manager(tmp_path, api, actors=1, sky_config={"exit_hold_s": 0})
    fleet.start()
    slot = fleet.slots[0]
    # the cheapest per token/s first (GCP), with the interchangeable L4 offers as any_of alternatives
    assert slot.offer == L4_GCP
    launch = events(store, "launch")[0]
    assert launch["cluster"] == cluster_name(RUN, slot.actor_id) and len(launch["candidates"]) == 3
    assert fleet.reconcile()["actors_alive"] == 1 and backend.poll(slot.actor_id).state == ActorState.STARTING
    api.hold.set()
    wait_for(lambda: backend.poll(slot.actor_id).state == ActorState.RUNNING, "the cluster to come up")
    fleet.reconcile()
    running = events(store, "running")
    assert len(running) == 1 and running[0]["provider"] == "gcp" and running[0]["price_usd_per_hour"] == 0.22
    # the job ends (the run finished), and the cluster stays up past exit_hold_s (0 here): exited, released
    # (downed), and replaced
    api.jobs[backend.actors[slot.actor_id].cluster] = "SUCCEEDED"
    fleet.reconcile()
    assert [e["actor_id"] for e in events(store, "exited")] == [slot.actor_id] and len(events(store, "launch")) == 2
    clusters = {a.cluster for a in backend.actors.values()}
    fleet.stop()
    # the replacement's launch may still be under way at stop: its cluster is then downed twice (at once, and
    # again when the launch returns), so what counts is that every cluster got a down, not how many there were
    wait_for(lambda: len(clusters) == 2 and clusters <= set(api.downs), "every cluster to be downed")


def test_no_capacity_is_unavailable_and_the_next_offer_is_taken(tmp_path, offline_optimizer):
    api = FakeLaunchApi(no_capacity_gpus={"L4"})
    fleet, store, backend = manager(tmp_path, api, actors=1)
    fleet.start()
    first = fleet.slots[0]
    wait_for(lambda: backend.poll(first.actor_id).state == ActorState.UNAVAILABLE, "the launch to give up")
    fleet.reconcile()
    unavailable = events(store, "unavailable")
    assert len(unavailable) == 1 and "ResourcesUnavailableError" in unavailable[0]["detail"]
    # every L4 offer was in that launch's any_of: the next launch goes straight to the A10G
    assert fleet.slots[0].offer == A10G
    wait_for(lambda: backend.poll(fleet.slots[0].actor_id).state == ActorState.RUNNING, "the A10G cluster")
    fleet.stop()
    assert api.downs  # the failed launch is downed too: SkyPilot keeps a cluster whose setup failed


def test_a_cluster_gone_is_a_reclaim_or_a_crash_as_the_cloud_says(tmp_path, offline_optimizer):
    api = FakeLaunchApi()
    store = FsspecStore(str(tmp_path / "run"), {})
    reasons = {}
    backend = SkyPilotBackend(SkyPilotFleetConfig(status_poll_s=0.0), run_id=RUN, api=api,
                              end_reason=lambda launched, name: reasons[name])
    fleet = FleetManager(backend, SkyPilotFleetConfig(actors=2, max_restarts=1), store,
                         launch_spec=lambda a, o: spec(a, o, ()), offers=[L4_GCP])
    fleet.start()
    for slot in fleet.slots:
        wait_for(lambda s=slot: backend.poll(s.actor_id).state == ActorState.RUNNING, "clusters up")
    fleet.reconcile()
    a, b = fleet.slots
    reasons[f"{backend.actors[a.actor_id].cluster}-2ea4"] = ("reclaimed", "GCP preempted it")
    reasons[f"{backend.actors[b.actor_id].cluster}-2ea4"] = ("crashed", "no GCP preemption operation names it")
    api.table.pop(backend.actors[a.actor_id].cluster)
    api.table[backend.actors[b.actor_id].cluster] = Cluster(backend.actors[b.actor_id].cluster, "INIT")
    fleet.reconcile()
    assert [e["actor_id"] for e in events(store, "reclaimed")] == [a.actor_id]
    assert [e["actor_id"] for e in events(store, "crashed")] == [b.actor_id]
    assert len(fleet.slots) == 2 and {s.crashes for s in fleet.slots} == {0, 1}  # only the crash counts
    fleet.stop()


@pytest.mark.e2e
def test_ec2_tells_a_spot_reclaim_from_a_crash_for_a_skypilot_cluster():
    moto = pytest.importorskip("moto")
    import boto3
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.instances import StateReason

    with moto.mock_aws():
        ec2 = boto3.client("ec2", region_name="us-east-1")
        ami = ec2.describe_images()["Images"][0]["ImageId"]

        def instance(name_on_cloud):
            reply = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="g6.xlarge",
                                      InstanceMarketOptions={"MarketType": "spot"},
                                      TagSpecifications=[{"ResourceType": "instance", "Tags": [
                                          {"Key": "skypilot-cluster-name", "Value": name_on_cloud}]}])
            return reply["Instances"][0]["InstanceId"]

        reclaimed, crashed = instance("e2-run-a-2ea4"), instance("e2-run-b-2ea4")
        ec2.terminate_instances(InstanceIds=[reclaimed, crashed])
        b = ec2_backends[DEFAULT_ACCOUNT_ID]["us-east-1"]
        b.get_instance(reclaimed).state_reason = StateReason("Server.SpotInstanceTermination: Spot instance "
                                                             "termination", "Server.SpotInstanceTermination")
        b.get_instance(crashed).state_reason = StateReason("Server.InternalError: Internal error",
                                                           "Server.InternalError")
        launched = Launched(1, "aws", "us-east-1", "g6.xlarge", True)
        assert cloud_end_reason(launched, "e2-run-a-2ea4", ec2_client=ec2)[0] == "reclaimed"
        assert cloud_end_reason(launched, "e2-run-b-2ea4", ec2_client=ec2)[0] == "crashed"
    # a cloud with no reason API: a vanished spot cluster is a reclaim, an on-demand one a crash
    assert cloud_end_reason(Launched(1, "lambda", "us-east-1", "gpu_1x_a10", True), "x")[0] == "reclaimed"
    assert cloud_end_reason(Launched(1, "lambda", "us-east-1", "gpu_1x_a10", False), "x")[0] == "crashed"


def test_status_is_one_request_for_every_cluster_and_throttled(tmp_path, offline_optimizer):
    api = FakeLaunchApi()
    backend = SkyPilotBackend(SkyPilotFleetConfig(status_poll_s=3600), run_id=RUN, api=api,
                              end_reason=lambda *a: ("crashed", ""))
    ids = [f"actor{i}-abcdef" for i in range(3)]
    for actor_id in ids:
        backend.launch(spec(actor_id, L4_GCP, ()))
    for actor_id in ids:
        wait_for(lambda a=actor_id: backend.poll(a).state == ActorState.RUNNING, "clusters up")
    calls = api.status_calls
    for _ in range(20):
        for actor_id in ids:
            backend.poll(actor_id)
    assert api.status_calls == calls  # within status_poll_s nothing is asked again
    assert calls <= 3  # at most once per launch that finished after the last refresh


def test_fleet_down_finds_every_cluster_of_the_run_by_its_label(offline_optimizer):
    api = FakeLaunchApi()
    mine = SkyPilotBackend(SkyPilotFleetConfig(), run_id=RUN, api=api)
    other = SkyPilotBackend(SkyPilotFleetConfig(), run_id="another-run", api=api)
    for i in range(2):
        mine.launch(spec(f"actor{i}-aaaaaa", L4_GCP, ()))
    other.launch(spec("actor0-bbbbbb", L4_GCP, ()))
    wait_for(lambda: len(api.table) == 3, "three clusters up")
    # the learner is gone (nothing of `mine` is used): the label alone finds its clusters
    downed = fleet_down(RUN, api)
    assert downed == sorted(cluster_name(RUN, f"actor{i}-aaaaaa") for i in range(2))
    assert list(api.table) == [cluster_name("another-run", "actor0-bbbbbb")]


def test_a_skypilot_fleet_needs_a_store_every_actor_can_reach(tmp_path):
    role = f"fleet.credentials_role_arn={ROLE}"
    with pytest.raises(ConfigError, match=r"skypilot needs a store every actor can reach \(s3:// or gs://\)"):
        load_config(None, ["fleet.backend=skypilot", f"store.url={tmp_path}", role])
    cfg = load_config(None, ["fleet.backend=skypilot", "store.url=s3://bucket/echo2", role,
                             "fleet.providers=[aws]", "fleet.aws_node_profile=echo2-actor-node"])
    assert cfg.fleet.spot and cfg.fleet.relay_port == 8443


def test_make_fleet_mints_scoped_expiring_credentials_and_ranks_catalog_offers(s3_store, s3_server, tmp_path):
    import json

    import boto3

    from echo2.data.relay_certs import RELAY_TLS_ENV, ActorCertificate
    from echo2.data.relay_tokens import RELAY_TOKEN_ENV
    from echo2.data.run_key import run_key
    from echo2.fleet.make import make_fleet

    iam = boto3.client("iam", endpoint_url=s3_server, region_name="us-east-1")
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                      "Principal": {"AWS": "arn:aws:iam::123456789012:root"}}]}
    role_arn = iam.create_role(RoleName="echo2-actor-fleet", AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    store = s3_store.child(f"runs/{RUN}")
    config = SkyPilotFleetConfig(
        actors=2, gpus=["L4", "A10G"], providers=["aws"], aws_node_profile="echo2-actor-node",
        credentials_role_arn=role_arn, credentials_hours=1, sts_endpoint_url=s3_server)
    options = {"endpoint_url": s3_server, "key": "learner-key", "client_kwargs": {"aws_secret_access_key": "x"}}
    fleet = make_fleet(config, store, store_options=options, log_dir=tmp_path, run_key=run_key(RUN, create=True),
                       run_id=RUN, model_params_b=0.135)
    assert fleet.backend.name == "skypilot" and fleet.alternatives == 7
    # catalog offers SkyPilot can launch on the providers named, spot, ranked
    offers = fleet.offers
    assert offers and {o.provider for o in offers} == {"aws"}
    assert all(o.spot and o.gpu in ("L4", "A10G") for o in offers)
    assert [o.usd_per_throughput for o in offers] == sorted(o.usd_per_throughput for o in offers)
    launch = fleet.launch_spec("actor0-abc123", offers[0])
    assert set(launch.secrets) == {RELAY_TOKEN_ENV, RELAY_TLS_ENV, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                   "AWS_SESSION_TOKEN"}
    assert launch.expires_at is not None and 3000 < launch.expires_at - time.time() <= 3600
    # the relay certificate names the actor and stops working with its token and credentials
    cert = ActorCertificate(launch.secrets[RELAY_TLS_ENV])
    assert cert.actor_id == "actor0-abc123"
    assert abs(cert.certificate.not_valid_after_utc.timestamp() - launch.expires_at) < 1
    # the learner's own credentials never travel, not even nested in the store options
    assert json.loads(launch.env["ECHO2_STORE_OPTIONS"]) == {"endpoint_url": s3_server, "client_kwargs": {}}
    assert "learner-key" not in repr(launch.env)
    fleet.stop()


def test_a_skypilot_fleet_that_fits_no_offer_stages_nothing(tmp_path, monkeypatch):
    """``make_fleet`` asks the backend for its offers before it stages echo2's source (``start`` does that):
    a model no offer fits stops the run with nothing staged, and a fitting fleet stages nothing until it starts."""
    from echo2.data.run_key import run_key
    from echo2.errors import Echo2InputError
    from echo2.fleet.make import make_fleet

    monkeypatch.setenv("HOME", str(tmp_path))  # no credential file that would travel anyway
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    staged = []
    monkeypatch.setattr(skypilot_trust, "stage_actor_source", lambda: staged.append(1) or tmp_path / "staged")
    store = FsspecStore(str(tmp_path / "run"), {})
    config = SkyPilotFleetConfig(providers=["aws"], aws_node_profile="echo2-actor-node")
    asked = []
    monkeypatch.setattr(SkySdk, "enabled_clouds", lambda self: asked.append(1) or ["aws"])
    with pytest.raises(Echo2InputError, match="fits a 100000B model"):
        make_fleet(config, store, store_options={}, log_dir=tmp_path, run_key=run_key(RUN, create=True),
                   run_id=RUN, model_params_b=100_000)
    assert not asked  # nor was SkyPilot asked anything (its API server would have started for it)
    fleet = make_fleet(config, store, store_options={}, log_dir=tmp_path, run_key=run_key(RUN, create=True),
                       run_id=RUN, model_params_b=0.135)
    assert fleet.offers and not staged and fleet.backend.workdir is None
    fleet.backend.start()
    fleet.backend.start()
    assert staged == [1] and fleet.backend.workdir == tmp_path / "staged"
    fleet.stop()


@pytest.mark.e2e
def test_a_dry_run_launch_of_the_actor_task_through_skypilots_own_api_server(tmp_path):
    """Real SkyPilot end to end short of provisioning: its API server (started, then stopped again),
    its schema check, optimizer and provisioner's dry run, with AWS answered by moto on loopback; and the
    cluster config it writes uploads no credential file of the operator's."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, str(REPO / "tests/support/skypilot_dryrun.py"), str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] is None, out["error"]
    assert "Dryrun finished" in out["printed"]
    chosen = [line for line in out["printed"].splitlines() if "✔" in line]
    assert len(chosen) == 1 and "AWS (us-west-2" in chosen[0] and "g6.xlarge[Spot]" in chosen[0]  # the cheaper any_of
    assert "relay-s3cr3t-dryrun" not in out["printed"] + proc.stderr  # the secret is never printed
    assert out["server_gone"], out["stop"]
    # what SkyPilot would copy to the VM: its own runtime files only, none of the operator's credentials (the
    # dry run's $HOME has gcloud and Azure ones; without NO_UPLOAD they, and SkyPilot's SSH key to every
    # cluster, are in this list)
    (cluster_yaml,) = out["cluster_yaml"]
    mounts = cluster_yaml.split("file_mounts: {", 1)[1].split("}", 1)[0]
    targets = [line.split(":", 1)[0].strip().strip('"') for line in mounts.strip().splitlines()]
    assert targets and all(t == "~/.sky/sky_ray.yml" or t.startswith("~/.sky/wheels/") for t in targets), mounts


def test_the_learner_task_file_is_a_valid_sky_task_that_starts_echo2_learner():
    task = described({"config": load_task_config(DEFAULT_TASK_FILE.parent / "learner.yaml")})
    assert {r["use_spot"] for r in task["resources"]} == {False}
    assert {tuple(r["accelerators"].items()) for r in task["resources"]} == {(("H100", 8),), (("A100-80GB", 8),)}
    assert 'echo2" learner "$ECHO2_CONFIG" --nproc "$ECHO2_NPROC"' in task["yaml"]["run"]


# --- what reaches an actor VM (issue 18, item 2) -------------------------------------------------------

def test_an_actor_uploads_echo2s_source_alone_whatever_folder_the_learner_runs_in(tmp_path, monkeypatch,
                                                                                   offline_optimizer):
    """Started from $HOME, `workdir: .` rsynced ~/.config/echo2/keys (the run's signing and CA key) to every
    actor VM. The task each launch sends must upload echo2's source and nothing else."""
    home = tmp_path / "home"
    (home / ".config" / "echo2" / "keys").mkdir(parents=True)
    (home / ".config" / "echo2" / "keys" / f"{RUN}.key").write_text("PRIVATE-RUN-KEY")
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text("[default]\naws_secret_access_key = OPERATOR-SECRET\n")
    monkeypatch.chdir(home)  # the learner started from $HOME
    api = FakeLaunchApi()
    backend = backend_with(api)
    backend.launch(spec("actor0-abc123", L4_GCP, ()))
    task = described(wait_for(lambda: api.tasks.get(cluster_name(RUN, "actor0-abc123")), "the launch"))
    assert not task["file_mounts"] and not task["storage_mounts"]  # nothing beside the workdir
    root = Path(task["workdir"])
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    outside = [f for f in files if not allowed_source_file(f)]
    assert not outside, f"the actor's workdir holds files outside echo2's source: {outside[:10]}"
    assert {"pyproject.toml", "echo2/rollout/actor.py", "echo2/cli/__init__.py"} <= set(files)
    for path in root.rglob("*"):
        assert path.suffix not in (".key", ".pem") and not path.is_symlink()
        if path.is_file():
            text = path.read_bytes()
            assert b"PRIVATE-RUN-KEY" not in text and b"OPERATOR-SECRET" not in text
    backend.terminate("actor0-abc123")
    backend.close()
    assert not root.exists()  # the staged copy goes with the backend


def test_a_task_file_may_not_upload_local_files():
    with pytest.raises(ValueError, match="remove `workdir`"):
        SkyPilotBackend(SkyPilotFleetConfig(), run_id=RUN, api=FakeLaunchApi(),
                        task_config={"workdir": ".", "run": "true"})
    with pytest.raises(ValueError, match=r"file_mounts may name buckets .* not ~/keys: ~/.config/echo2/keys"):
        SkyPilotBackend(SkyPilotFleetConfig(), run_id=RUN, api=FakeLaunchApi(),
                        task_config={"file_mounts": {"~/keys": "~/.config/echo2/keys"}, "run": "true"})
    assert "workdir" not in load_task_config(DEFAULT_TASK_FILE)  # the shipped task leaves it to the backend


def recording_bridge(sent: list):
    """``skypilot_api.bridge`` with SkyPilot's SDK stopped at the network call (a test double of the API server's
    side): ``launch`` runs the bridge's real launch in SkyPilot's environment, where ``sky.launch`` appends the
    SkyPilot config override the request body it builds would carry to ``sent`` and sends nothing
    (``tests/support/sky_helper.py``); ``wait`` finds no server."""

    def bridge(op, request=None):
        if op == "launch":
            body = sky_side().call("launch_body", request)
            sent.extend(body["sent"])
            bridge.bodies.append(body)
            return body["answer"]
        if op == "wait":
            raise sky_error("ApiServerConnectionError", "http://127.0.0.1:46599")
        raise AssertionError(f"unexpected bridge call {op}")

    bridge.bodies = []
    return bridge


def test_every_launch_request_tells_skypilot_not_to_upload_any_clouds_credentials(monkeypatch, source):
    """SkyPilot uploads the local credentials of every cloud unless its remote_identity is NO_UPLOAD, a key a
    task's own `config:` cannot set for AWS or GCP in 0.14: the bridge sends it as the client config override
    every SDK request carries. Checked on the request body SkyPilot's SDK builds inside ``sky.launch``."""
    sent = []
    bridge = recording_bridge(sent)
    monkeypatch.setattr(skypilot_api, "bridge", bridge)
    sdk = SkySdk()
    with pytest.raises(skypilot_api.SkyError, match="ApiServerConnectionError|127.0.0.1"):
        sdk.launch(build_task(spec(), SkyPilotFleetConfig(), run_id=RUN, workdir=source), "e2-x", idle_minutes=10)
    (config,) = sent
    clouds = bridge.bodies[0]["clouds"]  # read from SkyPilot's config schema
    assert {"aws", "gcp", "azure", "kubernetes"} <= set(clouds)
    assert {c: config.get(c, {}).get("remote_identity") for c in clouds} == {c: "NO_UPLOAD" for c in clouds}
    # and only inside the launch: the process's own SkyPilot config is left as it was
    assert bridge.bodies[0]["after"].get("aws", {}).get("remote_identity") != "NO_UPLOAD"
    # on AWS a named instance profile replaces SkyPilot's skypilot-v1 (S3 and EC2 full access) and uploads nothing
    sdk = SkySdk(aws_node_profile="echo2-actor-node")
    with pytest.raises(skypilot_api.SkyError):
        sdk.launch(build_task(spec(), SkyPilotFleetConfig(), run_id=RUN, workdir=source), "e2-x", idle_minutes=10)
    assert sent[1]["aws"] == {"remote_identity": "echo2-actor-node"}
    assert sent[1]["gcp"]["remote_identity"] == "NO_UPLOAD"


def test_credential_files_no_setting_keeps_home_stop_the_backend(tmp_path, monkeypatch):
    """Clouds without remote_identity (Lambda here) are uploaded whenever their files exist: refused (asked of
    SkyPilot in its own environment, which reads this $HOME)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert skypilot_trust.files_uploaded_anyway() == []
    skypilot_trust.check_no_credentials_travel()
    (tmp_path / ".lambda_cloud").mkdir()
    (tmp_path / ".lambda_cloud" / "lambda_keys").write_text("api_key = operator-lambda-key\n")
    assert skypilot_trust.files_uploaded_anyway() == [str(tmp_path / ".lambda_cloud" / "lambda_keys")]
    with pytest.raises(RuntimeError, match=r"SkyPilot would copy .*lambda_keys to every actor VM"):
        skypilot_trust.check_no_credentials_travel()


def test_a_skypilot_fleet_without_scoped_actor_credentials_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="fleet.backend skypilot needs fleet.credentials_role_arn") as err:
        load_config(None, ["fleet.backend=skypilot", "store.url=s3://bucket/echo2"])
    assert "\n" not in str(err.value).strip()


# --- a flaky cloud (issue 18, item 6) ------------------------------------------------------------------

def test_a_dropped_status_request_does_not_end_the_run(tmp_path, offline_optimizer, caplog):
    api = FakeLaunchApi()
    fleet, store, backend = manager(tmp_path, api, offers=(L4_GCP,), actors=2, max_restarts=0)
    fleet.start()
    for slot in fleet.slots:
        wait_for(lambda s=slot: backend.poll(s.actor_id).state == ActorState.RUNNING, "clusters up")
    fleet.reconcile()
    ids = [s.actor_id for s in fleet.slots]
    api.fail("clusters", 1, sky_error("ApiServerConnectionError", "http://127.0.0.1:46580"))
    api.fail("job_status", 1, sky_error("ClusterStatusFetchingError", "GCP did not answer"))
    assert fleet.reconcile()["actors_alive"] == 2  # retried within the pass
    # a request that keeps failing: the pass is skipped, nothing is concluded about any actor
    api.fail("clusters", 10, sky_error("ApiServerConnectionError", "http://127.0.0.1:46580"))
    assert fleet.reconcile()["actors_alive"] == 2 and fleet.skipped_passes == 1
    assert "reconcile pass skipped" in caplog.text
    api.failures["clusters"].clear()
    assert fleet.reconcile()["actors_alive"] == 2 and [s.actor_id for s in fleet.slots] == ids
    assert not events(store, "crashed") and not events(store, "exited") and len(events(store, "launch")) == 2
    # an error that is not a dropped request is not hidden
    api.fail("clusters", 1, TypeError("a bug"))
    with pytest.raises(TypeError):
        fleet.reconcile()
    fleet.stop()


def test_a_dropped_launch_request_is_sent_again_and_never_counts_as_a_crash(tmp_path, offline_optimizer):
    api = FakeLaunchApi()
    api.fail("launch", 1, sky_error("ApiServerConnectionError", "http://127.0.0.1:46580"))
    fleet, store, backend = manager(tmp_path, api, offers=(L4_GCP, A10G), actors=1, max_restarts=0)
    fleet.start()
    first = fleet.slots[0].actor_id
    wait_for(lambda: backend.poll(first).state == ActorState.RUNNING, "the launch sent again to come up")
    # a launch that keeps failing: its offers wait unavailable_retry_s, the next is tried; no crash, no FleetFailed
    api.fail("launch", 3, sky_error("ApiServerConnectionError", "http://127.0.0.1:46580"))
    api.table.pop(backend.actors[first].cluster)  # the first is taken (reclaimed, per its end_reason: crashed here)
    backend.end_reason = lambda launched, name: ("reclaimed", "test: taken")
    fleet.reconcile()
    second = fleet.slots[0].actor_id
    wait_for(lambda: backend.poll(second).ended, "the failing launch to give up")
    fleet.reconcile()
    assert [e["actor_id"] for e in events(store, "unavailable")] == [second]
    assert "FleetApiError" in events(store, "unavailable")[0]["detail"] and not events(store, "crashed")
    assert fleet.slots[0].offer == A10G  # the next offer (every L4 was in the failed launch's any_of)
    fleet.stop()


@pytest.mark.e2e
def test_a_spot_notice_then_the_machine_gone_is_a_reclaim_and_replaced_not_a_crash(tmp_path, offline_optimizer):
    """The actor exits 0 on its notice (job SUCCEEDED), then the cloud takes the machine: a reclaim, three times
    over, with max_restarts 0 (a crash would end the run); EC2 (moto) says why the instance ended."""
    moto = pytest.importorskip("moto")
    import boto3

    with moto.mock_aws():
        ec2 = boto3.client("ec2", region_name="us-east-1")
        api = FakeLaunchApi(ec2=ec2)
        store = FsspecStore(str(tmp_path / "run"), {})
        backend = SkyPilotBackend(SkyPilotFleetConfig(status_poll_s=0.0), run_id=RUN, api=api,
                                  end_reason=lambda launched, name: cloud_end_reason(launched, name, ec2_client=ec2))
        fleet = FleetManager(backend, SkyPilotFleetConfig(actors=1, max_restarts=0), store,
                             launch_spec=lambda a, o: spec(a, o, ()), offers=[L4_EAST])
        fleet.start()
        taken = []
        for _ in range(3):
            slot = fleet.slots[0]
            wait_for(lambda s=slot: backend.poll(s.actor_id).state == ActorState.RUNNING, "the cluster up")
            fleet.reconcile()
            cluster = backend.actors[slot.actor_id].cluster
            api.spot_notice(cluster)
            fleet.reconcile()  # exit 0 with the machine still there: not concluded yet
            assert fleet.slots[0].actor_id == slot.actor_id and not events(store, "exited")
            api.take(cluster)
            fleet.reconcile()
            taken.append(slot.actor_id)
            assert fleet.slots[0].actor_id != slot.actor_id and fleet.slots[0].crashes == 0
        reclaimed = events(store, "reclaimed")
        assert [e["actor_id"] for e in reclaimed] == taken
        assert all("SUCCEEDED" in e["detail"] and "EC2 says reclaimed" in e["detail"] for e in reclaimed)
        assert not events(store, "exited") and not events(store, "crashed") and len(events(store, "launch")) == 4
        fleet.stop()  # returns without waiting for launches in flight: theirs must end inside moto's EC2
        wait_for(lambda: all(a.future.done() for a in backend.actors.values()), "the launches in flight to return")


# --- a dead learner (issue 18, item 7) -----------------------------------------------------------------

def test_a_resumed_run_downs_the_clusters_its_previous_learner_left(tmp_path, offline_optimizer):
    api = FakeLaunchApi()
    fleet, store, backend = manager(tmp_path, api, offers=(L4_GCP,), actors=2)
    fleet.start()
    old = [s.actor_id for s in fleet.slots]
    other = SkyPilotBackend(SkyPilotFleetConfig(), run_id="another-run", api=api)
    other.launch(spec("actor0-bbbbbb", L4_GCP, ()))
    wait_for(lambda: len(api.table) == 3, "three clusters up")
    # the learner dies here (nothing stops its fleet); a resumed learner that adopts nothing starts a fleet
    resumed = FleetManager(backend_with(api), SkyPilotFleetConfig(actors=2, adopt_on_resume=False), store,
                           launch_spec=fleet.launch_spec, offers=[L4_GCP])
    resumed.start()
    wait_for(lambda: all(cluster_name(RUN, a) in api.downs for a in old), "the old clusters downed")
    assert cluster_name("another-run", "actor0-bbbbbb") in api.table  # another run's are not touched
    terminated = events(store, "terminated")
    assert sorted(e["actor_id"] for e in terminated) == sorted(old)
    assert all(e["reason"] == "left by the learner before the resume" for e in terminated)
    assert set(old) <= resumed.revoked and len(resumed.slots) == 2
    assert not set(old) & {s.actor_id for s in resumed.slots}
    resumed.stop()
    fleet.stop()


def test_a_resumed_learner_adopts_the_clusters_still_up_and_downs_only_the_one_it_cannot_reach(
        tmp_path, offline_optimizer):
    """Issue 23: the learner dies (nothing stops its fleet); the resumed one adopts the run's clusters that are UP
    with a live job (one ``adopt`` event each, no new launch) and downs only the actor whose cluster is gone
    (``adopt_failed``, then replaced). The cloud is the test double at SkyPilot's API boundary."""
    api = FakeLaunchApi()
    fleet, store, backend = manager(tmp_path, api, offers=(L4_GCP,), actors=3)
    fleet.start()
    wait_for(lambda: len(api.table) == 3, "three clusters up")
    fleet.reconcile()
    old = [s.actor_id for s in fleet.slots]
    api.table.pop(cluster_name(RUN, old[2]))  # taken by the cloud while no learner watched
    resumed = FleetManager(backend_with(api), SkyPilotFleetConfig(actors=3), store, launch_spec=fleet.launch_spec,
                           offers=[L4_GCP])
    resumed.start()
    adopted = events(store, "adopt")
    assert sorted(e["actor_id"] for e in adopted) == sorted(old[:2])
    assert all(e["how"] == "cluster" and e["backend"] == "skypilot" and e["resigned"] is False for e in adopted)
    assert [e["actor_id"] for e in events(store, "adopt_failed")] == [old[2]]
    assert "gone" in events(store, "adopt_failed")[0]["reason"]
    assert not any(cluster_name(RUN, a) in api.downs for a in old[:2])  # the adopted ones keep running
    assert {s.actor_id for s in resumed.slots} >= set(old[:2]) and len(resumed.slots) == 3
    assert old[2] in resumed.revoked and not set(old[:2]) & resumed.revoked
    assert len(events(store, "launch")) == 4  # three at the start, one replacing the actor that could not be reached
    status = resumed.reconcile()  # the adopted are polled through the backend as its own
    assert status["actors_alive"] == 3
    api.jobs[cluster_name(RUN, old[0])] = "FAILED"
    resumed.reconcile()
    assert old[0] in [e["actor_id"] for e in events(store, "crashed")]
    resumed.stop()
    fleet.stop()


def test_an_actor_skypilot_cannot_be_asked_about_at_the_resume_is_stopped_not_left_unmanaged(
        tmp_path, offline_optimizer):
    """A status request that keeps failing at the resume: the actor is not adopted, and not left running with no
    learner managing it (its learner is back, so it would never fall silent): adopt_failed, downed, replaced."""
    api = FakeLaunchApi()
    fleet, store, backend = manager(tmp_path, api, offers=(L4_GCP,), actors=1)
    fleet.start()
    wait_for(lambda: len(api.table) == 1, "the cluster up")
    old = fleet.slots[0].actor_id
    resumed_backend = backend_with(api)
    api.fail("clusters", 3, sky_error("ApiServerConnectionError", "http://127.0.0.1:46580"))
    resumed = FleetManager(resumed_backend, SkyPilotFleetConfig(actors=1), store, launch_spec=fleet.launch_spec,
                           offers=[L4_GCP])
    resumed.start()
    assert [e["actor_id"] for e in events(store, "adopt_failed")] == [old] and not events(store, "adopt")
    assert "failed 3 times" in events(store, "adopt_failed")[0]["reason"]
    wait_for(lambda: cluster_name(RUN, old) in api.downs, "the old cluster downed")
    assert old in resumed.revoked and len(resumed.slots) == 1 and resumed.slots[0].actor_id != old
    resumed.stop()
    fleet.stop()


# --- teardown inside Prefect's grace (issue 18, item 12) -----------------------------------------------

def test_stop_with_launches_in_flight_sends_their_downs_at_once_and_again_when_each_launch_returns(
        tmp_path, offline_optimizer):
    """A cancelled flow run stops its fleet inside Prefect's 30 s grace. The down of a cluster whose launch was
    in flight waited for that launch (minutes on a cloud), and close() for every down (up to 900 s). Now stop()
    returns with the launches still held: each was cancelled and sent its down at once, and its cluster is
    downed again once the launch returns (the first down may have come before the cluster existed)."""
    api = FakeLaunchApi()
    api.hold.clear()  # both launches are under way on the "cloud"
    fleet, store, backend = manager(tmp_path, api, offers=(L4_GCP,), actors=2)
    fleet.start()
    ids = [s.actor_id for s in fleet.slots]
    clusters = [backend.actors[a].cluster for a in ids]
    wait_for(lambda: api.sent == set(clusters), "both launch requests to reach the API server")
    fleet.stop()
    assert not api.hold.is_set()  # stop() returned before either launch did
    assert sorted(api.calls) == sorted([("cancel_launch", c) for c in clusters] + [("down", c) for c in clusters])
    assert sorted(e["actor_id"] for e in events(store, "terminated")) == sorted(ids)
    api.hold.set()  # the launches return (the cancel came too late for them): each cluster is downed again
    wait_for(lambda: all(api.calls.count(("down", c)) == 2 for c in clusters), "a second down after each launch")
    for c in clusters:
        last_down = max(i for i, call in enumerate(api.calls) if call == ("down", c))
        assert api.calls.index(("launched", c)) < last_down
    assert not api.table  # no cluster left up


def test_a_launch_not_yet_sent_when_its_actor_is_terminated_is_never_sent(tmp_path, offline_optimizer):
    """A launch whose request was dropped is sent again; not once its actor was terminated meanwhile."""
    api = FakeLaunchApi()
    api.hold.clear()
    api.fail("launch", 1, sky_error("ApiServerConnectionError", "http://127.0.0.1:46580"))
    backend = backend_with(api)
    backend.launch(spec("actor0-abc123", L4_GCP, ()))
    backend.terminate("actor0-abc123")
    api.hold.set()
    wait_for(lambda: backend.actors["actor0-abc123"].future.done(), "the launch to give up")
    assert "LaunchCancelled" in repr(backend.actors["actor0-abc123"].future.exception())
    backend.close()
    assert ("launched", cluster_name(RUN, "actor0-abc123")) not in api.calls and not api.table


def test_the_sdk_cancels_the_launch_request_under_way_and_nothing_after_it_returned(monkeypatch, source):
    """``SkySdk.cancel_launch`` aborts the cluster's launch request in SkyPilot's API server (``sky.api_cancel``, in
    SkyPilot's environment, stopped at the network call), only while that launch is under way."""
    cancelled, answer = [], threading.Event()

    def bridge(op, request=None):
        if op == "launch":
            return {"request_id": "request-7"}
        if op == "wait":
            answer.wait(30)
            raise sky_error("ApiServerConnectionError", "http://127.0.0.1:46599")
        assert op == "cancel"
        cancelled.extend(sky_side().call("cancel", request))

    monkeypatch.setattr(skypilot_api, "bridge", bridge)
    sdk = SkySdk()
    task = build_task(spec(), SkyPilotFleetConfig(), run_id=RUN, workdir=source)
    launching = threading.Thread(target=lambda: pytest.raises(skypilot_api.SkyError, sdk.launch, task, "e2-x",
                                                              idle_minutes=10))
    launching.start()
    wait_for(lambda: "e2-x" in sdk._launches, "the launch request to be sent")
    sdk.cancel_launch("e2-x")
    assert cancelled == ["request-7"]
    answer.set()
    launching.join()
    sdk.cancel_launch("e2-x")  # the launch has returned: nothing to cancel
    assert cancelled == ["request-7"]


# --- the VM's own identity (issue 18, item 2) ----------------------------------------------------------

VOID = "fleet.allow_broad_vm_identity: true, which voids the actor trust boundary"


def test_a_vm_identity_broader_than_the_actors_credentials_is_refused_in_one_line_each():
    """On AWS, SkyPilot attaches its skypilot-v1 instance profile (S3 and EC2 full access) unless remote_identity
    names one; on GCP 0.14 always attaches its skypilot-v1 service account: an actor there reaches the whole
    bucket through its machine's metadata, whatever its scoped credentials say. It used to be a warning."""
    base = ["fleet.backend=skypilot", "store.url=s3://bucket/echo2", f"fleet.credentials_role_arn={ROLE}"]
    cases = {("fleet.providers=[aws,gcp]", "fleet.aws_node_profile=echo2-actor-node"):
             "fleet.providers includes gcp: SkyPilot gives every GCP VM its skypilot-v1 service account",
             (): "fleet.providers (unset: every provider) includes gcp",
             ("fleet.providers=[aws]",): "fleet.aws_node_profile is not set: every AWS VM would "
                                                  "run under SkyPilot's skypilot-v1 instance profile"}
    for settings, refusal in cases.items():
        with pytest.raises(ConfigError, match=re.escape(refusal)) as err:
            load_config(None, [*base, *settings])
        assert "\n" not in str(err.value).strip() and VOID in str(err.value)
        # the backend refuses the same, for a fleet config built without Config's checks
        fleet = load_config(None, [*base, *settings, "fleet.allow_broad_vm_identity=true"]).fleet
        with pytest.raises(ValueError, match=re.escape(refusal)):
            SkyPilotBackend(fleet.model_copy(update={"allow_broad_vm_identity": False}), run_id=RUN)
    # what is allowed: AWS under the node profile, clouds whose VMs hold no cloud identity, and the opt-out
    load_config(None, [*base, "fleet.providers=[aws,lambda]", "fleet.aws_node_profile=echo2-actor-node"])
    load_config(None, [*base, "fleet.providers=[runpod]"])
    assert load_config(None, [*base, "fleet.allow_broad_vm_identity=true"]).fleet.providers is None


def test_the_opt_out_launches_with_a_warning_and_the_node_profile_reaches_every_launch_request(
        tmp_path, monkeypatch, source, caplog):
    """Through the backend with SkyPilot's real SDK client (stubbed at the network call): the opt-out starts
    with a warning; a node profile is in the config override each launch request carries."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no credential file that would travel anyway
    sent = []

    opted_out = SkyPilotBackend(SkyPilotFleetConfig(allow_broad_vm_identity=True), run_id=RUN)
    assert "allow_broad_vm_identity is set" in caplog.text
    opted_out.close()
    backend = SkyPilotBackend(SkyPilotFleetConfig(providers=["aws"], aws_node_profile="echo2-actor-node"), run_id=RUN)
    monkeypatch.setattr(skypilot_api, "bridge", recording_bridge(sent))
    backend.retry_wait_s = 0.01  # the stub's dropped answer is asked again at once
    backend.launch(spec("actor0-abc123", L4_EAST, (L4_WEST,)))
    wait_for(lambda: backend.actors["actor0-abc123"].future.done(), "the launch request")
    assert sent and all(body["aws"] == {"remote_identity": "echo2-actor-node"} for body in sent)
    backend.close()


@pytest.mark.e2e
def test_the_node_profile_grants_what_skypilots_autodown_calls_and_nothing_of_the_store(s3_server):
    """infra/iam/actor-node-policy.json against the EC2 calls SkyPilot's own autodown makes on the node
    (sky.provision.aws.instance.terminate_instances, run here on moto's EC2 and recorded at botocore): every
    call is granted, and the profile grants nothing outside EC2 (no S3, no IAM, no launches). moto does not
    evaluate the conditions (instance profile, the e2- cluster tag): they are checked on the document."""
    import json

    policy = json.loads((DEFAULT_TASK_FILE.parents[1] / "iam" / "actor-node-policy.json").read_text())
    granted = {a for st in policy["Statement"]
               for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])}
    assert {a.split(":")[0] for a in granted} == {"ec2"} and not {"ec2:RunInstances", "ec2:CreateTags"} & granted
    terminate = next(st for st in policy["Statement"] if "ec2:TerminateInstances" in st["Action"])
    assert terminate["Condition"]["StringLike"] == {"aws:ResourceTag/ray-cluster-name": "e2-*"}
    assert "ec2:InstanceProfile" in terminate["Condition"]["ArnEquals"]
    # SkyPilot's own code, in its environment, against moto's EC2 (a server here: SkyPilot's environment has no moto)
    done = run_once(SKY_PYTHON, "aws_terminate", env={**os.environ, "AWS_ACCESS_KEY_ID": "testing",
                                                      "AWS_SECRET_ACCESS_KEY": "testing",
                                                      "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server})
    calls, state = done["calls"], done["state"]
    assert state in ("shutting-down", "terminated")
    made = set(calls)
    assert {"ec2:DescribeInstances", "ec2:TerminateInstances", "ec2:ModifyInstanceAttribute"} <= made
    assert made - {"sts:GetCallerIdentity"} <= granted, made - granted


def test_an_auto_fleet_launches_the_choosers_mix_each_at_its_planned_price(tmp_path, offline_optimizer):
    """fleet.actors: auto over SkyPilot's catalog offers: the launches are choose_fleet's mix for the workload, each
    launch's candidates no dearer than its planned offer, whose price SkyPilot gets as max_hourly_cost."""
    from echo2.fleet.prices.catalog import Offer, load_profiles
    from echo2.fleet.sizing.autosize import FleetChooser, FleetSize
    from echo2.fleet.sizing.capacity import Workload
    from echo2.fleet.sizing.choose import choose_fleet

    rows = [Offer("aws", "g6.xlarge", "L4", 1, 24.0, "us-east-1", 0.8048, 0.31),
            Offer("aws", "g6.xlarge", "L4", 1, 24.0, "us-west-2", 0.8048, 0.28),
            Offer("gcp", "g2-standard-4", "L4", 1, 24.0, "us-central1", 0.71, 0.22)]
    offers = [ActorOffer.from_catalog(o, True) for o in rows]
    workload = Workload(train_seconds=40.0, groups_per_step=64, groups_per_batch=4, staleness=4,
                        dissemination_seconds=1.0, upload_seconds=0.5)
    sized = FleetSize(0, "test", workload, 4 * 8 * 2048.0)
    plan = choose_fleet(workload, rows, load_profiles(), model_params_b=0.135, batch_tokens=sized.batch_tokens)
    planned = {c.name: n for c, n in plan.fleet}
    assert len(planned) == 2  # a mix

    api = FakeLaunchApi()
    config = SkyPilotFleetConfig(actors="auto", max_actors=32)
    store = FsspecStore(str(tmp_path / "run"), {})
    fleet = FleetManager(backend_with(api), config, store, launch_spec=lambda a, o: spec(a, o, ()), offers=offers,
                         alternatives=7, chooser=FleetChooser.for_offers(offers, config, 0.135), plan_from=sized)
    fleet.start()
    assert {o.name: n for o, n in fleet.mix.items()} == planned
    launched = {}
    for slot in fleet.slots:
        launched[slot.planned.name] = launched.get(slot.planned.name, 0) + 1
    assert launched == planned
    wait_for(lambda: len(api.tasks) == sum(planned.values()), "every launch to reach the API server")
    for slot in fleet.slots:  # each launch's ceiling is its planned offer's price, never a dearer alternative's
        task = described(api.tasks[cluster_name(RUN, slot.actor_id)])
        assert {r["max_hourly_cost"] for r in task["resources"]} == {slot.planned.usd_per_hour}
    fleet.stop()
