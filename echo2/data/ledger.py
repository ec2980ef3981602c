"""The run's ledger: which rollout files each step used or dropped (and why), and fleet events.

Every entry is its own write-once object, so the ledger is append-only by construction and two
writers never contend for one file.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import Counter
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from echo2.data import layout
from echo2.data.rollouts import MEASURED_PREFIX
from echo2.data.store import AlreadyExists, NotFound, ObjectStore

SECTIONS = ("used", "dropped", "quarantined")

log = logging.getLogger(__name__)

EventListener = Callable[[dict[str, Any]], None]
event_listeners: list[EventListener] = []
"""Called with each fleet event's record (``write_event``) and each new ban's (``write_ban``, ``kind`` "banned") once
the ledger holds it: the ledger is the record, a listener only passes it on (the flow forwards notable ones to
Prefect, ``echo2/flows/events.py``). This package never imports Prefect, hence a hook rather than a call."""
_failed_listeners: set[int] = set()


def _notify(record: dict[str, Any]) -> None:
    """Tell every listener; a listener that raises is logged once (by identity) and skipped this time: a
    notification that fails must never fail the write it reports, or the run."""
    for listener in list(event_listeners):
        try:
            listener(record)
        except Exception:
            if id(listener) not in _failed_listeners:
                _failed_listeners.add(id(listener))
                log.warning("ledger event listener %r failed (logged once; the ledger entry stands)", listener,
                            exc_info=True)


def write_consumed(store: ObjectStore, step: int, record: dict[str, Any], *, amendment: str | None = None) -> None:
    """The ledger entry of ``step``; an ``amendment`` (a second, write-once entry) corrects it after
    training, e.g. files whose step turned out non-finite and were quarantined."""
    extra = {"amendment": amendment} if amendment else {}
    store.put_json(layout.consumed_key(step, amendment), {"step": step, "written_at": time.time(), **extra, **record})


MEASURED_NAMES = ("dissemination_seconds", "fetch_seconds", "put_seconds", "swap_seconds", "previous_batch_seconds")
"""The timings an actor writes into its files' schema metadata (``rollouts.MEASURED_PREFIX``)."""


def used_measurements(table: pa.Table) -> dict[str, float]:
    """What a used file (a validated table) says of its own making, recorded in its ledger entry so that
    the capacity fit (``fleet/sizing/fit.py``, ``fleet/sizing/measured.py``) never reads an actor's file: its batch's
    ``generation_seconds``, its policy tokens, when it was written (``created_at``, seconds since the
    epoch, from the column's integer: no calendar date is built from an actor's number) and the timings
    in ``MEASURED_NAMES``. Actor claims: only finite non-negative numbers are kept, the rest left out."""
    meta = table.schema.metadata or {}
    claims: dict[str, object] = {name: meta.get(f"{MEASURED_PREFIX}{name}".encode(), b"").decode(errors="replace")
                                 for name in MEASURED_NAMES}
    claims["generation_seconds"] = table.column("generation_seconds")[0].as_py()
    claims["created_at"] = table.column("created_at").cast(pa.int64())[0].as_py() / 1e6
    claims["tokens"] = pc.sum(pc.list_flatten(table.column("completion_mask"))).as_py()
    out = {}
    for name, value in claims.items():
        try:
            x = float(value)
        except (TypeError, ValueError, OverflowError):
            continue
        if math.isfinite(x) and x >= 0:
            out[name] = x
    return out


def write_final(store: ObjectStore, step: int, leftovers: list[str], quarantined: list[dict] = (),
                dropped: list[dict] = ()) -> None:
    """What the run leaves unused when it finishes, so that every committed file is in the ledger, and
    what it set aside then (files from versions it never reached, files of banned actors not cleared yet:
    ``RolloutCollector.final_leftovers``)."""
    store.put_json(layout.FINAL_CONSUMED, {"step": step, "written_at": time.time(), "used": [],
                                           "quarantined": list(quarantined),
                                           "dropped": [{"key": k, "reason": "unused when the run finished"}
                                                       for k in leftovers] + list(dropped)})


def write_ban(store: ObjectStore, actor_id: str, reason: str, step: int) -> None:
    """Record the ban of ``actor_id`` at once (``layout.ban_key``): one line that stands for every later file of
    it. Written once; a second ban of the same actor (a resumed learner's) keeps the first record."""
    record = {"actor_id": actor_id, "reason": reason, "step": step, "at": time.time()}
    try:
        store.put_json(layout.ban_key(actor_id), record)
    except AlreadyExists:
        return  # banned before: its listeners heard of it then
    _notify({"kind": "banned", "ts": record["at"], **record})


def read_bans(store: ObjectStore) -> dict[str, str]:
    """actor -> why, from every ban record (a record that does not parse is skipped: only the learner writes them)."""
    out = {}
    for key in store.list(layout.LEDGER_BANS):
        try:
            record = store.get_json(key)
        except (NotFound, ValueError):
            continue
        actor = record.get("actor_id") if isinstance(record, dict) else None
        if isinstance(actor, str) and layout.valid_actor_id(actor) and key == layout.ban_key(actor):
            out[actor] = str(record.get("reason", "?"))
    return out


def consumed_keys(store: ObjectStore) -> list[str]:
    """The ledger's entries (not the collection in progress, ``layout.COLLECTING``)."""
    return [k for k in store.list(layout.LEDGER_CONSUMED) if k.endswith(".json") and k != layout.COLLECTING]


def consumed_records(store: ObjectStore, keys: list[str] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """The ledger's entries (``keys``, or all of them) with their keys, each read as a JSON object; one gone
    since it was listed, unreadable or not an object is passed over (the readers that count over a whole ledger,
    ``echo2 audit`` and the cost report, report what they can read)."""
    for key in consumed_keys(store) if keys is None else keys:
        try:
            record = store.get_json(key)
        except (NotFound, ValueError):
            continue
        if isinstance(record, dict):
            yield key, record


def pending_rollouts(store: ObjectStore, settled: set[str], oldest_version: int | None = None,
                     newest_version: int | None = None) -> list[tuple[int, str]]:
    """Committed rollout files that no step has settled, as (version, key), oldest version first.

    The one listing of the backlog, shared by the collector (which also drops the stale ones) and
    the actors' flow control (which counts only those of ``oldest_version`` or newer). Only the
    version folders from ``oldest_version`` on are listed, so a poll costs the same however many
    files older versions hold. With both bounds, the folders are listed by name, one request each,
    and nothing beyond ``newest_version`` is looked at: whoever may write ``rollouts/`` can make
    folders of any version (an actor's scoped credentials allow a million), and no honest file lies
    beyond the newest published version. Without ``newest_version`` every folder is listed (one
    request for the folder names, one per folder): the collector's periodic sweep, the final entry.
    """
    if oldest_version is not None and newest_version is not None:
        names = [layout.version_name(v) for v in range(max(0, oldest_version), newest_version + 1)]
    else:
        names = store.list_folders(layout.ROLLOUTS)
    out = []
    for name in names:
        v = layout.parse_version_dir(name)
        if v is None or (oldest_version is not None and v < oldest_version) or \
                (newest_version is not None and v > newest_version):
            continue
        for key in store.list(f"{layout.ROLLOUTS}{name}/"):
            if key not in settled and layout.version_of_rollout_key(key) == v:
                out.append((v, key))
    return sorted(out)


def write_event(store: ObjectStore, kind: str, actor_id: str, **fields: Any) -> None:
    """A fleet event (launch, ready, exited, restarted, terminated), with its price when known; then its listeners
    (``event_listeners``) hear of it."""
    ts = time.time()
    key = layout.event_key(ts, actor_id, uuid.uuid4().hex[:6])
    record = {"ts": ts, "kind": kind, "actor_id": actor_id, **fields}
    store.put_json(key, record)
    _notify(record)


def read_events(store: ObjectStore) -> list[dict[str, Any]]:
    return [store.get_json(k) for k in store.list(layout.LEDGER_EVENTS) if k.endswith(".json")]


def collecting_record(step: int, selection: dict[str, list[dict]]) -> dict[str, Any]:
    """What the collection of ``step`` has judged so far (``layout.COLLECTING``), from its entry-to-be
    (``used``, ``dropped``, ``quarantined``): the judged files still in ``rollouts/`` (quarantined ones
    were moved out), and the actors whose newest file it found junk (``_junk_verdicts``)."""
    judged = sorted({item["key"] for section in ("used", "dropped") for item in selection.get(section, [])})
    return {"step": step, "judged": judged, "junk": sorted(a for a, junk in _junk_verdicts(selection).items() if junk)}


def _junk_verdicts(record: dict[str, Any]) -> dict[str, bool]:
    """Per actor named in a ledger record: whether the record found its files junk (a file quarantined,
    or dropped as a copy of one already used, or the actor banned: its later files are in no entry) rather
    than usable (only used or stale files)."""
    verdicts: dict[str, bool] = {str(a): True for a in record.get("banned", []) or [] if isinstance(a, str)}
    for section in SECTIONS:
        for item in record.get(section, []):
            parsed = layout.parse_rollout_key(str(item.get("key", "")))
            if parsed is None:
                continue
            junk = section == "quarantined" or str(item.get("reason", "")).startswith("duplicate")
            if junk or section == "used":
                verdicts[parsed[1]] = verdicts.get(parsed[1], False) or junk
    return verdicts


def fleet_backlog(pending: list[tuple[int, str]], actor_id: str, cap: int, uncounted: set[str] = frozenset()) -> int:
    """The backlog of usable batches that actor ``actor_id``'s flow control sees in ``pending`` (files
    not judged yet): all of its own (an actor never outruns itself), at most ``cap`` of each other actor
    (one actor flooding the store cannot fill the fleet's backlog and stop the honest ones), and none
    of an actor in ``uncounted`` (its newest judged file was junk: its files are no backlog to wait for)."""
    per_actor = Counter(parsed[1] for parsed in map(layout.parse_rollout_key, (key for _, key in pending)) if parsed)
    return sum(n if actor == actor_id else 0 if actor in uncounted else min(n, cap) for actor, n in per_actor.items())


class ConsumedIndex:
    """The set of rollout keys the ledger has settled (used, dropped or quarantined), read incrementally.

    Ledger entries are immutable, so each is read once and cached; actors use this for flow control
    (``backlog``), with what the learner's collection in progress has judged so far (``layout.COLLECTING``).
    """

    def __init__(self, store: ObjectStore):
        self.store = store
        self._read: set[str] = set()
        self.settled: set[str] = set()
        self.latest_step = 0
        """The newest step whose files the learner has chosen (0 before the first): it trains that
        step or has finished it, so its next collection happens at learner version ``latest_step``.
        Read from the listing each time, so a resume that moves newer entries aside lowers it."""
        self.junk: dict[str, bool] = {}
        """Per actor: whether the newest entry that judged its files found junk (``_junk_verdicts``)."""
        self.judging: set[str] = set()
        """Files the collection in progress (of step ``latest_step + 1``) judged and left in place."""
        self.judging_junk: set[str] = set()
        """Actors whose files the collection in progress found junk."""

    def refresh(self) -> set[str]:
        keys = consumed_keys(self.store)
        self.latest_step = max((s for s in map(layout.step_of_consumed_key, keys) if s is not None), default=0)
        for key in sorted(keys, key=lambda k: (layout.step_of_consumed_key(k) or 0, k)):  # oldest verdicts first
            if key in self._read:
                continue
            record = self.store.get_json(key)
            for section in SECTIONS:
                self.settled.update(item["key"] for item in record.get(section, []))
            self.junk.update(_junk_verdicts(record))
            self._read.add(key)
        self._refresh_collecting()
        return self.settled

    def _refresh_collecting(self) -> None:
        """The collection in progress; a record of another step (written before the newest entry, or by
        a timeline a resume moved aside) says nothing about the backlog now."""
        try:
            record = self.store.get_json(layout.COLLECTING)
        except NotFound:
            record = {}
        current = isinstance(record, dict) and record.get("step") == self.latest_step + 1
        self.judging = set(record.get("judged", [])) if current else set()
        self.judging_junk = set(record.get("junk", [])) if current else set()

    def backlog(self, actor_id: str, oldest_version: int, newest_version: int, cap: int) -> int:
        """The batches of versions ``oldest_version`` to ``newest_version`` that wait for the learner, as
        actor ``actor_id``'s flow control counts them (``fleet_backlog``), from the last ``refresh``."""
        pending = pending_rollouts(self.store, self.settled | self.judging, oldest_version, newest_version)
        uncounted = {actor for actor, junk in self.junk.items() if junk} | self.judging_junk
        return fleet_backlog(pending, actor_id, cap, uncounted)

