"""Chaos scenarios of things going wrong: reclaims, the learner killed, a faulty store, bad input, load."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, bad_loads, result_row


# -- 1. reclaims ---------------------------------------------------------------------------------
def reclaims(workdir: Path, quick: bool = False) -> dict:
    """Spot-like reclaims in bursts, with a notice (SIGTERM, then SIGKILL after it) and without one."""
    model = h.tiny_model(workdir)
    rows = []
    for notice in (1.0, 0.0):
        name = f"notice{notice:g}"
        code = h.run_cli(["run", h.QUICKSTART, *h.sets(f"model.name={model}", f"store.url={workdir}", f"run.id={name}",
                                                      *h.TINY, "fleet.actors=3", f"train.max_steps={8 if quick else 16}",
                                                      "fleet.local.reclaim_rate=2", "fleet.local.reclaim_burst=0.4",
                                                      f"fleet.local.notice_s={notice}", "fleet.local.seed=7",
                                                      "fleet.max_restarts=5")],
                         workdir, workdir / f"{name}.log", timeout=900)
        rows.append(audit_row("reclaims", workdir / "runs" / name, code))
    audits = [r["audit"] for r in rows]
    injected = sum(a.get("reclaims", 0) for a in audits)
    launched = sum(a.get("reclaims", 0) + a.get("crashes", 0) for a in audits) + 6
    return result_row("reclaims", injected=injected, detected=sum(a.get("replacements", 0) for a in audits),
                lost=sum(r["lost"] for r in rows), finished=all(r["finished"] for r in rows),
                bad_loaded=sum(bad_loads(workdir / "runs" / n) for n in ("notice1", "notice0")),
                leaks=h.leaks(workdir, [workdir / "runs"]),
                detail=f"{injected} reclaims over ~{launched} actor lives ({injected / max(launched, 1):.0%}), "
                       f"with and without notice; every one replaced: "
                       f"{all(not a.get('unreplaced') for a in audits)}")


# -- 2. the learner killed ---------------------------------------------------------------------------
HITS_PER_SIX_STEPS = {"step": 12, "publish": 19, "checkpoint": 27}
"""Passes of each failpoint in about six steps of the tiny run: kills are drawn in that range. The
quickstart publishes sparse deltas: a keyframe first after each resume (~8 files and LATEST), then one
delta shard and LATEST per version, so kills land in keyframes and in deltas."""


def learner_kills(workdir: Path, quick: bool = False, kills: int | None = None) -> dict:
    """SIGKILL of the learner during a checkpoint, a publish and a step (failpoints), then --resume, each time
    (three kills at both sizes, as the chaos issue asks: more kills are more runs, not more kinds); meanwhile
    LATEST is watched: it must always name a committed (manifest-signed) version."""
    model = h.tiny_model(workdir)
    kills = kills or 3
    max_steps = 6 * kills + 4
    rng = random.Random(0)
    base = ["run", h.QUICKSTART, *h.sets(f"model.name={model}", f"store.url={workdir}", "run.id=kill", *h.TINY,
                                         f"train.max_steps={max_steps}")]
    run_dir = workdir / "runs" / "kill"
    half_visible = []

    def watch(_proc):
        latest = run_dir / "policy" / "LATEST"
        try:
            version = json.loads(latest.read_text())["version"]
        except (OSError, ValueError, KeyError):
            return
        if not (run_dir / "policy" / f"v{version:06d}" / "manifest.json").exists():
            time.sleep(0.2)  # a resume may be re-pointing it this instant: look again before judging
            try:
                version2 = json.loads(latest.read_text())["version"]
            except (OSError, ValueError, KeyError):
                return
            if not (run_dir / "policy" / f"v{version2:06d}" / "manifest.json").exists():
                half_visible.append(version2)

    killed, attempts = 0, 0
    kinds = ["checkpoint", "publish", "step"]
    deaths: list[tuple[float, int]] = []  # per kill: when, and the newest checkpoint committed by then
    while killed < kills:
        kind = kinds[killed % 3]
        env = h.environment(workdir, ECHO2_FAILPOINTS=f"{kind}:{rng.randint(1, HITS_PER_SIX_STEPS[kind])}")
        code = h.run_cli(base + (["--resume"] if attempts else []), workdir, workdir / f"kill-{attempts}.log", env=env,
                         timeout=600, while_running=watch)
        attempts += 1
        if code == 0:
            break
        killed += code == -9
        if code == -9:
            deaths.append((time.time(), _newest_checkpoint(run_dir)))
        if code not in (0, -9):
            return result_row("learner-kill", injected=killed, detail=f"attempt {attempts} exited {code}")
    code = h.run_cli(base + ["--resume"], workdir, workdir / "kill-final.log", timeout=600, while_running=watch)
    row = audit_row("learner-kill", run_dir, code)
    steps = sorted(p.name for p in (run_dir / "ledger" / "consumed").glob("step-*.json") if p.name.count(".") == 1)
    monotonic = steps == [f"step-{i:06d}.json" for i in range(1, max_steps + 1)]
    # a kill is detected when the restart after it resumed from the newest checkpoint committed before it
    # (the ledger's resume event; a restart killed inside its own resume leaves none, and the next one counts)
    resumes = sorted((e["ts"], e.get("step")) for e in _events(run_dir) if e.get("kind") == "resume")
    resumed_from = [next((step for ts, step in resumes if ts > died), None) for died, _ in deaths]
    detected = sum(got == want for got, (_, want) in zip(resumed_from, deaths))
    return result_row("learner-kill", injected=killed, detected=detected,
                lost=row["lost"], bad_loaded=bad_loads(run_dir) + len(half_visible),
                finished=row["finished"], leaks=h.leaks(workdir, [run_dir]),
                broken=[] if monotonic else [f"ledger steps are not 1..{max_steps} once each: {steps}"],
                detail=f"{killed} SIGKILLs (checkpoint, publish, step) in {attempts} attempts; resumed from "
                       f"{resumed_from} where the newest committed checkpoints were {[want for _, want in deaths]}; "
                       f"ledger steps 1..{max_steps} once each: {monotonic}; LATEST ever naming an uncommitted "
                       f"version: {len(half_visible)}")


def _newest_checkpoint(run_dir: Path) -> int:
    """The newest committed checkpoint (its manifest written) of a local run: 0 when there is none."""
    return max((int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/manifest.json")),
               default=0)


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (run_dir / "ledger" / "events").glob("*.json")]


# -- 6. a faulty object store -------------------------------------------------------------------------
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

        env = h.environment(workdir, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret, AWS_DEFAULT_REGION="us-east-1")
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


# -- 7. bad input -----------------------------------------------------------------------------------
BAD_INPUT = [
    (["--set", "train.bogus=1"], "train.bogus: unknown key"),
    (["--set", "rollout.group_size=-4"], "rollout.group_size"),
    (["--set", "train.shard_mb=0"], "train.shard_mb"),
    (["--set", "train.staleness=-1"], "train.staleness"),
    (["--set", "store.url=s3://echo2-unreachable/x", "--set", "store.options={endpoint_url: http://127.0.0.1:9}"],
     "unreachable"),
    (["--set", "fleet.backend=skypilot"], "s3:// or gs://"),
    (["--set", "task.name=chess"], "task.name"),
    (["--resume", "--set", "run.id=never-started"], "never-started"),
    (["--set", "train.lr=fast"], "train.lr"),
]


def bad_input(workdir: Path, quick: bool = False) -> dict:
    """Bad configs and CLI input: one clear line each, exit 2, nothing written."""
    store = workdir / "bad-input-store"
    store.mkdir(parents=True, exist_ok=True)
    ok, problems = 0, []
    cases = [*BAD_INPUT, (["--set", "x"], "key.path=value")]
    for i, (args, expect) in enumerate(cases):
        log = workdir / f"bad-{i}.log"
        code = h.run_cli(["run", h.QUICKSTART, "--set", f"store.url={store}", *args], workdir, log, timeout=300)
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0]:
            ok += 1
        else:
            problems.append(f"{' '.join(args)}: exit {code}, {lines[-1:] if lines else 'nothing'}")
    written = [str(p.relative_to(store)) for p in store.rglob("*") if p.is_file()]
    ok_nothing_written = not written
    return result_row("bad-input", injected=len(cases), detected=ok, finished=ok_nothing_written,
                detail=f"{ok}/{len(cases)} refused in one line with exit 2; files written: {len(written)}"
                       + (f"; {problems[:2]}" if problems else ""))


# -- 10. load -------------------------------------------------------------------------------------------
def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def load(workdir: Path, quick: bool = False, actors: int | None = None, minutes: float | None = None) -> dict:
    """Many actors against one learner and one store for minutes: nothing lost or used twice, the learner's
    listing time does not grow with the files in the store, and memory stays flat."""
    import signal as _signal

    actors = actors or (4 if quick else 16)
    minutes = minutes or (1.5 if quick else 10.0)
    model = h.tiny_model(workdir)
    run_dir = workdir / "runs" / "load"
    started, rss = time.time(), {}

    def sample(proc):
        age = time.time() - started
        pids = {"learner": proc.pid}
        for path in (run_dir / "ledger" / "events").glob("*.json"):
            event = json.loads(path.read_text())
            if event.get("kind") == "launch" and event.get("pid"):
                pids[event["actor_id"]] = event["pid"]
        # the start sample once every actor has loaded its model and committed a file (16 actors on 2 cores
        # take minutes to get there): memory that grows after that is what "flat" is about
        if age > 45 and "start" not in rss and len(pids) > actors and len(
                {p.name.rsplit("-", 1)[0] for p in (run_dir / "rollouts").glob("v*/*.arrow")}) >= actors:
            rss["start"] = {k: _rss_mb(p) for k, p in pids.items()}
        if age > minutes * 60 and "end" not in rss:
            rss["end"] = {k: _rss_mb(p) for k, p in pids.items()}
            proc.send_signal(_signal.SIGINT)  # Ctrl-C, once: checkpoint, actors stopped, exit 130; resumed below

    args = h.sets(f"model.name={model}", f"store.url={workdir}", "run.id=load", *h.TINY, f"fleet.actors={actors}",
                  "train.max_steps=100000", "rollout.max_pending_batches=16", "train.checkpoint_every=20")
    code = h.run_cli(["run", h.QUICKSTART, *args], workdir, workdir / "load.log", timeout=minutes * 60 + 600,
                     while_running=sample)
    history = json.loads((run_dir / "reports" / "metrics.json").read_text()) if (run_dir / "reports" / "metrics.json").exists() else []
    # the interrupted run is finished by a resume of one more step (its ledger is then complete)
    steps = len([p for p in (run_dir / "ledger" / "consumed").glob("step-*.json") if p.name.count(".") == 1])
    code2 = h.run_cli(["run", h.QUICKSTART, *args, *h.sets(f"train.max_steps={steps + 1}", "fleet.actors=1"), "--resume"],
                      workdir, workdir / "load-finish.log", timeout=600)
    row = audit_row("load", run_dir, code2)
    history = json.loads((run_dir / "reports" / "metrics.json").read_text()) if row["finished"] else history
    listing = [m.get("list_seconds", 0.0) for m in history if "list_seconds" in m]
    tenth = max(1, len(listing) // 10)
    early, late = sum(listing[:tenth]) / tenth if listing else 0, sum(listing[-tenth:]) / tenth if listing else 0
    files = row["audit"].get("committed", 0)
    flat_listing = late <= max(3 * early, early + 0.05)
    start, end = rss.get("start", {}), rss.get("end", {})
    growth = {k: round(end[k] - start[k], 1) for k in start if start.get(k) and end.get(k)}
    flat_memory = bool(growth) and all(g < max(200.0, 0.3 * start[k]) for k, g in growth.items())
    # what is checked under load: two properties (listing time flat, memory flat), each detected or not
    return result_row("load", injected=2, detected=int(flat_listing) + int(flat_memory), lost=row["lost"],
                finished=row["finished"] and code == 130,
                leaks=h.leaks(workdir, [run_dir]),
                detail=f"{actors} actors, {minutes:g} min, {steps} steps, {files} files: listing "
                       f"{early * 1000:.1f} ms/step early vs {late * 1000:.1f} ms late (flat: {flat_listing}); "
                       f"RSS learner {start.get('learner') or 0:.0f} -> {end.get('learner') or 0:.0f} MB, actors "
                       f"{_mean([v for k, v in start.items() if k != 'learner']):.0f} -> "
                       f"{_mean([v for k, v in end.items() if k != 'learner']):.0f} MB mean (flat: {flat_memory})")


def _mean(values) -> float:
    values = [v for v in values if v]
    return sum(values) / len(values) if values else 0.0
