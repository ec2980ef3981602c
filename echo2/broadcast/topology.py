"""Who fetches from whom: a relay forest assigned per version by a deterministic rule.

The learner lists the live peers when it publishes a version and signs the list into the
manifest, so every actor derives the same tree. Peers are ordered by sha256(version, id), which
rotates the roots and inner nodes from version to version. With ``roots`` roots and fan-out
``f``, node k (k >= roots) has parent (k - roots) // f: f = 1 is a chain per root.

Peer records (``peers/<actor>.json``) are written by untrusted actors and read by the learner
while it publishes, so ``live_peers`` takes nothing on trust: a record that is not a small JSON
object with an ``id`` equal to its key's actor name, an ``http(s)://host:port`` url and a finite
numeric heartbeat is logged and skipped, never raised. An actor can only name itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time

from echo2.data import layout
from echo2.data.store import NotFound, ObjectStore

log = logging.getLogger("echo2.broadcast")

MAX_RECORD_BYTES = 4096
"""A real record is ~150 bytes; anything much larger is not one (and is not worth parsing)."""

_URL_RE = re.compile(r"https?://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):(\d{1,5})")


def order(peer_ids: list[str], version: int) -> list[str]:
    return sorted(peer_ids, key=lambda p: hashlib.sha256(f"{version}:{p}".encode()).hexdigest())


def parent_index(k: int, *, fanout: int, roots: int) -> int | None:
    return None if k < roots else (k - roots) // fanout


def source_peers(relay: dict, actor_id: str) -> list[tuple[str, str]]:
    """(url, peer id) to fetch from, best first: parent, then its ancestors up to a root. Empty = store only.
    The id is who the peer must prove to be over TLS (``relay_tls.py``): the url is only where it says it is."""
    peers: list[dict] = relay.get("peers", [])
    ids = [p["id"] for p in peers]
    if actor_id not in ids:
        return []
    out = []
    k: int | None = ids.index(actor_id)
    while (k := parent_index(k, fanout=relay["fanout"], roots=relay["roots"])) is not None:
        out.append((peers[k]["url"], peers[k]["id"]))
    return out


def sources(relay: dict, actor_id: str) -> list[str]:
    """URLs to fetch from, best first (``source_peers`` without the ids)."""
    return [url for url, _ in source_peers(relay, actor_id)]


def plan(live: dict[str, str], version: int, *, fanout: int, roots: int) -> dict:
    """The relay section of a manifest: ordered peers (id, url) and the shape of the forest."""
    ids = order(list(live), version)
    return {"fanout": fanout, "roots": roots, "peers": [{"id": i, "url": live[i]} for i in ids]}


def register(store: ObjectStore, actor_id: str, url: str, version: int | None) -> None:
    """Heartbeat: the peer record is a pointer, rewritten every few seconds."""
    record = {"id": actor_id, "url": url, "version": version, "heartbeat": time.time()}
    store.put_pointer(layout.peer_key(actor_id), json.dumps(record).encode())


def valid_url(url: object) -> bool:
    """``http(s)://host:port`` and nothing else: no user info, path, query or fragment."""
    return isinstance(url, str) and (m := _URL_RE.fullmatch(url)) is not None and 0 < int(m.group(1)) <= 65535


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_record(actor: str, raw: bytes) -> tuple[str, float] | str:
    """(url, heartbeat) of the record of ``actor``, or why it is malformed."""
    if len(raw) > MAX_RECORD_BYTES:
        return f"{len(raw)} bytes"
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
    if (v := record.get("version")) is not None and (not isinstance(v, int) or isinstance(v, bool)):
        return f"version {v!r} is not a version"
    return record["url"], float(record["heartbeat"])


def live_peers(store: ObjectStore, *, max_age_s: float) -> dict[str, str]:
    """actor -> relay url of every well-formed record with a recent heartbeat. Never raises on a bad record."""
    now = time.time()
    out = {}
    for key in store.list(layout.PEERS):
        if (actor := layout.actor_of_peer_key(key)) is None:
            log.warning("skipping %s: not a peer record name", key)
            continue
        try:
            raw = store.get(key)
        except NotFound:  # removed (actor stopped) since the listing
            continue
        parsed = parse_record(actor, raw)
        if isinstance(parsed, str):
            log.warning("skipping malformed peer record %s: %s", key, parsed)
            continue
        url, heartbeat = parsed
        if now - heartbeat <= max_age_s:
            out[actor] = url
    return out


def unregister(store: ObjectStore, actor_id: str) -> None:
    store.delete(layout.peer_key(actor_id))
