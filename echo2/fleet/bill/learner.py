"""The learner's bill by session, and the gaps between sessions: what the cost report (``report.py``) bills for the
learner when no fleet event describes it (``session_rows``), and its ``learner`` object (``learner_summary``).

Model. A run's learner lives in sessions. The first starts at the run's start (``run.json``'s ``created_at``); each
``resume`` event (``LearnerRun._resume``) starts another: a new learner process, in general a new machine (a spot
learner reclaimed and relaunched, a crashed one retried). A session ends at the last learner activity before the
next one starts -- a ledger event other than the next ``resume`` (the learner's fleet writes every one of them) or a
``ledger/consumed`` entry (``written_at``; those a resume moved under ``orphaned/`` too) -- or, for the last
session, at the summary's ``finished_at`` (a finished run), else at ``run.json``'s start plus the summary's
``wall_seconds`` (a run that never resumed, as before sessions existed), else at the run's last activity. A session
with no activity of its own ends where it started. Each session is billed at ``fleet.learner_usd_per_hour`` (the
price of the learner's machine: for ``learner.market: spot`` the spot price); between sessions nothing of the
learner's machine is known and nothing is billed (an on-demand host that stayed up through a crash and its retry is
under-billed by the gap: the report lists the gap).

Gaps. Every session after the first follows a learner restart ("reclaims" here: for a spot learner a reclaim,
for an on-demand one a crash or a reclaim of its host alike). The gap runs from the reclaim to the ``resume``:
from the session's first ``learner_notice`` event (the spot notice the learner heard), else its
``learner_left`` event (the learner checkpointed and left), else its last activity (no notice: the learner
vanished), to the resume event; its ``steps_lost`` are the steps the session committed to the ledger beyond the
one the next session resumed from (the work the reclaim threw away). A ``learner_notice`` or ``learner_left``
after the last session's start with no resume yet is an open gap, counted until the report's ``now``. The actors
kept running through a gap (they wait for the relaunched learner): their rows already bill them, and
``gap_actor_usd`` is the share of those rows that fell inside gaps (each row's price times its overlap with each
gap), not an extra charge.
"""

from __future__ import annotations

from typing import Any

from echo2.data.audit import finite_number
from echo2.data.run_folder import RunInfo
from echo2.fleet.bill import ledger

NOTICE = "learner_notice"
LEFT = "learner_left"
RESUME = "resume"
LEARNER_PRICE_FIELD = ("fleet", "learner_usd_per_hour")
"""Where the learner's price lives in the run's config (``FleetConfig.learner_usd_per_hour``)."""


def sessions(start: float, timeline: list[dict], written: list[float], *, finished_at: float | None = None,
             wall_seconds: float | None = None, now: float) -> list[dict]:
    """[{start, end, ended_by}] of the learner (module docstring). ``timeline``: the ledger events sorted by ``ts``;
    ``written``: when each ``ledger/consumed`` entry was written."""
    starts = [start, *sorted(float(e["ts"]) for e in timeline if e.get("kind") == RESUME and float(e["ts"]) > start)]
    activity = sorted([*written, *(float(e["ts"]) for e in timeline if e.get("kind") != RESUME)])
    out = []
    for i, s in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < len(starts) else None
        mine = [t for t in activity if t >= s and (nxt is None or t < nxt)]
        if nxt is not None:
            out.append({"start": s, "end": max([s, *mine]), "ended_by": "restarted"})
        elif finished_at is not None and finished_at >= s:
            out.append({"start": s, "end": finished_at, "ended_by": "finished"})
        elif wall_seconds is not None and len(starts) == 1:
            out.append({"start": s, "end": s + wall_seconds, "ended_by": "finished"})
        elif mine or activity:
            out.append({"start": s, "end": max([s, *mine]), "ended_by": "last activity"})
        else:  # nothing written yet: a learner still starting, billed until now
            out.append({"start": s, "end": max(s, now), "ended_by": "last activity"})
    return out


def gaps(sessions_: list[dict], timeline: list[dict], *, now: float,
         committed: list[tuple[float, int]] = ()) -> list[dict]:
    """[{start, end, hours, notice, left, source, step, last_step, resume_step, steps_lost, resumed}] between
    sessions (module docstring): ``step`` the notice's (or the leaving's) step, ``last_step`` the last step the
    session committed to the ledger (``committed``: (written_at, step) of each entry), ``resume_step`` the step the
    next session resumed from, ``steps_lost`` the committed steps the resume went back over (last - resume)."""
    resumes = [s["start"] for s in sessions_[1:]]
    resume_steps = {float(e["ts"]): e.get("step") for e in timeline if e.get("kind") == RESUME}
    out = []
    for i, s in enumerate(sessions_):
        until = resumes[i] if i < len(resumes) else None
        mine = [e for e in timeline if float(e["ts"]) >= s["start"] and (until is None or float(e["ts"]) < until)]
        notice = next((e for e in mine if e.get("kind") == NOTICE), None)
        left = next((e for e in mine if e.get("kind") == LEFT), None)
        if until is None and notice is None and left is None:
            continue  # the running (or finished) session: no gap after it
        marker = notice or left
        begin = float(marker["ts"]) if marker is not None else s["end"]
        end = until if until is not None else max(begin, now)
        last = max((n for t, n in committed if t >= s["start"] and (until is None or t < until)), default=None)
        resume_step = _step(resume_steps.get(until))
        out.append({"start": begin, "end": end, "hours": max(0.0, end - begin) / 3600, "notice": notice is not None,
                    "left": left is not None, "source": str(notice.get("source")) if notice else None,
                    "step": _step((marker or {}).get("step")), "last_step": last, "resume_step": resume_step,
                    "steps_lost": None if last is None or resume_step is None else max(0, last - resume_step),
                    "resumed": until is not None})
    return out


def _step(value: Any) -> int | None:
    return int(value) if finite_number(value) is not None else None


def actor_usd_within(rows: list[dict], begin: float, end: float, now: float) -> float:
    """Dollars the actor rows billed between ``begin`` and ``end``."""
    usd = 0.0
    for r in rows:
        if r["role"] == "learner":
            continue
        r_end = r["end"] if r["end"] is not None else max(now, r["start"])
        overlap = min(end, r_end) - max(begin, r["start"])
        usd += max(0.0, overlap) / 3600 * r["price_usd_per_hour"]
    return usd


def learner_summary(learner_rows: list[dict], gaps_: list[dict], actor_rows: list[dict], *, market: str,
                    now: float) -> dict[str, Any]:
    """The report's ``learner`` object: market, sessions, hours, usd, gap_hours, gap_actor_usd, reclaims, gaps."""
    for g in gaps_:
        g["actor_usd"] = actor_usd_within(actor_rows, g["start"], g["end"], now)
    return {"market": market, "sessions": len(learner_rows), "hours": sum(r["hours"] for r in learner_rows),
            "usd": sum(r["usd"] for r in learner_rows),
            "usd_per_hour": learner_rows[0]["price_usd_per_hour"] if learner_rows else None,
            "priced": all(r["priced"] for r in learner_rows),
            "gap_hours": sum(g["hours"] for g in gaps_), "gap_actor_usd": sum(g["actor_usd"] for g in gaps_),
            "reclaims": len(gaps_), "with_notice": sum(g["notice"] for g in gaps_), "gaps": gaps_}


def session_rows(run: RunInfo, summary: dict, facts: dict, timeline: list[dict], now: float) -> list[dict]:
    """One billing row per learner session (``sessions``), priced from the run's config: at
    ``fleet.learner_usd_per_hour`` where that field exists, otherwise at $0 and labelled unpriced (a bill that
    guesses is worse than one that says what it does not know). ``facts``: ``ledger.ledger_facts``."""
    start = ledger.num(run.created_at)
    if start is None:
        return []
    price = ledger.price(run.section(LEARNER_PRICE_FIELD[0]).get(LEARNER_PRICE_FIELD[1]))
    spot = run.learner_market == "spot"
    rows = []
    for s in sessions(start, timeline, facts["written"], finished_at=ledger.num(summary.get("finished_at")),
                      wall_seconds=ledger.num(summary.get("wall_seconds")), now=now):
        row = ledger.new_row({"actor_id": "learner"}, s["start"])
        row.update(backend="learner", provider="unknown", gpu="unknown", end=s["end"], price_usd_per_hour=price or 0.0,
                   spot=spot, ended_by=s["ended_by"], priced=price is not None)
        rows.append(ledger.finish(row, now))
    return rows
