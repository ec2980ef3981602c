"""Chaos scenario 2 (things going wrong): the learner SIGKILLed during a checkpoint, a publish and a step
(failpoints), then resumed each time; LATEST must always name a committed version, and the ledger hold every
step once."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, bad_loads, result_row

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
