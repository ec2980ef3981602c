"""The run's ledger: which rollout files each step used or dropped (and why), and fleet events.

Every entry is its own write-once object, so the ledger is append-only by construction and two
writers never contend for one file.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from echo2.data import layout
from echo2.data.store import ObjectStore

CONSUMED_PREFIX = "ledger/consumed/"
EVENTS_PREFIX = "ledger/events/"


def write_consumed(store: ObjectStore, step: int, record: dict[str, Any]) -> None:
    store.put_json(layout.consumed_key(step), {"step": step, "written_at": time.time(), **record})


def consumed_keys(store: ObjectStore) -> list[str]:
    return [k for k in store.list(CONSUMED_PREFIX) if k.endswith(".json")]


def write_event(store: ObjectStore, kind: str, actor_id: str, **fields: Any) -> None:
    """A fleet event (launch, ready, exited, restarted, terminated), with its price when known."""
    ts = time.time()
    key = f"{EVENTS_PREFIX}{ts:017.6f}-{actor_id}-{uuid.uuid4().hex[:6]}.json"
    store.put_json(key, {"ts": ts, "kind": kind, "actor_id": actor_id, **fields})


def read_events(store: ObjectStore) -> list[dict[str, Any]]:
    return [store.get_json(k) for k in store.list(EVENTS_PREFIX) if k.endswith(".json")]


class ConsumedIndex:
    """The set of rollout keys the ledger has settled (used, dropped or quarantined), read incrementally.

    Ledger entries are immutable, so each is read once and cached; actors use this for flow control.
    """

    def __init__(self, store: ObjectStore):
        self.store = store
        self._read: set[str] = set()
        self.settled: set[str] = set()

    def refresh(self) -> set[str]:
        for key in consumed_keys(self.store):
            if key in self._read:
                continue
            record = self.store.get_json(key)
            for section in ("used", "dropped", "quarantined"):
                self.settled.update(item["key"] for item in record.get(section, []))
            self._read.add(key)
        return self.settled


def actor_costs(events: list[dict[str, Any]], now: float | None = None) -> list[dict[str, Any]]:
    """Per actor: launch and end time, hours, price and dollars, from the fleet events (still running = until now)."""
    now = time.time() if now is None else now
    rows: dict[str, dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["kind"] == "launch":
            rows[e["actor_id"]] = {"actor_id": e["actor_id"], "backend": e.get("backend", "?"),
                                   "price_usd_per_hour": e.get("price_usd_per_hour", 0.0), "start": e["ts"], "end": None}
        elif e["kind"] in ("exited", "terminated") and e["actor_id"] in rows and rows[e["actor_id"]]["end"] is None:
            rows[e["actor_id"]]["end"] = e["ts"]
    for row in rows.values():
        row["hours"] = ((row["end"] or now) - row["start"]) / 3600
        row["usd"] = row["hours"] * row["price_usd_per_hour"]
    return list(rows.values())
