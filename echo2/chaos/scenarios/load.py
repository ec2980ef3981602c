"""Chaos scenario 10 (things going wrong): many actors against one learner and one store for minutes;
nothing lost, listing time and memory flat."""

from __future__ import annotations

import json
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, result_row


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
    metrics = run_dir / "reports" / "metrics.json"
    history = json.loads(metrics.read_text()) if metrics.exists() else []
    # the interrupted run is finished by a resume of one more step (its ledger is then complete)
    steps = len([p for p in (run_dir / "ledger" / "consumed").glob("step-*.json") if p.name.count(".") == 1])
    code2 = h.run_cli(["run", h.QUICKSTART, *args, *h.sets(f"train.max_steps={steps + 1}", "fleet.actors=1"),
                       "--resume"],
                      workdir, workdir / "load-finish.log", timeout=600)
    row = audit_row("load", run_dir, code2)
    history = json.loads(metrics.read_text()) if row["finished"] else history
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
