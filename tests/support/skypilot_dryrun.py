"""A dry-run launch of the actor task through SkyPilot's real API server, with AWS played by moto on
loopback (run by tests/e2e/test_skypilot.py in a process of its own, whose environment the bridge's SkyPilot
process and the API server it starts inherit: SkyPilot reads $HOME and $SKY_RUNTIME_DIR when it is imported).
The launch goes as echo2 sends every launch: through sky_bridge.py in SkyPilot's own environment
(``skypilot_api.bridge``). Prints one JSON line: what SkyPilot printed, and whether its API server is gone again.
Usage: python tests/support/skypilot_dryrun.py WORKDIR"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PORT = 46599  # off a developer's own API server (46580)
SECRET = "relay-s3cr3t-dryrun"
OPERATOR_SECRET = "operator-cloud-credential"


def main(root: Path) -> None:
    home = root / "home"
    catalogs = home / ".sky" / "catalogs" / "v8"
    shutil.copytree(REPO / "tests" / "fixtures" / "skypilot-catalog" / "v8", catalogs, dirs_exist_ok=True)
    # the AMI moto has, under the tags SkyPilot looks images up by; quota codes so nothing is downloaded
    rows = ["Tag,Region,OS,OSVersion,ImageId,CreationDate,BaseImageId"]
    for region in ("us-east-1", "us-west-2"):
        for tag in ("custom-gpu-ubuntu-cuda13", "custom-cpu-ubuntu", "custom-gpu-ubuntu", "gpu-ubuntu-2204",
                    "cpu-ubuntu-2204"):
            rows.append(f"skypilot:{tag},{region},ubuntu,22.04,ami-03cf127a,20240101,ami-03cf127a")
    (catalogs / "aws" / "images.csv").write_text("\n".join(rows) + "\n")
    (catalogs / "aws" / "instance_quota_mapping.csv").write_text(
        "InstanceType,SpotInstanceCode,OnDemandInstanceCode\ng6.xlarge,L-3819A6DF,L-DB2E81BA\n")
    # the operator's own cloud credentials, as SkyPilot finds them on the API server's machine: none may travel
    for folder, name in ((".config/gcloud", "credentials.db"), (".azure", "msal_token_cache.json")):
        (home / folder).mkdir(parents=True, exist_ok=True)
        (home / folder / name).write_text(OPERATOR_SECRET)
    shims = root / "bin"
    shims.mkdir(exist_ok=True)
    if shutil.which("rsync") is None:  # SkyPilot checks for rsync even for a dry run
        (shims / "rsync").write_text("#!/bin/sh\nexit 0\n")
        (shims / "rsync").chmod(0o755)

    from moto.server import ThreadedMotoServer

    from echo2.fleet.backends.skypilot_api import bridge, sky_python

    sky_bin = Path(sky_python()).parent  # SkyPilot's environment: its `sky` command, and the API server's Python

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    moto.start()
    host, port = moto.get_host_and_port()
    # the API server SkyPilot starts inherits this environment: fake keys, AWS on loopback only
    os.environ.update(HOME=str(home), SKY_RUNTIME_DIR=str(home), AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}", SKYPILOT_API_SERVER_LOCAL_PORT=str(PORT),
                      SKYPILOT_DISABLE_USAGE_COLLECTION="1",
                      PATH=f"{shims}:{sky_bin}:{os.environ['PATH']}")
    from echo2.config import SkyPilotFleetConfig
    from echo2.fleet.backends.base import ActorLaunch, ActorOffer
    from echo2.fleet.backends.skypilot_task import build_task
    from echo2.fleet.backends.skypilot_trust import remove_staged, stage_actor_source

    east = ActorOffer(provider="aws", instance_type="g6.xlarge", gpu="L4", gpu_count=1, region="us-east-1", spot=True,
                 usd_per_hour=0.31)
    west = ActorOffer(provider="aws", instance_type="g6.xlarge", gpu="L4", gpu_count=1, region="us-west-2", spot=True,
                 usd_per_hour=0.28)
    spec = ActorLaunch("actor0-abc123", "s3://bucket/runs/r1", ["echo2", "actor"], env={"ECHO2_STORE_OPTIONS": "{}"},
                       secrets={"ECHO2_RELAY_TOKEN": SECRET, "ECHO2_RELAY_TLS": "e2rc1." + SECRET},
                       offer=east, alternatives=(west,))
    source = stage_actor_source()
    task = build_task(spec, SkyPilotFleetConfig(), run_id="r1", workdir=source)
    started = time.time()
    printed, error = "", None
    try:  # as SkySdk.launch sends it (remote_identity NO_UPLOAD for every cloud), but a dry run
        sent = bridge("launch", {"task": task, "cluster_name": "e2-r1-actor0-abc123", "idle_minutes": 10,
                                 "dryrun": True})
        streamed = bridge("wait", {"request_id": sent["request_id"], "stream": True})
        printed, result = streamed["printed"], streamed["result"]
    except Exception as exc:  # reported, not raised: the server must be stopped either way
        error, result = f"{type(exc).__name__}: {exc}", None
        log = home / ".sky" / "api_server" / "server.log"  # the test's HOME goes with its tmp_path: show why here
        if log.exists():
            error += "\n--- the API server's log, last lines:\n" + "\n".join(log.read_text().splitlines()[-40:])
    finally:
        stop = subprocess.run([str(sky_bin / "sky"), "api", "stop"], capture_output=True,
                              text=True, timeout=120)
        moto.stop()
        remove_staged(source)
    time.sleep(1)
    with socket.socket() as s:
        server_gone = s.connect_ex(("127.0.0.1", PORT)) != 0
    # the cluster config the provisioner wrote for the launch: its file_mounts are what would reach the VM
    cluster_yaml = [p.read_text() for p in (home / ".sky" / "generated").glob("e2-r1-actor0-abc123.yml*")]
    print(json.dumps({"printed": printed, "result": result, "error": error, "seconds": time.time() - started,
                      "stop": stop.stdout + stop.stderr, "server_gone": server_gone, "cluster_yaml": cluster_yaml}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
