"""Who fetches from whom: a relay forest assigned per version by a deterministic rule.

The learner lists the live peers when it publishes a version and signs the list into the
manifest, so every actor derives the same tree. Peers are ordered by sha256(version, id), which
rotates the roots and inner nodes from version to version. With ``roots`` roots and fan-out
``f``, node k (k >= roots) has parent (k - roots) // f: f = 1 is a chain per root.
"""

from __future__ import annotations

import hashlib
import json
import time

from echo2.data.store import NotFound, ObjectStore

PEERS_PREFIX = "peers/"


def order(peer_ids: list[str], version: int) -> list[str]:
    return sorted(peer_ids, key=lambda p: hashlib.sha256(f"{version}:{p}".encode()).hexdigest())


def parent_index(k: int, *, fanout: int, roots: int) -> int | None:
    return None if k < roots else (k - roots) // fanout


def sources(relay: dict, actor_id: str) -> list[str]:
    """URLs to fetch from, best first: parent, then its ancestors up to a root. Empty = store only."""
    peers: list[dict] = relay.get("peers", [])
    ids = [p["id"] for p in peers]
    if actor_id not in ids:
        return []
    out = []
    k: int | None = ids.index(actor_id)
    while (k := parent_index(k, fanout=relay["fanout"], roots=relay["roots"])) is not None:
        out.append(peers[k]["url"])
    return out


def plan(live: dict[str, str], version: int, *, fanout: int, roots: int) -> dict:
    """The relay section of a manifest: ordered peers (id, url) and the shape of the forest."""
    ids = order(list(live), version)
    return {"fanout": fanout, "roots": roots, "peers": [{"id": i, "url": live[i]} for i in ids]}


def register(store: ObjectStore, actor_id: str, url: str, version: int | None) -> None:
    """Heartbeat: the peer record is a pointer, rewritten every few seconds."""
    record = {"id": actor_id, "url": url, "version": version, "heartbeat": time.time()}
    store.put_pointer(f"{PEERS_PREFIX}{actor_id}.json", json.dumps(record).encode())


def live_peers(store: ObjectStore, *, max_age_s: float) -> dict[str, str]:
    now = time.time()
    out = {}
    for key in store.list(PEERS_PREFIX):
        try:
            record = store.get_json(key)
        except (NotFound, ValueError):  # a peer record removed or being rewritten: skip it this time
            continue
        if now - record.get("heartbeat", 0) <= max_age_s:
            out[record["id"]] = record["url"]
    return out


def unregister(store: ObjectStore, actor_id: str) -> None:
    store.delete(f"{PEERS_PREFIX}{actor_id}.json")
