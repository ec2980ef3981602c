"""The SkyPilot fleet backend (echo2/fleet/skypilot.py) on SkyPilot's real Task, Resources, YAML schema and
optimizer, over the fixture catalog that tests/conftest.py seeds; with a test double only where SkyPilot would
reach a cloud (launch, status, job status, down), and moto's EC2 telling a spot reclaim from a crash."""

from __future__ import annotations

import threading
import time

import pytest

sky = pytest.importorskip("sky", reason="SkyPilot is not installed (the cloud extra: pip install -e '.[cloud]')")

from echo2.config import ConfigError, FleetConfig, SkyPilotFleetConfig, load_config  # noqa: E402
from echo2.data.fsspec_store import FsspecStore  # noqa: E402
from echo2.data.ledger import read_events  # noqa: E402
from echo2.fleet.backend import ActorLaunch, ActorState, Offer  # noqa: E402
from echo2.fleet.manager import FleetManager  # noqa: E402
from echo2.fleet.skypilot import (DEFAULT_TASK_FILE, RUN_LABEL, Cluster, Launched, SkyPilotBackend, build_task,  # noqa: E402
                                  cloud_end_reason, cluster_name, fleet_down, load_task_config, offer_of, run_label)

RUN = "run-20261201-191000-ab12"
L4_EAST = Offer(provider="aws", instance_type="g6.xlarge", gpu="L4", gpu_count=1, region="us-east-1", spot=True,
                usd_per_hour=0.31, on_demand_usd_per_hour=0.8048, tokens_per_second=1000.0)
L4_WEST = Offer(provider="aws", instance_type="g6.xlarge", gpu="L4", gpu_count=1, region="us-west-2", spot=True,
                usd_per_hour=0.28, on_demand_usd_per_hour=0.8048, tokens_per_second=1000.0)
L4_GCP = Offer(provider="gcp", instance_type="g2-standard-4", gpu="L4", gpu_count=1, region="us-central1", spot=True,
               usd_per_hour=0.22, on_demand_usd_per_hour=0.71, tokens_per_second=1000.0)
A10G = Offer(provider="aws", instance_type="g5.xlarge", gpu="A10G", gpu_count=1, region="us-east-1", spot=True,
             usd_per_hour=0.45, on_demand_usd_per_hour=1.006, tokens_per_second=1100.0)
SECRET = "relay-s3cr3t-value"
TLS_SECRET = "e2rc1.relay-cert-and-k3y"


def spec(actor_id="actor0-abc123", offer=L4_EAST, alternatives=(L4_WEST, L4_GCP)) -> ActorLaunch:
    return ActorLaunch(actor_id, f"s3://bucket/prefix/runs/{RUN}", ["echo2", "actor"],
                       env={"ECHO2_STORE_OPTIONS": "{}"}, secrets={"ECHO2_RELAY_TOKEN": SECRET, "ECHO2_RELAY_TLS": TLS_SECRET},
                       offer=offer,
                       alternatives=alternatives)


@pytest.fixture
def offline_optimizer(monkeypatch):
    """SkyPilot's optimizer in this process: enabled clouds and AWS zone ids would ask the clouds."""
    from sky import check
    from sky.catalog import aws_catalog

    monkeypatch.setattr(check, "get_cached_enabled_clouds_or_refresh",
                        lambda *a, **k: [sky.clouds.AWS(), sky.clouds.GCP()])
    monkeypatch.setattr(aws_catalog, "_get_az_mappings", lambda *a, **k: None)


def optimize(task):
    with sky.Dag() as dag:
        dag.add(task)
    sky.Optimizer.optimize(dag, minimize=sky.OptimizeTarget.COST, quiet=True)
    return task.best_resources


class FakeLaunchApi:
    """Test double of SkyPilot's provisioning calls (no cloud is reachable from here). ``launch`` runs
    SkyPilot's real optimizer on the real task, as its API server would, and "provisions" the cheapest
    candidate: a cluster that is UP with its job RUNNING; the test then plays the clouds (capacity, job
    ends, reclaims) on ``table`` and ``jobs``. ``hold`` keeps launches in flight until it is set."""

    def __init__(self, *, no_capacity_gpus=()):
        self.no_capacity_gpus = set(no_capacity_gpus)
        self.table: dict[str, Cluster] = {}
        self.jobs: dict[str, str] = {}
        self.downs: list[str] = []
        self.status_calls = 0
        self.hold = threading.Event()
        self.hold.set()

    def launch(self, task, cluster_name, *, idle_minutes):
        self.hold.wait(30)
        if {g for r in task.resources for g in (r.accelerators or {})} & self.no_capacity_gpus:
            raise sky.exceptions.ResourcesUnavailableError(f"no capacity for {cluster_name} in any candidate")
        best = optimize(task)
        name_on_cloud = f"{cluster_name}-2ea4"
        self.table[cluster_name] = Cluster(cluster_name, "UP", dict(best.labels or {}), name_on_cloud)
        self.jobs[cluster_name] = "RUNNING"
        return Launched(1, str(best.cloud).lower(), best.region, best.instance_type, bool(best.use_spot), name_on_cloud)

    def clusters(self, names):
        self.status_calls += 1
        return [c for n, c in list(self.table.items()) if names is None or n in names]

    def job_status(self, cluster_name, job_id):
        return self.jobs.get(cluster_name)

    def down(self, cluster_name):
        self.downs.append(cluster_name)
        self.table.pop(cluster_name, None)


def backend_with(api, **config) -> SkyPilotBackend:
    return SkyPilotBackend(SkyPilotFleetConfig(status_poll_s=0.0, **config), run_id=RUN, api=api,
                           end_reason=lambda launched, name: ("crashed", "test: no cloud asked"))


def wait_for(predicate, what, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# --- the task ------------------------------------------------------------------------------------------

def test_the_actor_task_is_a_real_sky_task_with_spot_any_of_ports_labels_and_secrets():
    task = build_task(spec(), SkyPilotFleetConfig(), run_id=RUN)
    assert isinstance(task, sky.Task) and isinstance(task.resources, set) and len(task.resources) == 3
    assert {(str(r.cloud).lower(), r.region, r.instance_type) for r in task.resources} == {
        ("aws", "us-east-1", "g6.xlarge"), ("aws", "us-west-2", "g6.xlarge"), ("gcp", "us-central1", "g2-standard-4")}
    for r in task.resources:
        assert r.use_spot and r.ports == ["8443"] and r.accelerators == {"L4": 1} and r.disk_size == 100
        assert r.labels == {RUN_LABEL: RUN, "echo2-actor": "actor0-abc123"}
    assert task.envs["ECHO2_RUN_URL"] == f"s3://bucket/prefix/runs/{RUN}" and task.envs["ECHO2_ACTOR_ID"] == "actor0-abc123"
    assert task.envs["ECHO2_RELAY_HOST"] == "0.0.0.0" and task.envs["ECHO2_RELAY_PORT"] == "8443"
    assert task.envs["ECHO2_PREEMPTION_SOURCE"] == "auto" and task.envs["ECHO2_ADVERTISE_HOST"] == "auto"
    # the secret travels as a SkyPilot secret only: never an env, and redacted where SkyPilot shows the task
    assert SECRET not in str(task.envs) and "ECHO2_RELAY_TOKEN" in task.secrets
    assert TLS_SECRET not in str(task.envs) and "ECHO2_RELAY_TLS" in task.secrets  # the relay's certificate + key
    assert SECRET not in str(task.to_yaml_config(use_user_specified_yaml=True))
    assert TLS_SECRET not in str(task.to_yaml_config(use_user_specified_yaml=True))
    assert task.run.strip().endswith('actor --run "$ECHO2_RUN_URL" --actor-id "$ECHO2_ACTOR_ID"')


def test_a_task_file_resource_that_would_override_the_candidates_is_refused():
    with pytest.raises(ValueError, match="region"):
        build_task(spec(), SkyPilotFleetConfig(), run_id=RUN,
                   task_config={"resources": {"region": "eu-west-1"}, "run": "true"})


def test_names_and_labels_follow_the_clouds_rules():
    for run in (RUN, "Run_1.x", "a" * 80):
        label, name = run_label(run), cluster_name(run, "actor12-abcdef")
        assert len(label) <= 63 and all(c.islower() or c.isdigit() or c == "-" for c in label)
        assert name[0].isalpha() and len(name) <= 50 and all(c.islower() or c.isdigit() or c == "-" for c in name)
    assert run_label(RUN) == RUN and run_label("Run_1") != run_label("run-1")  # folded texts stay apart


def test_the_skypilot_optimizer_takes_the_cheapest_candidate_and_the_ledger_bills_it(offline_optimizer):
    task = build_task(spec(), SkyPilotFleetConfig(), run_id=RUN)
    best = optimize(task)
    # fixture catalog: GCP L4 0.18 + g2 host 0.04 = 0.22 spot, under AWS us-west-2 0.28 and us-east-1 0.31
    assert (str(best.cloud).lower(), best.region, best.instance_type) == ("gcp", "us-central1", "g2-standard-4")
    bought = offer_of(Launched(1, "gcp", "us-central1", "g2-standard-4", True), (L4_EAST, L4_WEST, L4_GCP))
    assert bought == L4_GCP


# --- the backend behind the manager --------------------------------------------------------------------

def manager(tmp_path, api, *, offers=(L4_EAST, L4_WEST, L4_GCP, A10G), **fleet):
    store = FsspecStore(str(tmp_path / "run"), {})
    make = lambda actor_id, offer: spec(actor_id, offer, ())  # noqa: E731
    backend = backend_with(api)
    return FleetManager(backend, FleetConfig(backend="local", **fleet), store, launch_spec=make, offers=list(offers),
                        alternatives=7, unavailable_retry_s=3600), store, backend


def events(store, kind=None):
    out = sorted(read_events(store), key=lambda e: e["ts"])
    return [e for e in out if kind is None or e["kind"] == kind]


def test_launch_starts_then_runs_on_the_offer_skypilot_bought(tmp_path, offline_optimizer):
    api = FakeLaunchApi()
    api.hold.clear()
    fleet, store, backend = manager(tmp_path, api, actors=1)
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
    # the job ends (the run finished): exited, released (downed), and replaced
    api.jobs[backend.actors[slot.actor_id].cluster] = "SUCCEEDED"
    fleet.reconcile()
    assert [e["actor_id"] for e in events(store, "exited")] == [slot.actor_id] and len(events(store, "launch")) == 2
    fleet.stop()
    wait_for(lambda: len(api.downs) == 2, "every cluster to be downed")


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
    fleet = FleetManager(backend, FleetConfig(actors=2, max_restarts=1), store,
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
    with pytest.raises(ConfigError, match=r"skypilot needs a store every actor can reach \(s3:// or gs://\)"):
        load_config(None, ["fleet.backend=skypilot", f"store.url={tmp_path}"])
    cfg = load_config(None, ["fleet.backend=skypilot", "store.url=s3://bucket/echo2"])
    assert cfg.fleet.skypilot.spot and cfg.fleet.skypilot.relay_port == 8443


def test_make_fleet_mints_scoped_expiring_credentials_and_ranks_catalog_offers(s3_store, s3_server, tmp_path):
    import json

    import boto3

    from echo2.data.relay_certs import RELAY_TLS_ENV, ActorCertificate
    from echo2.data.relay_tokens import RELAY_TOKEN_ENV
    from echo2.data.run_key import run_key
    from echo2.fleet.manager import make_fleet

    iam = boto3.client("iam", endpoint_url=s3_server, region_name="us-east-1")
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                      "Principal": {"AWS": "arn:aws:iam::123456789012:root"}}]}
    role_arn = iam.create_role(RoleName="echo2-actor-fleet", AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    store = s3_store.child(f"runs/{RUN}")
    config = FleetConfig(backend="skypilot", actors=2, skypilot=SkyPilotFleetConfig(
        gpus=["L4", "A10G"], providers=["aws", "gcp"], credentials_role_arn=role_arn, credentials_hours=1,
        sts_endpoint_url=s3_server))
    options = {"endpoint_url": s3_server, "key": "learner-key", "client_kwargs": {"aws_secret_access_key": "x"}}
    fleet = make_fleet(config, store, store_options=options, log_dir=tmp_path, run_key=run_key(RUN, create=True),
                       run_id=RUN, model_params_b=0.135)
    assert fleet.backend.name == "skypilot" and fleet.alternatives == 7
    # catalog offers SkyPilot can launch (no GCP accelerator rows without their host VM), spot, ranked
    offers = fleet.offers
    assert offers and {o.provider for o in offers} == {"aws"} and all(o.spot and o.gpu in ("L4", "A10G") for o in offers)
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


def test_a_dry_run_launch_of_the_actor_task_through_skypilots_own_api_server(tmp_path):
    """Real SkyPilot end to end short of provisioning: its API server (started, then stopped again),
    its schema check, optimizer and provisioner's dry run, with AWS answered by moto on loopback."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, str(REPO / "tests" / "skypilot_dryrun.py"), str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] is None, out["error"]
    assert "Dryrun finished" in out["printed"]
    chosen = [line for line in out["printed"].splitlines() if "✔" in line]
    assert len(chosen) == 1 and "AWS (us-west-2" in chosen[0] and "g6.xlarge[Spot]" in chosen[0]  # the cheaper any_of
    assert "relay-s3cr3t-dryrun" not in out["printed"] + proc.stderr  # the secret is never printed
    assert out["server_gone"], out["stop"]


def test_the_learner_task_file_is_a_valid_sky_task_that_starts_echo2_learner():
    task = sky.Task.from_yaml_config(load_task_config(DEFAULT_TASK_FILE.parent / "learner.yaml"))
    assert {r.use_spot for r in task.resources} == {False}
    assert {tuple(r.accelerators.items()) for r in task.resources} == {(("H100", 8),), (("A100-80GB", 8),)}
    assert 'echo2" learner "$ECHO2_CONFIG" --nproc "$ECHO2_NPROC"' in task.run
