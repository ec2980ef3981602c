"""Chaos scenario 6 (things going wrong): S3 behind a proxy that fails requests and has an outage mid-run;
learner and actors ride it out, nothing is lost."""

from __future__ import annotations

import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, result_row


def store_faults(workdir: Path, quick: bool = False) -> dict:
    """S3 (moto's server) behind a proxy that fails 10% of requests (503 SlowDown, 500, dropped connections)
    and has one outage of 30 s (10 s quick) mid-run: learner and actors ride it out, nothing is lost."""
    import secrets as _secrets

    import boto3

    from echo2.chaos.s3_proxy import FaultyS3Proxy

    model = h.tiny_model(workdir)
    key, secret = f"AKIACHAOS{_secrets.token_hex(6).upper()}", _secrets.token_hex(20)
    moto = h.MotoServer()
    proxy = FaultyS3Proxy(moto.url, fail_rate=0.1, seed=3)
    outage_s = 10 if quick else 30
    outages: list[float] = []
    try:
        moto.bucket("echo2-chaos", key, secret)
        url = proxy.start()
        direct = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1", aws_access_key_id=key,
                              aws_secret_access_key=secret)

        def inject(_proc):  # the outage once step 2 is in the ledger (read past the proxy)
            if outages:
                return
            found = direct.list_objects_v2(Bucket="echo2-chaos", Prefix="chaos/runs/s3/ledger/consumed/step-000002")
            if found.get("KeyCount"):
                proxy.outage(outage_s)
                outages.append(time.time())

        env = h.environment(workdir, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret,
                            AWS_DEFAULT_REGION="us-east-1")
        code = h.run_cli(["run", h.QUICKSTART, *h.sets(f"model.name={model}", "store.url=s3://echo2-chaos/chaos",
                                                      f"store.options={{endpoint_url: {url}}}", "run.id=s3", *h.TINY,
                                                      f"train.max_steps={6 if quick else 10}")],
                         workdir, workdir / "s3.log", env=env, timeout=1200, while_running=inject)
        mirror = workdir / "s3-mirror"
        for page in direct.get_paginator("list_objects_v2").paginate(Bucket="echo2-chaos", Prefix="chaos/"):
            for obj in page.get("Contents", []):
                target = mirror / obj["Key"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(direct.get_object(Bucket="echo2-chaos", Key=obj["Key"])["Body"].read())
    finally:
        proxy.stop()
        moto.stop()
    row = audit_row("store-faults", mirror / "chaos" / "runs" / "s3", code)
    judged, retried, late = proxy.retried()
    return result_row("store-faults", injected=judged, detected=retried,
                lost=row["lost"], finished=row["finished"] and bool(outages),
                leaks=h.leaks(workdir, [mirror], extra=[secret]),
                detail=f"{proxy.failed} of {proxy.failed + proxy.forwarded} S3 requests failed, including a "
                       f"{outage_s}s outage{'' if outages else ' (never reached)'}; {retried} of {judged} failed "
                       f"requests were sent again by their client (a retry: the fault seen)"
                       + (f"; {late} in the last 30 s not sent again (the run ended), not judged" if late else ""))
