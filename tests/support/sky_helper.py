"""SkyPilot's side of the SkyPilot tests. SkyPilot lives in an environment of its own (``.venv-sky``: it never shares
echo2's), so what the tests check inside SkyPilot's process -- its optimizer on the fixture catalog, the request
bodies its SDK builds, its AWS autodown's EC2 calls -- runs here, under SkyPilot's Python, through echo2's own
bridge code (``echo2/fleet/backends/sky_bridge.py``, loaded from its file: SkyPilot's environment has no echo2).

``python tests/support/sky_helper.py OP`` answers one JSON request on stdin with one JSON line on stdout; ``serve``
answers one ``{"op", "request"}`` line after another (SkyPilot is imported once). ``SkySide`` is the tests' end: it
imports the standard library only."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BRIDGE = REPO / "echo2" / "fleet" / "backends" / "sky_bridge.py"


# -- the tests' end (echo2's environment) --------------------------------------------------------------------
class SkySide:
    """This file served by SkyPilot's Python ``python`` (in the environment ``env``): ``call(op, request)``, one
    request at a time (any thread); ``close`` ends it."""

    def __init__(self, python: str, env: dict | None = None):
        self.proc = subprocess.Popen([python, str(Path(__file__)), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.lock = threading.Lock()

    def call(self, op: str, request: dict | None = None):
        with self.lock:
            self.proc.stdin.write(json.dumps({"op": op, "request": request or {}}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tests/support/sky_helper.py ended before answering {op} (its stderr is the test's)")
        return unpack(json.loads(line))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_once(python: str, op: str, request: dict | None = None, env: dict | None = None):
    """``op`` in a process of its own (``env``: its environment, for what SkyPilot reads when imported)."""
    proc = subprocess.run([python, str(Path(__file__)), op], input=json.dumps(request or {}), capture_output=True,
                          text=True, timeout=300, env=env)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"tests/support/sky_helper.py {op} gave no answer: {proc.stderr[-3000:]}"
    return unpack(json.loads(lines[-1]))


def unpack(answer: dict):
    if "error" in answer:
        raise RuntimeError(f"SkyPilot's side: {answer['error']}")
    return answer["result"]


# -- SkyPilot's side -----------------------------------------------------------------------------------------
def bridge_module():
    spec = importlib.util.spec_from_file_location("sky_bridge", BRIDGE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def op_optimize(request: dict):
    """SkyPilot's optimizer on the task (the fixture catalog, offline: the enabled clouds are AWS and GCP, and AWS
    zone ids are not asked for): the resources it takes."""
    import sky
    from sky import check
    from sky.catalog import aws_catalog

    task = bridge_module().make_task(request)
    with patched(check, "get_cached_enabled_clouds_or_refresh", lambda *a, **k: [sky.clouds.AWS(), sky.clouds.GCP()]), \
            patched(aws_catalog, "_get_az_mappings", lambda *a, **k: None):
        with sky.Dag() as dag:
            dag.add(task)
        sky.Optimizer.optimize(dag, minimize=sky.OptimizeTarget.COST, quiet=True)
    best = task.best_resources
    return {"cloud": str(best.cloud).lower(), "region": best.region, "instance_type": best.instance_type,
            "use_spot": bool(best.use_spot), "labels": dict(best.labels or {})}


def op_task(request: dict):
    """The bridge's ``task``: the task as SkyPilot built it, described back."""
    return bridge_module().op_task(request)


def _client_side():
    from sky.utils import annotations

    return patched(annotations, "is_on_api_server", False)  # what SkyPilot's client-API wrapper sets


def op_launch_body(request: dict):
    """The bridge's ``launch`` with SkyPilot's SDK stopped at the network call: the config override the request
    body it builds would carry, that of a request made after it, and the clouds SkyPilot's config schema gives
    ``remote_identity`` (read here apart from the bridge's own list)."""
    import sky
    from sky.server.requests import payloads
    from sky.utils import registry, schemas

    sent = []

    def launch(task, **kwargs):
        sent.append(payloads.RequestBody().override_skypilot_config)
        return "request-1"

    with _client_side(), patched(sky, "launch", launch):
        answer = bridge_module().op_launch(request)
        after = payloads.RequestBody().override_skypilot_config
    sections = schemas.get_config_schema()["properties"]
    clouds = [c for c in registry.CLOUD_REGISTRY if "remote_identity" in sections.get(c, {}).get("properties", {})]
    return {"sent": sent, "after": after, "clouds": clouds, "answer": answer}


def op_cancel(request: dict):
    """The bridge's ``cancel`` with ``sky.api_cancel`` stopped at the network call: the requests it would cancel."""
    import sky

    cancelled = []
    with _client_side(), patched(sky, "api_cancel", lambda request_id, silent=False: cancelled.append(request_id)):
        bridge_module().op_cancel(request)
    return cancelled


def op_enabled_clouds(request: dict):
    """The bridge's ``enabled_clouds`` with the API server's answer played (``request["answer"]``)."""
    import sky
    from sky.client import sdk

    with patched(sdk, "enabled_clouds", lambda *a, **k: "request-1"), \
            patched(sky, "get", lambda r: request["answer"] if r == "request-1" else None):
        return bridge_module().op_enabled_clouds({})


def op_aws_terminate(request: dict):
    """SkyPilot's own autodown on the node (``sky.provision.aws.instance.terminate_instances``) against the EC2 of
    ``$AWS_ENDPOINT_URL`` (moto's server), each call recorded at botocore: the calls made, and the instance's
    state after."""
    import boto3
    import botocore.client
    import sky
    from sky.provision.aws import instance as aws_instance

    ec2 = boto3.client("ec2", region_name="us-east-1")
    group = ec2.create_security_group(GroupName="sky-sg-e2-run-actor0", Description="its ports")["GroupId"]
    # SkyPilot's default group exists: the node moves itself there first (Case 3 of terminate_instances)
    ec2.create_security_group(GroupName=sky.clouds.aws.DEFAULT_SECURITY_GROUP_NAME, Description="SkyPilot's")
    ami = ec2.describe_images()["Images"][0]["ImageId"]
    iid = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, SecurityGroupIds=[group], TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": "ray-cluster-name", "Value": "e2-run-actor0-2ea4"}]}],
    )["Instances"][0]["InstanceId"]
    calls = []
    make_api_call = botocore.client.BaseClient._make_api_call

    def recording(client, operation, params):
        calls.append(f"{client.meta.service_model.endpoint_prefix}:{operation}")
        return make_api_call(client, operation, params)

    with patched(botocore.client.BaseClient, "_make_api_call", recording):
        aws_instance.terminate_instances("e2-run-actor0-2ea4", {
            "region": "us-east-1", "security_group": {"GroupName": "sky-sg-e2-run-actor0", "ManagedBySkyPilot": True}})
    state = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]
    return {"calls": calls, "state": state}


OPS = {name[3:]: fn for name, fn in globals().items() if name.startswith("op_")}


def answer(op: str, request: dict) -> dict:
    try:
        return {"result": OPS[op](request)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str]) -> None:
    out = os.fdopen(os.dup(1), "w")  # answers alone on stdout; SkyPilot's own output goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if argv == ["serve"]:
        for line in sys.stdin:
            message = json.loads(line)
            out.write(json.dumps(answer(message["op"], message["request"]), default=str) + "\n")
            out.flush()
    else:
        out.write(json.dumps(answer(argv[0], json.loads(sys.stdin.read() or "{}")), default=str) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
