"""The rows of what ran and what it cost, from the run's ledger: arithmetic only, nothing rendered.

The only input is what the learner and the fleet (trusted) wrote to ``ledger/events`` -- one
billing row per worker, from its start (``launch`` or ``requested``; a ``running``/``ready`` of a
worker never seen before also starts one) to its end (``exited``, ``terminated``, ``reclaimed``,
``crashed``, or ``unavailable``: the provider had no capacity for a request; a worker with no end is billed until
``now``). Any event of the row may carry its offer:
``backend``, ``provider``, ``gpu``, ``region``, ``spot``, ``price_usd_per_hour``,
``on_demand_usd_per_hour``, ``simulated_price``, ``role``; the latest value wins (a ``running`` event
knows which of a launch's candidate offers was bought). Missing or malformed fields fall back to
defaults (price 0, on-demand price = price), so a report is always written.

A local actor (``backend: local``) is a child of the learner and dies with it (PR_SET_PDEATHSIG): one
whose row has no end event was killed with a learner that could write none (SIGKILL, a crash). Its
row ends at that learner's last ledger activity before the next ``resume`` event, and in a report
(not the live ``usd_so_far`` of a running learner) at the run's last activity: never at the time the
report is made.

Besides the rows: what the ledger's ``consumed`` entries say of the run (``ledger_facts``: steps, completions
used, when each entry was written), and ``fleet_usd``, the live figure the fleet's budget reads (the actors'
GPU hours only).
"""

from __future__ import annotations

import math
import time
from typing import Any

from echo2.data import layout
from echo2.data.audit import finite_number
from echo2.data.ledger import consumed_records, read_events
from echo2.data.store import NotFound, ObjectStore

STARTS = ("launch", "requested")
STATUS = ("running", "ready")
ENDS = ("exited", "terminated", "reclaimed", "crashed", "unavailable")  # unavailable: the offer had no capacity


def num(value: Any, default: float | None = None) -> float | None:
    """``value`` as a finite number, else ``default``."""
    out = finite_number(value)
    return default if out is None else out


def price(value: Any) -> float | None:
    """``value`` as a price: a finite number not below 0, else None."""
    out = num(value)
    return out if out is not None and out >= 0 else None


def new_row(e: dict, ts: float) -> dict:
    """A billing row opened at ``ts`` for the worker of event ``e``, with the defaults (module docstring)."""
    actor_id = str(e.get("actor_id", "?"))
    return {"actor_id": actor_id, "role": "learner" if actor_id == "learner" else "actor", "backend": "?",
            "provider": None, "gpu": "none", "region": "-", "spot": False, "price_usd_per_hour": 0.0,
            "on_demand_usd_per_hour": None, "simulated_price": False, "priced": True, "start": ts, "end": None,
            "ended_by": None}


def _update(row: dict, e: dict) -> None:
    for field in ("backend", "provider", "gpu", "region", "role"):
        if isinstance(e.get(field), (str, int, float)) and not isinstance(e.get(field), bool) and str(e[field]):
            row[field] = str(e[field])
    if isinstance(e.get("spot"), bool):
        row["spot"] = e["spot"]
    if price(e.get("price_usd_per_hour")) is not None:
        row["price_usd_per_hour"] = price(e["price_usd_per_hour"])
    if price(e.get("on_demand_usd_per_hour")) is not None:
        row["on_demand_usd_per_hour"] = price(e["on_demand_usd_per_hour"])
    if e.get("simulated_price") is True:
        row["simulated_price"] = True


def finish(row: dict, now: float) -> dict:
    """Close ``row``'s arithmetic: hours (an open row until ``now``), market, dollars, on-demand dollars."""
    end = row["end"] if row["end"] is not None else max(now, row["start"])
    row["hours"] = (end - row["start"]) / 3600
    row["provider"] = row["provider"] or row["backend"]
    row["market"] = "spot" if row["spot"] else "on-demand"
    if row["on_demand_usd_per_hour"] is None:
        row["on_demand_usd_per_hour"] = row["price_usd_per_hour"]
    row["usd"] = row["hours"] * row["price_usd_per_hour"]
    row["on_demand_usd"] = row["hours"] * row["on_demand_usd_per_hour"]
    return row


def timeline(events: list[dict]) -> list[dict]:
    """The events with a numeric ``ts``, oldest first."""
    valid = [e for e in events if isinstance(e, dict) and num(e.get("ts")) is not None]
    return sorted(valid, key=lambda e: float(e["ts"]))


def _died_with_the_learner(open_rows: dict[str, dict], at: float, before: float = math.inf) -> None:
    """Close the open rows of local actors started before ``before`` at ``at``: their learner is gone,
    so are they."""
    for actor_id, row in list(open_rows.items()):
        if row["backend"] == "local" and row["start"] < before:
            row["end"], row["ended_by"] = max(at, row["start"]), "died with the learner"
            del open_rows[actor_id]


def worker_rows(events: list[dict], now: float | None = None, *,
                learner_activity: list[float] | None = None) -> list[dict]:
    """One billing row per worker life, from the fleet events (see the module docstring).
    A local actor still open at a ``resume`` event ends at the dead learner's last activity before it;
    with ``learner_activity`` (when each ledger record was written: a report, not the live figure of a
    running learner) one still open at the end ends at the last activity."""
    now = time.time() if now is None else now
    activity = sorted([*(learner_activity or []), *(float(e["ts"]) for e in timeline(events))])
    rows: list[dict] = []
    open_rows: dict[str, dict] = {}
    seen: set[str] = set()
    for e in timeline(events):
        ts, kind, actor_id = float(e["ts"]), e.get("kind"), str(e.get("actor_id", "?"))
        if kind == "resume":  # a new learner: the old one's children died with it
            _died_with_the_learner(open_rows, max([t for t in activity if t < ts], default=ts), before=ts)
        row = open_rows.get(actor_id)
        if row is None and (kind in STARTS or (kind in STATUS and actor_id not in seen)):
            row = open_rows[actor_id] = new_row(e, ts)
            rows.append(row)
            seen.add(actor_id)
        if row is None:
            continue
        _update(row, e)
        if kind in ENDS:
            row["end"], row["ended_by"] = ts, kind
            del open_rows[actor_id]
    if learner_activity is not None and activity:
        _died_with_the_learner(open_rows, activity[-1])
    return [finish(r, now) for r in rows]


def actor_costs(events: list[dict], now: float | None = None) -> list[dict]:
    """The actors' rows only (what ``LocalFleet.cost_so_far`` sums while a run is under way)."""
    return [r for r in worker_rows(events, now) if r["role"] != "learner"]


def fleet_usd(store: ObjectStore, now: float | None = None) -> float:
    """Dollars the actors have cost so far (the flow's live ``usd_so_far``)."""
    return sum(r["usd"] for r in actor_costs(read_events(store), now))


def get_record(store: ObjectStore, key: str) -> dict:
    """The JSON object at ``key``, or {} where there is none (missing, not JSON, not an object)."""
    try:
        value = store.get_json(key)
    except (NotFound, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def ledger_facts(store: ObjectStore) -> dict:
    """Steps, completions used (an amendment's quarantine takes them back), the last activity, and when each
    step's entry was written (``committed``), the entries a resume moved under ``orphaned/`` included (when the
    dead learner was last active, and the steps the resume went back over)."""
    steps, completions, last = 0, 0, None
    written: list[float] = []
    committed: list[tuple[float, int]] = []  # (written_at, step) of each step's entry
    used: dict[str, int] = {}
    amended: set[str] = set()
    for key, record in consumed_records(store):
        last = max(last or 0.0, num(record.get("written_at"), 0.0))
        if num(record.get("written_at")) is not None:
            written.append(num(record.get("written_at")))
        if record.get("amendment"):
            amended.update(str(i.get("key")) for i in record.get("quarantined", []) if isinstance(i, dict))
            continue
        steps = max(steps, layout.step_of_consumed_key(key) or 0)
        if num(record.get("written_at")) is not None and layout.step_of_consumed_key(key) is not None:
            committed.append((num(record.get("written_at")), layout.step_of_consumed_key(key)))
        for item in record.get("used", []) or []:
            if isinstance(item, dict) and "key" in item:
                used[str(item["key"])] = used.get(str(item["key"]), 0) + int(num(item.get("rows"), 0))
    for key in store.list(layout.ORPHANED):  # a resume moved the lost timeline's entries aside: the learner wrote them
        inner = key.split("/", 2)[2] if key.count("/") >= 2 else ""
        n = layout.step_of_consumed_key(inner) if inner.endswith(".json") else None
        if n is None or inner.endswith(".deleted.json"):
            continue
        at = num(get_record(store, key).get("written_at"))
        if at is not None:
            written.append(at)
            committed.append((at, n))
    completions = sum(n for k, n in used.items() if k not in amended)
    return {"steps": steps, "completions_used": completions, "last_activity": last, "written": written,
            "committed": committed}


def group(rows: list[dict], field: str) -> dict[str, dict]:
    """Hours and dollars of ``rows`` summed per value of ``field``, sorted by it."""
    out: dict[str, dict] = {}
    for r in rows:
        g = out.setdefault(str(r[field]), {"hours": 0.0, "usd": 0.0})
        g["hours"] += r["hours"]
        g["usd"] += r["usd"]
    return dict(sorted(out.items()))
