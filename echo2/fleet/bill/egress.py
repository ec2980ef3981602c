"""Bytes out and their price: what each actor read, in the learner's ledger (the actors' own byte counters,
folded in by the learner), and what those bytes cost (``traffic_rows``).

An actor counts the policy bytes it read (``broadcast/receiver.py``): chunks from the store, and chunks from
relay peers by the parent's site (``provider/region`` from the signed relay plan, "" where the plan names
none). It reports them in its peer record (``peers/<actor>.json``, the one object besides its rollout files
that its credentials may write), as ``read_bytes``::

    {"store": <int>, "peers": {"<provider>/<region>": <int>, ...}}

Counters are cumulative over the actor's life; an actor id is used for one life only (the fleet draws a new
one per launch), so the larger of two readings is the newer. The learner (trusted) copies them into its
ledger with ``fold_counters``, the one fold every caller uses: at every publish (``learner/publisher.py``), when
the fleet stops (``fleet/manager.py``) and when the cost report is written (``report.py``), for the actors its
fleet launched, as ``ledger/egress/<actor>.json``, keeping per counter the largest value it has seen.
``traffic_rows`` prices those snapshots for the cost report; a peer record is deleted when its actor stops,
so what an actor read after the learner's last fold and before a clean stop is not in the bill (at most the
versions published since that fold: the fold at each publish bounds it to about one version per actor).

The counters are untrusted input, and they only ever affect the bill: nothing plans, trains or waits on them.
A record is read with one ranged GET of at most ``MAX_RECORD_BYTES`` + 1 bytes; one that cannot be read,
is larger, is not JSON, names another actor, or whose ``read_bytes`` is not the shape above (non-negative
integers up to ``MAX_COUNTER``, at most ``MAX_SITES`` sites of the site pattern) is skipped, logged once
per (actor, reason), and never raises. Each counter is then capped by what the actor could have read:
``READS_PER_BYTE`` times every byte of every version the run published (``layout.PUBLISHED_BYTES``, which each
fold brings up to date from the signed manifests in ``policy/``: versions are collected later, so the sum is
kept), logged once where a claim is cut. An actor can inflate its own bill up to that cap, or report less than
it read (its own bill, never below what the learner saw before: snapshots only grow); it cannot change another
actor's. A store where no version was ever published (no manifest, no sum) has nothing to bound by: there the
cap is ``MAX_COUNTER``.

Prices (``traffic_rows``, with ``providers.transfer_usd_per_gb``): bytes from the store from where the store lives
(``store.provider``/``store.region`` in ``run.json``'s config) to the actor's placement (its billing row's provider
and region, from its ledger events), bytes from peers from the parent's site (``provider/region`` as the signed
relay plan named it) to the actor's, and from an unknown site ("") as if within the actor's own site (what a
transfer within a site costs: $0 on hyperscalers). Where the store's place, the actor's provider, or (within the
store's provider) its region is not known, those bytes are counted and unpriced, and the report says so.

Assumption: a GB is 10^9 bytes (cloud providers bill per GB; the report prices bytes / 1e9).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from echo2.data import layout
from echo2.data.ledger import read_events
from echo2.data.rollouts import policy_digest
from echo2.data.site import split_site
from echo2.data.store import NotFound, ObjectStore, StoreError
from echo2.fleet.bill.ledger import STARTS
from echo2.fleet.providers import transfer_usd_per_gb

log = logging.getLogger("echo2.fleet")

FIELD = "read_bytes"
"""The peer record's field (``broadcast/topology.register``)."""
EGRESS = layout.LEDGER_EGRESS
"""The learner's snapshots, one object per actor (``layout`` spells no other ledger folder for it yet)."""
MAX_RECORD_BYTES = 4096
"""A peer record is never read past this (the same bound as ``broadcast/topology.MAX_RECORD_BYTES``)."""
MAX_SITES = 8
"""Peer sites one record may name (``broadcast/receiver.py`` keeps at most this many, the rest under "")."""
MAX_COUNTER = 2**50
"""The largest counter taken (about 1.1 PB): an absurd claim is refused, not billed."""
READS_PER_BYTE = 2
"""How often an actor may read one published byte: from a peer, and again from the store after a bad chunk."""
READ_THREADS = 8
GB = 1e9

_SITE_RE = re.compile(r"^$|^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}/[A-Za-z0-9?][A-Za-z0-9_.?-]{0,63}$")


class ReadBytes(NamedTuple):
    """What one actor read: bytes from the store, and from peers per the parent's site ("" = unknown)."""

    store: int
    peers: dict[str, int]

    def merged(self, other: "ReadBytes") -> "ReadBytes":
        """Per counter the larger of the two (counters only grow within an actor's life)."""
        sites = set(self.peers) | set(other.peers)
        return ReadBytes(max(self.store, other.store),
                         {s: max(self.peers.get(s, 0), other.peers.get(s, 0)) for s in sorted(sites)})

    def as_json(self) -> dict:
        return {"store": self.store, "peers": dict(self.peers)}

    def capped(self, cap: int) -> "ReadBytes":
        """Each counter at most ``cap``."""
        return ReadBytes(min(self.store, cap), {s: min(n, cap) for s, n in self.peers.items()})


def egress_key(actor_id: str) -> str:
    return f"{EGRESS}{actor_id}.json"


def _counter(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_COUNTER


def parse_read_bytes(value: object) -> ReadBytes | str:
    """``value`` as counters, or why it is not (see the module docstring for the shape)."""
    if not isinstance(value, dict) or set(value) - {"store", "peers"}:
        return f"{FIELD} is not an object of store and peers"
    store, peers = value.get("store", 0), value.get("peers", {})
    if not _counter(store):
        return f"{FIELD}.store {store!r} is not a byte count (0..{MAX_COUNTER})"
    if not isinstance(peers, dict) or len(peers) > MAX_SITES:
        return f"{FIELD}.peers is not an object of at most {MAX_SITES} sites"
    for site, n in peers.items():
        if not isinstance(site, str) or not _SITE_RE.match(site) or not _counter(n):
            return f"{FIELD}.peers entry {str(site)[:80]!r}: {n!r} is not site: byte count"
    return ReadBytes(store, dict(peers))


class _Once:
    def __init__(self, limit: int = 4096):
        self.seen: set[tuple[str, str]] = set()
        self.limit = limit

    def warn(self, actor: str, why: str, what: str = "not billing the read_bytes of") -> None:
        if (actor, why) in self.seen:
            return
        if len(self.seen) >= self.limit:
            self.seen.clear()
        self.seen.add((actor, why))
        log.warning("%s %s: %s", what, actor, why)


_once = _Once()


def read_reported(store: ObjectStore, actors: Collection[str]) -> dict[str, ReadBytes]:
    """actor -> the counters in its peer record, for the ``actors`` given that have a well-formed one.
    Never raises on a record (a store that is down does raise)."""
    wanted = set(actors)
    todo = [(k, a) for k in store.list(layout.PEERS) if (a := layout.actor_of_peer_key(k)) in wanted]

    def read(item: tuple[str, str]) -> ReadBytes | None:
        key, actor = item
        try:
            raw = store.get_range(key, 0, MAX_RECORD_BYTES + 1)
        except NotFound:
            return None
        except (OSError, StoreError) as exc:  # GLACIER, SSE-C, an empty object's bad range ...
            _once.warn(actor, f"its record cannot be read ({type(exc).__name__})")
            return None
        if len(raw) > MAX_RECORD_BYTES:
            _once.warn(actor, f"its record is larger than {MAX_RECORD_BYTES} bytes")
            return None
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):
            _once.warn(actor, "its record is not JSON")
            return None
        if not isinstance(record, dict) or record.get("id") != actor or FIELD not in record:
            return None  # not a record of this actor, or one without counters (nothing read yet, an old actor)
        parsed = parse_read_bytes(record[FIELD])
        if isinstance(parsed, str):
            _once.warn(actor, parsed)
            return None
        return parsed

    if not todo:
        return {}
    with ThreadPoolExecutor(min(READ_THREADS, len(todo)), thread_name_prefix="echo2-egress") as pool:
        return {a: r for (_, a), r in zip(todo, pool.map(read, todo)) if r is not None}


def read_snapshots(store: ObjectStore) -> dict[str, ReadBytes]:
    """actor -> the counters the learner folded into its ledger (malformed snapshots are skipped)."""
    out: dict[str, ReadBytes] = {}
    for key in store.list(EGRESS):
        if not key.endswith(".json"):
            continue
        actor = key[len(EGRESS):-len(".json")]
        try:
            value = store.get_json(key)
        except (NotFound, ValueError):
            continue
        parsed = parse_read_bytes({k: v for k, v in value.items() if k in ("store", "peers")}
                                  if isinstance(value, dict) else None)
        if layout.valid_actor_id(actor) and not isinstance(parsed, str):
            out[actor] = parsed
    return out


class EgressLedger:
    """The learner's side: ``fold`` copies actors' counters into the ledger, writing a snapshot only when it
    grew. Keeps what it wrote, so a fold costs one listing and one small GET per actor's record. Callers fold
    through ``fold_counters``."""

    def __init__(self, store: ObjectStore):
        self.store = store
        self.written: dict[str, ReadBytes] | None = None
        self._published: dict | None = None  # what ``layout.PUBLISHED_BYTES`` holds, as last read or written
        self._manifests: dict[str, tuple[str, int]] = {}  # version folder -> (its manifest's digest, its bytes)

    def could_read(self) -> int:
        """The most bytes one actor could have read, per counter (see the module docstring); brings the sum of
        published bytes up to date first (a listing of ``policy/`` and one GET per version not seen before)."""
        if self._published is None:
            try:
                record = self.store.get_json(layout.PUBLISHED_BYTES)
            except (NotFound, ValueError):
                record = {}
            record = record if isinstance(record, dict) else {}
            total, counted = record.get("total"), record.get("counted")
            self._published = {"total": total if _counter(total) else 0,
                               "counted": {str(k): str(v) for k, v in counted.items()} if isinstance(counted, dict)
                               else {}}
        names = [n for n in self.store.list_folders(layout.POLICY) if layout.parse_version_dir(n) is not None]
        total, counted = self._published["total"], dict(self._published["counted"])
        for name in names:
            if name not in self._manifests:
                try:
                    manifest = self.store.get_json(layout.manifest_key(layout.POLICY + name))
                except (NotFound, ValueError):
                    continue  # not committed yet
                files = manifest.get("files") if isinstance(manifest, dict) else None
                size = sum(e["size"] for e in files or [] if isinstance(e, dict) and _counter(e.get("size")))
                self._manifests[name] = (policy_digest(manifest), size)
            digest, size = self._manifests[name]
            if counted.get(name) != digest:  # a new version, or a number a resumed learner published again
                total, counted[name] = total + size, digest
        counted = {n: d for n, d in counted.items() if n in names}  # collected versions are summed already
        if (total, counted) != (self._published["total"], self._published["counted"]):
            self._published = {"total": total, "counted": counted}
            self.store.put_pointer(layout.PUBLISHED_BYTES, json.dumps(self._published).encode())
        return min(MAX_COUNTER, READS_PER_BYTE * total) if total else MAX_COUNTER

    def fold(self, actors: Collection[str]) -> dict[str, ReadBytes]:
        """Fold the records of ``actors`` (those the fleet launched) in, each counter capped by ``could_read``;
        returns every snapshot. A failure of the store is logged, not raised: it only delays the bill to the
        next fold."""
        try:
            if self.written is None:
                self.written = read_snapshots(self.store)
            cap = self.could_read()
            for actor, reported in read_reported(self.store, actors).items():
                if reported.capped(cap) != reported:
                    _once.warn(actor, "it claims more than it could have read",
                               f"billing at most {cap} bytes a counter (what the run published, twice) for")
                    reported = reported.capped(cap)
                before = self.written.get(actor)
                now = reported if before is None else before.merged(reported)
                if now != before:
                    self.store.put_pointer(egress_key(actor), json.dumps(
                        {"actor_id": actor, **now.as_json(), "folded_at": time.time()}).encode())
                    self.written[actor] = now
        except (OSError, StoreError) as exc:
            log.warning("egress counters not folded into the ledger this time: %s", exc)
        return dict(self.written or {})


def fold_counters(store: ObjectStore, actors: Collection[str] | None = None, *,
                  ledger: EgressLedger | None = None) -> dict[str, ReadBytes]:
    """Fold the byte counters of ``actors`` into the ledger (``EgressLedger.fold``: never raises on a record, a
    store failure is logged); returns every snapshot. ``actors``: those the fleet launched, None for every actor
    the ledger's start events name. ``ledger``: the one a caller keeps across folds (the publisher's: it
    remembers what it wrote), else a fresh one for this fold."""
    if actors is None:
        actors = {str(e.get("actor_id")) for e in read_events(store)
                  if isinstance(e, dict) and e.get("kind") in STARTS}
    return (ledger if ledger is not None else EgressLedger(store)).fold(actors)


Place = tuple[str | None, str | None]
"""(provider, region) of an actor or of the store, None where unknown."""


def places(rows: list[dict]) -> dict[str, Place]:
    """actor -> (provider, region) as its billing rows (``ledger.worker_rows``) know them (None where unknown)."""
    out: dict[str, Place] = {}
    for r in rows:
        if r["role"] == "learner":
            continue
        provider = r["provider"] if r["provider"] not in (None, "?") else None
        out[r["actor_id"]] = (provider and provider.lower(), r["region"] if r["region"] not in ("-", "") else None)
    return out


def _usd_per_gb(src: Place | None, dst: Place) -> float | None:
    """``transfer_usd_per_gb`` from ``src`` to ``dst``, or None where what is unknown decides the price."""
    if src is None or src[0] is None or dst[0] is None:
        return None
    if src[0] != dst[0]:  # across providers: the sender's internet egress (+ ingress), whatever the regions
        return transfer_usd_per_gb(src[0], src[1] or "?", dst[0], dst[1] or "?")
    if src[1] in (None, "?") or dst[1] is None:
        return None  # within one provider: same region or not decides, and one is unknown
    return transfer_usd_per_gb(src[0], src[1], dst[0], dst[1])


def traffic_rows(reads: dict[str, ReadBytes], placement: dict[str, Place],
                 store_at: tuple[str, str] | None) -> list[dict]:
    """One row per actor the fleet launched with counters: bytes from the store and from peers, priced (module
    docstring). ``reads``: ``read_snapshots``; ``placement``: ``places`` of the billing rows."""
    rows = []
    for actor, read in sorted(reads.items()):
        if actor not in placement:
            continue  # not an actor of this fleet's ledger: nothing to bill it to
        at = placement[actor]
        store_price = _usd_per_gb(store_at, at)
        usd, unpriced = 0.0, 0
        if store_price is None:
            unpriced += read.store
        else:
            usd += read.store / GB * store_price
        for site, n in read.peers.items():
            parent = split_site(site)
            price = _usd_per_gb(at if parent is None else (parent[0].lower(), parent[1]), at)
            if price is None:
                unpriced += n
            else:
                usd += n / GB * price
        rows.append({"actor_id": actor, "provider": at[0], "region": at[1], "bytes_from_store": read.store,
                     "bytes_from_peers": sum(read.peers.values()), "peers_by_site": dict(read.peers),
                     "store_usd_per_gb": store_price, "usd": usd, "unpriced_bytes": unpriced})
    return rows
