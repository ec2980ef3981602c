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

SECTIONS = ("used", "dropped", "quarantined")


def write_consumed(store: ObjectStore, step: int, record: dict[str, Any], *, amendment: str | None = None) -> None:
    """The ledger entry of ``step``; an ``amendment`` (a second, write-once entry) corrects it after
    training, e.g. files whose step turned out non-finite and were quarantined."""
    extra = {"amendment": amendment} if amendment else {}
    store.put_json(layout.consumed_key(step, amendment), {"step": step, "written_at": time.time(), **extra, **record})


def write_final(store: ObjectStore, step: int, leftovers: list[str]) -> None:
    """What the run leaves unused when it finishes, so that every committed file is in the ledger."""
    store.put_json(layout.FINAL_CONSUMED, {"step": step, "written_at": time.time(), "used": [], "quarantined": [],
                                           "dropped": [{"key": k, "reason": "unused when the run finished"}
                                                       for k in leftovers]})


def consumed_keys(store: ObjectStore) -> list[str]:
    return [k for k in store.list(layout.LEDGER_CONSUMED) if k.endswith(".json")]


def pending_rollouts(store: ObjectStore, settled: set[str], oldest_version: int | None = None) -> list[tuple[int, str]]:
    """Committed rollout files that no step has settled, as (version, key), oldest version first.

    The one listing of the backlog, shared by the collector (which also drops the stale ones) and
    the actors' flow control (which counts only those of ``oldest_version`` or newer). Only the
    version folders from ``oldest_version`` on are listed (one request for the folder names, one per
    folder), so a poll costs the same however many files older versions hold.
    """
    out = []
    for name in store.list_folders(layout.ROLLOUTS):
        v = layout.parse_version_dir(name)
        if v is None or (oldest_version is not None and v < oldest_version):
            continue
        for key in store.list(f"{layout.ROLLOUTS}{name}/"):
            if key not in settled and layout.version_of_rollout_key(key) == v:
                out.append((v, key))
    return sorted(out)


def write_event(store: ObjectStore, kind: str, actor_id: str, **fields: Any) -> None:
    """A fleet event (launch, ready, exited, restarted, terminated), with its price when known."""
    ts = time.time()
    key = layout.event_key(ts, actor_id, uuid.uuid4().hex[:6])
    store.put_json(key, {"ts": ts, "kind": kind, "actor_id": actor_id, **fields})


def read_events(store: ObjectStore) -> list[dict[str, Any]]:
    return [store.get_json(k) for k in store.list(layout.LEDGER_EVENTS) if k.endswith(".json")]


class ConsumedIndex:
    """The set of rollout keys the ledger has settled (used, dropped or quarantined), read incrementally.

    Ledger entries are immutable, so each is read once and cached; actors use this for flow control.
    """

    def __init__(self, store: ObjectStore):
        self.store = store
        self._read: set[str] = set()
        self.settled: set[str] = set()
        self.latest_step = 0
        """The newest step whose files the learner has chosen (0 before the first): it trains that
        step or has finished it, so its next collection happens at learner version ``latest_step``.
        Read from the listing each time, so a resume that moves newer entries aside lowers it."""

    def refresh(self) -> set[str]:
        keys = consumed_keys(self.store)
        self.latest_step = max((s for s in map(layout.step_of_consumed_key, keys) if s is not None), default=0)
        for key in keys:
            if key in self._read:
                continue
            record = self.store.get_json(key)
            for section in SECTIONS:
                self.settled.update(item["key"] for item in record.get(section, []))
            self._read.add(key)
        return self.settled

