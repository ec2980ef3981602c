"""Who fetches from whom: a relay forest assigned per version by a deterministic rule.

The learner lists the live peers when it publishes a version and signs the list into the
manifest, so every actor derives the same tree. Peers are ordered by sha256(version, id), which
rotates the roots and inner nodes from version to version. With ``roots`` roots and fan-out
``f``, node k (k >= roots) has parent (k - roots) // f: f = 1 is a chain per root.

Rates: the learner plans with the up- and download rates peers measured and put in their records
(``up_mbit``/``down_mbit``), fast peers near the roots with more children and slow ones at the leaves
(``forest.py`` has the rule and what bounds a liar's claim), and writes each peer's ``parent`` into the
plan (``shape: parents``), which actors read as it is. With no rate known that forest is the one above,
node for node. A plan without ``shape`` (every manifest before rates) is read with ``parent_index``.
An actor that registers joins the plan of the next version published, at the median rate until it
reports its own; until then (a version whose plan does not name it) it fetches from a fast leaf of its site's
forest, whose uplink is idle, and its ancestors (``guest_sources``), and reads the store where its site is not
known or has no peer.

Sites: where the fleet placed each actor (provider and region, from the ledger's launch, requested,
running and ready events: ``LaunchedActors.placement``, written by the learner's fleet, never by an actor),
the plan is one forest per site, so a parent is always in its child's provider and region and a copy
crosses a cloud or region boundary only where a site's root reads the store. Each peer of the plan carries
its ``site`` (``provider/region``; "" where the ledger says nothing) and the plan ``site_roots``: a site
gets ``roots`` roots where the store is (``store.provider``/``store.region``), where the store's place is
unknown, and in the unknown site "", and one root elsewhere (the copy that crosses). Within a site the rule
above holds over that site's peers in the hash order; the sites are listed in name order. A plan without
sites (no actor placed, as in tests of the relay alone, or a manifest from before sites) is the one forest
above.

Peer records (``peers/<actor>.json``) are written by untrusted actors and read by the learner
while it publishes, so ``read_peers`` takes nothing on trust and never raises on a record: a record
is read with one ranged GET of at most ``MAX_RECORD_BYTES`` + 1 bytes (whatever the object's size: a
multi-GB object costs 4 KB), and one that cannot be read (a GLACIER object: HEAD works, GET is 403),
is larger than that, or is not a small JSON object with an ``id`` equal to its key's actor name, an
``http(s)://host:port`` url and a finite numeric heartbeat is skipped and logged once. An actor can only
name itself. Liveness is judged by the store's own clock: the time the store committed the record
(``ObjectStore.modified``), not the heartbeat the actor claims, so a heartbeat from the future cannot
keep a dead peer live. A plan holds only actors the fleet launched (``LaunchedActors``, from the
ledger, which actors cannot write) and that are not revoked.

A child whose parent failed to deliver (fell behind what it is held to over a run, refused, died, sent bad
bytes, or delivered a version at under half the child's need; not a 404, the honest "I will not have it")
says so in its record: ``failed_parents: {parent: version}``.
The reporter itself asks that parent for nothing for ``REPORT_VERSIONS`` versions (``receiver.py``),
whatever the plans say. A parent reported by ``QUORUM`` distinct live children of the fleet is left out
of the plan (it then reads the store, as a root would, and relays for nobody) until the reports are
``REPORT_VERSIONS`` versions old; a peer that was merely restarting then gets its place back, a hostile
one costs one more hold and is reported again. Below quorum, a report moves nobody in the hash order (a
liar could use that to put itself above, or a victim right below, itself); in the rated forest one report
*demotes* the parent to the leaves for as long, but only if the learner's own signed plan of the reported
version had that parent among the reporter's sources (``verified_demotions``), so that a claimed rate
cannot keep a failed peer near the roots: a lone liar can send only its own ancestors to the leaves,
which costs speed; two colluding actors can send an honest peer to the store for ``REPORT_VERSIONS``
versions, which costs store reads, never correctness. A parent that holds every request costs each of
its children one hold (the first version it fails them), and is out of the plans once two have reported
it: with fan-out f >= 2 after the first version, in a chain after two (in the rated forest, at the leaves
after one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from echo2.broadcast.forest import half_octave, rated_forest, relayed_lately
from echo2.data import layout
from echo2.data.site import site_name, site_part
from echo2.data.store import NotFound, ObjectStore, StoreError

log = logging.getLogger("echo2.broadcast")

MAX_RECORD_BYTES = 4096
"""A real record is ~150 bytes (up to ~1.5 KB with ``MAX_FAILED_PARENTS`` reports); anything larger is
not one, and is never read past this bound."""
MAX_FAILED_PARENTS = 16
"""Parents a record may report at once (a child reports its parent and the ancestors it fell back to)."""
REPORT_VERSIONS = 20
"""How many versions a report of a failed parent counts for, after the version that failed."""
QUORUM = 2
"""Distinct reporters that take a parent out of the plan (one reporter only moves itself)."""
MAX_RATE_MBIT = 100_000.0
"""The largest up- or download rate (Mbit/s) a peer record may claim: 100 Gbit/s, above any NIC an actor
gets today. A claim that is not a finite number in (0, MAX_RATE_MBIT] is read as unknown (None), and the
record stays valid: a bad rate never costs a peer its place, it only loses what its rate would buy."""
READ_THREADS = 8
"""Peer records read at once while publishing (two small requests each: a HEAD, a ranged GET)."""

_URL_RE = re.compile(r"https?://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):(\d{1,5})")


class PeerRecord(NamedTuple):
    """A well-formed peer record: where the actor's relay listens, and the parents that failed it."""

    url: str
    heartbeat: float
    """What the actor claims; liveness uses the store's commit time of the record instead."""
    failed_parents: dict[str, int]
    """Parent actor -> the newest version it failed to deliver to this actor."""
    up_mbit: float | None = None
    """The upload rate the actor says it measured on real transfers (Mbit/s), None if unknown or invalid.
    Untrusted: planning caps it and demotes a peer its children report (``plan``)."""
    down_mbit: float | None = None
    """The download rate the actor says it measured (Mbit/s), None if unknown or invalid."""


def order(peer_ids: list[str], version: int) -> list[str]:
    return sorted(peer_ids, key=lambda p: hashlib.sha256(f"{version}:{p}".encode()).hexdigest())


def parent_index(k: int, *, fanout: int, roots: int) -> int | None:
    return None if k < roots else (k - roots) // fanout


def source_peers(relay: dict, actor_id: str) -> list[tuple[str, str]]:
    """(url, peer id) to fetch from, best first: parent, then its ancestors up to a root. Empty = store only.
    The id is who the peer must prove to be over TLS (``relay_tls.py``): the url is only where it says it is.
    In a plan with sites, only the peers of the actor's own site (see the module docstring). A plan of
    ``shape: parents`` (``forest.py``) names each peer's parent; one without a shape (every manifest before
    it) is ``parent_index`` over the peers' order; a shape this code does not know means the store."""
    peers: list[dict] = relay.get("peers", [])
    ids = [p["id"] for p in peers]
    if actor_id not in ids:
        return []
    if "shape" in relay:
        return _named_parents(relay, peers, actor_id) if relay["shape"] == "parents" else []
    roots = relay["roots"]
    if "site_roots" in relay:
        site = peers[ids.index(actor_id)].get("site", "")
        peers = [p for p in peers if p.get("site", "") == site]
        ids = [p["id"] for p in peers]
        roots = relay["site_roots"].get(site, roots)
    out = []
    k: int | None = ids.index(actor_id)
    while (k := parent_index(k, fanout=relay["fanout"], roots=roots)) is not None:
        out.append((peers[k]["url"], peers[k]["id"]))
    return out


def _named_parents(relay: dict, peers: list[dict], actor_id: str) -> list[tuple[str, str]]:
    """The chain of named parents up to a root, within the actor's site; it ends at a parent not in the plan,
    in another site, or already on the chain (the learner writes none of these; a chain never loops)."""
    by_id = {p["id"]: p for p in peers}
    site = by_id[actor_id].get("site", "")
    out: list[tuple[str, str]] = []
    seen = {actor_id}
    parent = by_id[actor_id].get("parent")
    while isinstance(parent, str) and parent in by_id and parent not in seen and by_id[parent].get("site", "") == site:
        seen.add(parent)
        out.append((by_id[parent]["url"], parent))
        parent = by_id[parent].get("parent")
    return out


def guest_sources(relay: dict, actor_id: str, site: str | None = None) -> list[tuple[str, str]]:
    """Where an actor that the version's plan does not name fetches that version from: a leaf of its site's
    forest, then the leaf's ancestors (then, as always, the store); empty = the store alone.

    Such an actor registered after the learner signed the plan (a replacement for a reclaimed one, joining
    mid-version); it is in the plan of the next version. Before, it read this version from the store, where it
    shares the store's uplink with the roots that the whole forest hangs from, so every joiner slowed every
    peer (measured: ``docs/runs/2026-12-03-broadcast-wan.md``, "Joiners"), and across clouds it pays the store's egress.
    A leaf's uplink is idle: the plan gives it no children. The leaf is one of the fastest the plan has: the plan lists
    each site's peers fastest first (``forest.py``), so the candidates are the leaves whose reported rate is in
    the half-octave of the first leaf's (all of them where no rate is known); a peer demoted to the leaves
    comes after every peer of its site and is not among them, whatever it claims. Among the candidates
    sha256(actor:peer) decides, so joiners spread over them. ``site``: the actor's own site
    (``provider/region``); in a plan with sites only that site's peers are candidates, and none where the site
    is unknown, so a joiner never pulls a version across a cloud or region boundary from a peer. A plan without
    explicit parents (``shape: parents``), or one naming the actor, gives nothing here."""
    if relay.get("shape") != "parents":
        return []
    peers = [p for p in relay.get("peers", []) if isinstance(p, dict) and isinstance(p.get("id"), str)]
    if any(p["id"] == actor_id for p in peers):
        return []
    if "site_roots" in relay:
        if site is None:
            return []
        peers = [p for p in peers if p.get("site", "") == site]
    parents = {p.get("parent") for p in peers}
    leaves = [p for p in peers if p["id"] not in parents and valid_url(p.get("url"))]
    if not leaves:
        return []

    def tier(peer: dict) -> float | None:
        up = rate(peer.get("up_mbit"))
        return None if up is None else half_octave(up)

    fastest = tier(leaves[0])
    guest = min((p for p in leaves if tier(p) == fastest),
                key=lambda p: hashlib.sha256(f"{actor_id}:{p['id']}".encode()).hexdigest())
    return [(guest["url"], guest["id"]), *source_peers(relay, guest["id"])]


def site_of(relay: dict, actor_id: str) -> str:
    """The site the plan places ``actor_id`` in ("" when it names none)."""
    return next((p.get("site", "") for p in relay.get("peers", []) if p.get("id") == actor_id), "")


def sources(relay: dict, actor_id: str) -> list[str]:
    """URLs to fetch from, best first (``source_peers`` without the ids)."""
    return [url for url, _ in source_peers(relay, actor_id)]


def plan(live: dict[str, str], version: int, *, fanout: int, roots: int,
         reports: dict[str, set[str]] | None = None, placement: dict[str, tuple[str, str]] | None = None,
         store_site: tuple[str, str] | None = None, rates: dict[str, float | None] | None = None,
         demoted: Collection[str] | None = None, latency: tuple[int, int, float] | None = None,
         measured: Collection[str] | None = None) -> dict:
    """The relay section of a manifest: ordered peers (id, url[, site][, parent]) and the shape of the forest.

    ``reports``: parent -> the children that reported it failed (``standing_reports``); a parent with
    ``QUORUM`` reporters is left out, the rest keep the hash order. ``placement``: actor -> (provider,
    region) from the ledger; given, the plan is one forest per site (module docstring), with ``store_site``
    the store's (provider, region), None if unknown. ``rates``: actor -> its uplink in Mbit/s (None or absent:
    unknown); given, the forest is bandwidth-aware and carries each peer's ``parent`` (``_rated_forest``), with
    ``demoted`` the peers planned at the leaves (None: every peer with a standing report below quorum), and
    ``latency`` = (version bytes, chunk bytes, round trip in s), where the caller knows them: the fan-out is at
    least what ``forest.latency_fanout`` models fastest, and ``measured`` the peers whose claims count in full
    when the roots are chosen (``forest.relayed_lately``; None: every claim does, as where the caller knows
    the rates)."""
    out = {p for p, who in (reports or {}).items() if len(who) >= QUORUM}
    ids = [i for i in order(list(live), version) if i not in out]
    site = {i: site_name(*placement[i]) if i in placement else "" for i in ids} if placement else None
    home = None if store_site is None else site_name(*store_site)
    sites = sorted(set(site.values())) if site is not None else []
    site_roots = {s: roots if home is None or s in (home, "") else 1 for s in sites} if site is not None else None
    if rates is not None:
        if demoted is None:
            demoted = {p for p, who in (reports or {}).items() if 0 < len(who) < QUORUM}
        return rated_forest(live, ids, fanout=fanout, roots=roots, site=site, site_roots=site_roots, rates=rates,
                            demoted=demoted, max_rate=MAX_RATE_MBIT, latency=latency, measured=measured)
    if site is None:
        return {"fanout": fanout, "roots": roots, "peers": [{"id": i, "url": live[i]} for i in ids]}
    ids = [i for s in sites for i in ids if site[i] == s]  # grouped by site, hash order within
    return {"fanout": fanout, "roots": roots, "site_roots": site_roots,
            "peers": [{"id": i, "url": live[i], "site": site[i]} for i in ids]}


def register(store: ObjectStore, actor_id: str, url: str, version: int | None,
             failed_parents: dict[str, int] | None = None, read_bytes: dict | None = None,
             up_mbit: float | None = None, down_mbit: float | None = None) -> None:
    """Heartbeat: the peer record is a pointer, rewritten every few seconds. ``read_bytes``: what the actor
    read so far (``fleet/bill/egress.py``: only the learner's bill reads it; planning ignores it). ``up_mbit``,
    ``down_mbit``: the rates the actor measured on its own real transfers (None: not measured yet); only
    valid ones are written (``rate``)."""
    record = {"id": actor_id, "url": url, "version": version, "heartbeat": time.time(),
              "failed_parents": dict(failed_parents or {})}
    if read_bytes is not None:
        record["read_bytes"] = read_bytes
    for name, value in (("up_mbit", up_mbit), ("down_mbit", down_mbit)):
        if (value := rate(value)) is not None:
            record[name] = value
    store.put_pointer(layout.peer_key(actor_id), json.dumps(record).encode())


def valid_url(url: object) -> bool:
    """``http(s)://host:port`` and nothing else: no user info, path, query or fragment."""
    return isinstance(url, str) and (m := _URL_RE.fullmatch(url)) is not None and 0 < int(m.group(1)) <= 65535


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def rate(x: object) -> float | None:
    """A claimed rate in Mbit/s if it is a finite number in (0, ``MAX_RATE_MBIT``], else None (unknown)."""
    return float(x) if _number(x) and 0 < x <= MAX_RATE_MBIT else None


def _version(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _failed_parents(value: object) -> dict[str, int] | str:
    if not isinstance(value, dict):
        return f"failed_parents {value!r} is not an object"
    if len(value) > MAX_FAILED_PARENTS:
        return f"failed_parents names {len(value)} parents (at most {MAX_FAILED_PARENTS})"
    for parent, version in value.items():
        if not layout.valid_actor_id(parent) or not _version(version):
            return f"failed_parents entry {parent!r}: {version!r} is not actor: version"
    return dict(value)


def parse_record(actor: str, raw: bytes) -> PeerRecord | str:
    """The record of ``actor``, or why it is malformed."""
    if len(raw) > MAX_RECORD_BYTES:
        return f"more than {MAX_RECORD_BYTES} bytes"
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, absurdly nested
        return f"not JSON ({exc})"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    if record.get("id") != actor:
        return f"id {record.get('id')!r} is not the actor {actor!r} it is filed under"
    if not valid_url(record.get("url")):
        return f"url {record.get('url')!r} is not http(s)://host:port"
    if not _number(record.get("heartbeat")):
        return f"heartbeat {record.get('heartbeat')!r} is not a number"
    if (v := record.get("version")) is not None and not _version(v):
        return f"version {v!r} is not a version"
    failed = _failed_parents(record.get("failed_parents", {}))
    if isinstance(failed, str):
        return failed
    return PeerRecord(record["url"], float(record["heartbeat"]), failed,
                      rate(record.get("up_mbit")), rate(record.get("down_mbit")))


class _Once:
    """Log each (store, key, reason) once: a bad record is met at every publish and must not flood the log."""

    def __init__(self, limit: int = 4096):
        self._seen: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()
        self._limit = limit

    def warn(self, store: ObjectStore, key: str, why: str) -> None:
        entry = (store.url, key, why)
        with self._lock:
            if entry in self._seen:
                return
            if len(self._seen) >= self._limit:  # bounded: a flood of keys cannot grow it for ever
                self._seen.clear()
            self._seen.add(entry)
        log.warning("skipping peer record %s: %s", key, why)


_once = _Once()


def _read_record(store: ObjectStore, key: str, actor: str, now: float, max_age_s: float) -> PeerRecord | None:
    """The record under ``key`` if it is live and well-formed; None (logged once) otherwise."""
    try:
        committed = store.modified(key)  # a HEAD: a dead record is never read at all
        age = now - committed
        if age > max_age_s:
            return None  # not rewritten lately: the actor is gone or hung
        if age < -max_age_s:  # the store's clock never runs that far ahead of ours: a forged time
            _once.warn(store, key, f"committed {-age:.0f} s in the future")
            return None
        raw = store.get_range(key, 0, MAX_RECORD_BYTES + 1)  # bounded, whatever the object's size
    except NotFound:  # removed (actor stopped) since the listing
        return None
    except (OSError, StoreError) as exc:  # GLACIER (PermissionError), SSE-C, an empty object's bad range ...
        _once.warn(store, key, f"cannot be read ({type(exc).__name__}: {exc})")
        return None
    parsed = parse_record(actor, raw)
    if isinstance(parsed, str):
        _once.warn(store, key, f"malformed: {parsed}")
        return None
    return parsed


def read_peers(store: ObjectStore, *, max_age_s: float) -> dict[str, PeerRecord]:
    """actor -> record of every live, well-formed peer record. Never raises on a bad record."""
    now = time.time()
    todo = []
    for key in store.list(layout.PEERS):
        if (actor := layout.actor_of_peer_key(key)) is None:
            _once.warn(store, key, "not a peer record name")
            continue
        todo.append((key, actor))
    if not todo:
        return {}
    with ThreadPoolExecutor(min(READ_THREADS, len(todo)), thread_name_prefix="echo2-peers") as pool:
        records = pool.map(lambda item: _read_record(store, item[0], item[1], now, max_age_s), todo)
        return {actor: record for (_, actor), record in zip(todo, records) if record is not None}


def live_peers(store: ObjectStore, *, max_age_s: float) -> dict[str, str]:
    """actor -> relay url of every live, well-formed record (``read_peers``)."""
    return {actor: record.url for actor, record in read_peers(store, max_age_s=max_age_s).items()}


def standing_reports(records: dict[str, PeerRecord], version: int) -> dict[str, set[str]]:
    """parent -> the peers that report it failed them within the last ``REPORT_VERSIONS`` versions before
    ``version``; only reports between peers of ``records`` (live, known, not revoked) count, and a report
    of a version not published yet (a time from the future) does not."""
    out: dict[str, set[str]] = {}
    for reporter, record in records.items():
        for parent, failed_at in record.failed_parents.items():
            if parent != reporter and parent in records and version - REPORT_VERSIONS <= failed_at <= version:
                out.setdefault(parent, set()).add(reporter)
    return out


class LaunchedActors:
    """Actor ids the fleet chose in this run ("requested" or "launch" events in the ledger, which the
    learner's fleet manager writes and actors' scoped credentials cannot), read incrementally: each event
    once. A peer record under any other name is not an actor of this fleet and never gets into a plan.
    ``placement``: actor -> (provider, region) from those events and its "running"/"ready" ones (the offer a
    launch landed on), the newest event read winning; actors no event places are not in it."""

    KINDS = frozenset({"requested", "launch"})
    PLACED_BY = frozenset({"requested", "launch", "running", "ready"})

    def __init__(self, store: ObjectStore):
        self.store = store
        self._read: set[str] = set()
        self.ids: set[str] = set()
        self.placement: dict[str, tuple[str, str]] = {}

    def __call__(self) -> set[str]:
        for key in self.store.list(layout.LEDGER_EVENTS):
            if key in self._read or not key.endswith(".json"):
                continue
            try:
                event = self.store.get_json(key)
            except NotFound:
                continue
            self._read.add(key)
            if not isinstance(event, dict) or not isinstance(actor := event.get("actor_id"), str):
                continue
            if event.get("kind") in self.KINDS:
                self.ids.add(actor)
            provider, region = event.get("provider"), event.get("region")
            if (event.get("kind") in self.PLACED_BY and isinstance(provider, str) and isinstance(region, str)
                    and site_part(provider) and site_part(region)):
                self.placement[actor] = (provider.lower(), region)
        return self.ids


def planning_rate(record: PeerRecord) -> float | None:
    """The rate a peer is planned with: its uplink, no more than its downlink where it reports one (a node
    cannot forward faster than it receives); None (unknown) without an uplink."""
    if record.up_mbit is None:
        return None
    return record.up_mbit if record.down_mbit is None else min(record.up_mbit, record.down_mbit)


def verified_demotions(records: dict[str, PeerRecord], reports: dict[str, set[str]],
                       plans: Callable[[int], dict | None]) -> set[str]:
    """The peers with standing reports below quorum that a reporter had among its sources (parent or an
    ancestor it fell back to) in the signed plan of the version it reports: ``plans(version)`` is that plan's
    relay section, None when unknown (then the report demotes nobody)."""
    out = set()
    for parent, who in reports.items():
        if len(who) >= QUORUM:
            continue
        for reporter in sorted(who):
            relay = plans(records[reporter].failed_parents[parent])
            if isinstance(relay, dict) and parent in (p for _, p in source_peers(relay, reporter)):
                out.add(parent)
                break
    return out


def relay_plan(store: ObjectStore, version: int, *, fanout: int, roots: int, max_age_s: float,
               revoked: Collection[str] = (), known: Collection[str] | None = None,
               placement: dict[str, tuple[str, str]] | None = None, store_site: tuple[str, str] | None = None,
               plans: Callable[[int], dict | None] | None = None) -> dict:
    """The relay section of version ``version``: the live peers that the fleet knows (``known``; None = no
    fleet to ask, as in tests of the relay alone) and that are not revoked, planned with their reports and
    the rates in their records (``forest.py``), one forest per site where ``placement`` is given (``plan``).
    ``plans``: version -> the relay section the learner signed for it (None if unknown), to check that a
    report's reporter fetched from whom it reports (``verified_demotions``) and whose claims were put to the
    test (``forest.relayed_lately``: only those choose a site's roots above the median); None: no report demotes, and
    every claim counts."""
    records = read_peers(store, max_age_s=max_age_s)
    strangers = {a for a in records if known is not None and a not in known}
    for actor in sorted(strangers):
        _once.warn(store, layout.peer_key(actor), "the fleet never launched this actor")
    records = {a: r for a, r in records.items() if a not in revoked and a not in strangers}
    reports = standing_reports(records, version)
    for parent, who in sorted(reports.items()):
        if len(who) >= QUORUM:
            log.warning("v%d: %s is left out of the relay plan: %s report it failed to deliver", version, parent,
                        ", ".join(sorted(who)))
    demoted = verified_demotions(records, reports, plans) if plans is not None else set()
    measured = relayed_lately(plans, version, REPORT_VERSIONS) if plans is not None else None
    for parent in sorted(demoted):
        log.info("v%d: %s is planned at the leaves: %s reported it failed to deliver", version, parent,
                 ", ".join(sorted(reports[parent])))
    return plan({a: r.url for a, r in records.items()}, version, fanout=fanout, roots=roots, reports=reports,
                placement=placement, store_site=store_site,
                rates={a: planning_rate(r) for a, r in records.items()}, demoted=demoted, measured=measured)


def unregister(store: ObjectStore, actor_id: str) -> None:
    store.delete(layout.peer_key(actor_id))
