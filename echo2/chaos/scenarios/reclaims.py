"""Chaos scenario 1 (things going wrong): spot-like reclaims of actors, in bursts, with a notice (SIGTERM,
then SIGKILL after it) and without one; every actor is replaced and no rollout file is lost."""

from __future__ import annotations

from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, bad_loads, result_row


def reclaims(workdir: Path, quick: bool = False) -> dict:
    """Spot-like reclaims in bursts, with a notice (SIGTERM, then SIGKILL after it) and without one."""
    model = h.tiny_model(workdir)
    rows = []
    for notice in (1.0, 0.0):
        name = f"notice{notice:g}"
        settings = h.sets(f"model.name={model}", f"store.url={workdir}", f"run.id={name}", *h.TINY, "fleet.actors=3",
                          f"train.max_steps={8 if quick else 16}", "fleet.reclaim_rate=2",
                          "fleet.reclaim_burst=0.4", f"fleet.notice_s={notice}", "fleet.seed=7",
                          "fleet.max_restarts=5")
        code = h.run_cli(["run", h.QUICKSTART, *settings],
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
