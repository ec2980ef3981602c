"""Spot preemption: the actor's notice watcher against a loopback metadata server, and telling a
reclaim from a crash on AWS (moto, in-process) and GCP (a loopback fake of the Compute REST API).

Nothing here reaches a non-loopback address: the watcher is off unless pointed at 127.0.0.1, boto3
talks to moto's in-process mock, and the Compute client is given a 127.0.0.1 api_endpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from preemption_shared import FakeMetadata

from echo2 import preemption
from echo2.config import Config
from echo2.data import layout
from echo2.data.relay_tokens import RELAY_TOKEN_ENV
from echo2.data.rollouts import decode_rollouts
from echo2.data.run_folder import create_run
from echo2.data.store import open_store
from echo2.data.weights import publish_version

REPO = Path(__file__).resolve().parents[2]


# -- a loopback metadata server playing AWS IMDSv2 and GCP's metadata service ------------------------


@pytest.fixture
def metadata():
    fake = FakeMetadata()
    yield fake
    fake.close()


def test_off_unless_configured(monkeypatch):
    monkeypatch.delenv(preemption.SOURCE_ENV, raising=False)
    monkeypatch.delenv(preemption.ENDPOINT_ENV, raising=False)
    assert preemption.resolve(None, None) == ("off", None)
    assert preemption.start_watcher("off", "http://127.0.0.1:1", 0.1, lambda n: None) is None
    assert Config().rollout.preemption_source == "off"
    monkeypatch.setenv(preemption.SOURCE_ENV, "gcp")  # the machine's environment wins over the run config
    assert preemption.resolve("aws", None) == ("gcp", "http://metadata.google.internal")
    monkeypatch.setenv(preemption.ENDPOINT_ENV, "http://127.0.0.1:9/")
    assert preemption.resolve("aws", None) == ("gcp", "http://127.0.0.1:9")
    monkeypatch.setenv(preemption.SOURCE_ENV, "azure")
    with pytest.raises(ValueError, match="azure"):
        preemption.resolve(None, None)


def test_auto_follows_the_cloud_skypilot_says_the_machine_is_on(monkeypatch):
    monkeypatch.setenv(preemption.SOURCE_ENV, "auto")
    monkeypatch.delenv(preemption.ENDPOINT_ENV, raising=False)
    monkeypatch.setenv(preemption.CLUSTER_INFO_ENV, json.dumps({"cluster_name": "c", "cloud": "GCP", "region": "r"}))
    assert preemption.resolve(None, None) == ("gcp", "http://metadata.google.internal")
    monkeypatch.setenv(preemption.CLUSTER_INFO_ENV, json.dumps({"cloud": "Lambda"}))  # no notices in its metadata
    assert preemption.resolve(None, None) == ("off", None)
    monkeypatch.delenv(preemption.CLUSTER_INFO_ENV)
    assert preemption.resolve(None, None) == ("off", None)


@pytest.mark.parametrize("source", ["aws", "gcp"])
def test_the_relay_advertises_the_public_address_the_metadata_gives(metadata, source, monkeypatch):
    from echo2.config import BroadcastConfig
    from echo2.rollout.machine import machine_broadcast

    monkeypatch.setenv(preemption.CLUSTER_INFO_ENV, json.dumps({"cloud": source.upper()}))
    monkeypatch.setenv(preemption.SOURCE_ENV, "auto")
    monkeypatch.setenv(preemption.ENDPOINT_ENV, metadata.url)
    monkeypatch.setenv("ECHO2_RELAY_HOST", "0.0.0.0")
    monkeypatch.setenv("ECHO2_RELAY_PORT", "8443")
    monkeypatch.setenv("ECHO2_ADVERTISE_HOST", "auto")
    got = machine_broadcast(BroadcastConfig())
    assert (got.host, got.port) == ("0.0.0.0", 8443)
    assert got.advertise_host == (FakeMetadata.AWS_IP if source == "aws" else FakeMetadata.GCP_IP)
    monkeypatch.setenv("ECHO2_RELAY_PORT", "84x3")
    with pytest.raises(ValueError, match="not a port number"):
        machine_broadcast(BroadcastConfig())


def test_without_machine_settings_the_run_config_stands(monkeypatch):
    from echo2.config import BroadcastConfig
    from echo2.rollout.machine import machine_broadcast

    for name in ("ECHO2_RELAY_HOST", "ECHO2_RELAY_PORT", "ECHO2_ADVERTISE_HOST"):
        monkeypatch.delenv(name, raising=False)
    config = BroadcastConfig(host="127.0.0.1", port=0)
    assert machine_broadcast(config) is config
    monkeypatch.setenv("ECHO2_ADVERTISE_HOST", "http://evil/")
    with pytest.raises(ValueError, match="no host name or address"):
        machine_broadcast(config)


def test_the_machines_site_comes_from_echo2_site_or_skypilot(monkeypatch):
    """Where a joiner looks for a leaf to fetch from (``topology.guest_sources``): its own site, spelled as plans
    spell it; nothing (the store) where the machine does not say, or says something malformed."""
    from echo2.rollout.machine import machine_site

    monkeypatch.delenv("ECHO2_SITE", raising=False)
    monkeypatch.delenv(preemption.CLUSTER_INFO_ENV, raising=False)
    assert machine_site() is None
    monkeypatch.setenv(preemption.CLUSTER_INFO_ENV, json.dumps({"cloud": "AWS", "region": "us-east-1"}))
    assert machine_site() == "aws/us-east-1"
    monkeypatch.setenv("ECHO2_SITE", "Local/local")  # the fleet's word comes first
    assert machine_site() == "local/local"
    for bad in ("aws", "aws/", "/us-east-1", "aws/us east", "a/b/c"):
        monkeypatch.setenv("ECHO2_SITE", bad)
        assert machine_site() is None, bad


@pytest.mark.parametrize("source", ["aws", "gcp"])
def test_probe_reads_the_notice(metadata, source):
    probe = preemption.MetadataProbe(source, metadata.url)
    assert probe.poll_notice() is None
    metadata.notice = True
    notice = probe.poll_notice()
    assert notice is not None and notice.source == source
    if source == "aws":
        assert json.loads(notice.detail)["action"] == "terminate"
        put = [r for r in metadata.requests if r[0] == "PUT"]
        assert put and put[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == str(preemption.AWS_TOKEN_TTL_S)
        assert len(put) == 1  # the token is reused between checks


def test_watcher_calls_back_once_and_survives_an_unreachable_endpoint(metadata):
    got: list = []
    done = threading.Event()
    dead = preemption.PreemptionWatcher(preemption.MetadataProbe("gcp", "http://127.0.0.1:9", timeout_s=0.5),
                                        lambda n: None, poll_s=0.05).start()
    watcher = preemption.PreemptionWatcher(preemption.MetadataProbe("gcp", metadata.url),
                                           lambda n: (got.append(n), done.set()), poll_s=0.05).start()
    metadata.notice = True
    assert done.wait(30)
    watcher.close()
    assert len(got) == 1 and got[0].detail == "TRUE"
    assert dead.notice is None  # connection refused is logged, never taken for a notice
    dead.close()


# -- an actor process told by the metadata that its machine goes ------------------------------------
def _make_run(tmp_path: Path, tiny_model: Path):
    store = open_store(str(tmp_path / "store" / "runs" / "r1"))
    key = Ed25519PrivateKey.generate()
    config = Config.model_validate({
        "run": {"id": "r1"},
        "rollout": {"group_size": 2, "groups_per_batch": 1, "max_new_tokens": 4, "poll_seconds": 0.05,
                    "preemption_poll_s": 0.05},
        "broadcast": {"mode": "relay", "heartbeat_s": 0.2},
    })
    create_run(store, "r1", config.model_dump(mode="json"), key=key, echo2_version="test")
    aux = {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.is_file() and p.suffix != ".safetensors"}
    publish_version(store, 0, {"w": torch.zeros(4)}, extra_files=aux, shard_mb=1, key=key)
    return store


def _wait(predicate, proc, what: str, limit_s: float = 180.0):
    """Poll until ``predicate()``; fail (not time) if the actor exits or hangs far beyond reason."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert proc.poll() is None, f"actor exited (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("source", ["aws"])
@pytest.mark.e2e
def test_actor_leaves_cleanly_on_a_metadata_notice(tmp_path, tiny_model, metadata, source):
    store = _make_run(tmp_path, tiny_model)
    env = {**os.environ, RELAY_TOKEN_ENV: "e2rt1.not.checked-here", preemption.SOURCE_ENV: source,
           preemption.ENDPOINT_ENV: metadata.url, "PYTHONPATH": str(REPO)}
    log_path = tmp_path / "actor.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "echo2.bench.overlap_actor", "--batch-seconds", "0.2",
                                 "--run", store.url, "--actor-id", "a0"], cwd=REPO, env=env,
                                stdout=log_file, stderr=subprocess.STDOUT)
        try:
            peer = layout.peer_key("a0")
            _wait(lambda: store.exists(peer), proc, "peer record")
            _wait(lambda: any(k.endswith(".arrow") for k in store.list(layout.ROLLOUTS)), proc, "first batch")
            metadata.notice = True
            rc = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = log_path.read_text()
    assert rc == 0, log
    assert "preemption notice" in log, log
    assert not store.exists(layout.peer_key("a0")), "the actor left its peer record behind"
    committed = [k for k in store.list(layout.ROLLOUTS) if k.endswith(".arrow")]
    assert committed
    for key in committed:  # every committed batch is whole; a batch cut short was dropped, not half-written
        assert decode_rollouts(store.get(key)).num_rows > 0
    assert any(r[0] == "PUT" for r in metadata.requests)


# -- telling a reclaim from a crash: AWS on moto ----------------------------------------------------
@pytest.fixture
def ec2(monkeypatch):
    moto = pytest.importorskip("moto")
    import boto3

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with moto.mock_aws():
        yield boto3.client("ec2", region_name="us-east-1")


def _ami(ec2) -> str:
    return ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]


def _spot_instance(ec2) -> tuple[str, str]:
    reply = ec2.request_spot_instances(SpotPrice="1.0", InstanceCount=1,
                                       LaunchSpecification={"ImageId": _ami(ec2), "InstanceType": "t3.micro"})
    request_id = reply["SpotInstanceRequests"][0]["SpotInstanceRequestId"]
    request = ec2.describe_spot_instance_requests(SpotInstanceRequestIds=[request_id])["SpotInstanceRequests"][0]
    return request["InstanceId"], request_id


def _reason(ec2, iid: str, code: str) -> None:
    """What AWS would record (moto never interrupts; see ../shared/NOTES.md, moto 5.2.5)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.instances import StateReason

    ec2_backends[DEFAULT_ACCOUNT_ID]["us-east-1"].get_instance(iid).state_reason = StateReason(f"{code}: x", code)


@pytest.mark.e2e
def test_aws_spot_termination_is_a_reclaim(ec2):
    from echo2.fleet.backends.reclaims import aws_instance_end_reason

    iid, _ = _spot_instance(ec2)
    assert aws_instance_end_reason(ec2, iid) is None  # still running
    ec2.terminate_instances(InstanceIds=[iid])
    _reason(ec2, iid, "Server.SpotInstanceTermination")
    assert ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["StateReason"]["Code"] \
        == "Server.SpotInstanceTermination"
    assert aws_instance_end_reason(ec2, iid) == "reclaimed"


def test_aws_spot_request_status_tells_a_reclaim_behind_a_generic_reason(ec2):
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    from echo2.fleet.backends.reclaims import aws_instance_end_reason

    iid, request_id = _spot_instance(ec2)
    ec2.terminate_instances(InstanceIds=[iid])
    _reason(ec2, iid, "Server.InternalError")
    sr = ec2_backends[DEFAULT_ACCOUNT_ID]["us-east-1"].spot_instance_requests[request_id]
    sr.state, sr._status_code = "closed", "instance-terminated-by-price"
    assert aws_instance_end_reason(ec2, iid) == "reclaimed"


@pytest.mark.e2e
def test_aws_user_terminate_and_crash_and_unknown(ec2):
    from echo2.fleet.backends.reclaims import aws_instance_end_reason

    ours = ec2.run_instances(ImageId=_ami(ec2), MinCount=1, MaxCount=1, InstanceType="t3.micro",
                             InstanceMarketOptions={"MarketType": "spot"})["Instances"][0]["InstanceId"]
    ec2.terminate_instances(InstanceIds=[ours])  # moto records Client.UserInitiatedShutdown
    assert aws_instance_end_reason(ec2, ours) == "terminated"
    crashed = ec2.run_instances(ImageId=_ami(ec2), MinCount=1, MaxCount=1,
                                InstanceType="t3.micro")["Instances"][0]["InstanceId"]
    ec2.terminate_instances(InstanceIds=[crashed])
    _reason(ec2, crashed, "Server.InternalError")
    assert aws_instance_end_reason(ec2, crashed) == "crashed"
    assert aws_instance_end_reason(ec2, "i-0123456789abcdef0") is None


# -- telling a reclaim from a crash: GCP on a loopback Compute REST API ------------------------------
class FakeCompute:
    """Zone operations (two pages) and the aggregated list, with non-preemption operations mixed in:
    the server ignores the filter, so the code under test must check the type itself."""

    def __init__(self):
        self.paths: list[str] = []
        fake = self
        link = "https://www.googleapis.com/compute/v1/projects/p1/zones/{z}/instances/{n}"

        def op(kind, zone, name):
            return {"name": f"op-{name}", "operationType": kind, "targetLink": link.format(z=zone, n=name),
                    "status": "DONE", "zone": zone}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                fake.paths.append(self.path)
                path, _, query = self.path.partition("?")
                if path == "/compute/v1/projects/p1/zones/us-central1-a/operations":
                    if "pageToken=2" in query:
                        body = {"items": [op("compute.instances.preempted", "us-central1-a", "actor-b")]}
                    else:
                        body = {"items": [op("compute.instances.preempted", "us-central1-a", "actor-a"),
                                          op("compute.instances.insert", "us-central1-a", "actor-c")],
                                "nextPageToken": "2"}
                elif path == "/compute/v1/projects/p1/aggregated/operations":
                    body = {"items": {
                        "zones/us-central1-a": {"operations": [
                            op("compute.instances.preempted", "us-central1-a", "actor-a")]},
                        "zones/europe-west4-b": {"operations": [
                            op("compute.instances.preempted", "europe-west4-b", "actor-e"),
                            op("compute.instances.delete", "europe-west4-b", "actor-f")]},
                        "zones/asia-east1-a": {"warning": {"code": "NO_RESULTS_ON_PAGE", "message": "none"}}}}
                else:
                    self.send_response(404)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(b'{"error": {"code": 404, "message": "not found"}}')
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def compute():
    pytest.importorskip("google.cloud.compute_v1",
                        reason="google-cloud-compute is not installed "
                               "(it is in the `cloud` extra: pip install -e '.[cloud]')")
    fake = FakeCompute()
    yield fake
    fake.close()


@pytest.mark.e2e
def test_gcp_preempted_instances_in_a_zone_and_in_all(compute):
    from google.auth.credentials import AnonymousCredentials

    from echo2.fleet.backends.reclaims import gcp_preempted_instances

    found = gcp_preempted_instances("p1", "us-central1-a", api_endpoint=compute.url, credentials=AnonymousCredentials())
    assert found == {"actor-a", "actor-b"}  # both pages, the insert left out
    assert "filter=operationType%3D%22compute.instances.preempted%22" in compute.paths[0]
    everywhere = gcp_preempted_instances("p1", "all", api_endpoint=compute.url, credentials=AnonymousCredentials())
    assert everywhere == {"actor-a", "actor-e"}
    assert compute.paths[-1].startswith("/compute/v1/projects/p1/aggregated/operations?")


def test_a_skypilot_cluster_on_gcp_is_a_reclaim_when_gcp_preempted_its_instance(compute):
    from google.auth.credentials import AnonymousCredentials

    from echo2.fleet.backends.reclaims import cloud_end_reason, gcp_operations_client
    from echo2.fleet.backends.skypilot_api import Launched

    client = gcp_operations_client(zonal=False, api_endpoint=compute.url, credentials=AnonymousCredentials())
    launched = Launched(1, "gcp", "europe-west4", "g2-standard-4", True)
    # SkyPilot names a cluster's GCP instances <name on cloud>-<hash>-head: "actor-e" was preempted, "actor-f" deleted
    assert cloud_end_reason(launched, "actor-e", gcp_project="p1", gcp_client=client)[0] == "reclaimed"
    assert cloud_end_reason(launched, "actor-f", gcp_project="p1", gcp_client=client)[0] == "crashed"
