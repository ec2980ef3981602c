"""The actor's side of dissemination: follow ``policy/LATEST``, receive each new version through
the relay (parent peer first, store as fallback) in the background, hand over verified files. From
the store, where it can stream (``ObjectStore.can_stream``: local files and S3), each run of chunks of a
file is one streamed ranged read (``ObjectStore.stream_range``), a chunk at a time, in order (``Fetcher``);
elsewhere, or for what a broken stream left, one ``get_range`` per chunk.

A version is handed over only when every chunk matched the signed manifest; a manifest whose
signature fails under the run's public key (``run.json``), or that names anything but plain
files of its own folder, is rejected: never fetched, never loaded, never relayed (a relay node
only serves versions this receiver started). The receiver holds no key that signs: the public
key verifies manifests and peers' relay tokens; the actor's own token only authenticates its
requests. The newest signed manifest's ``revoked`` list says whose tokens this relay refuses (a lower-numbered
one, a resumed learner's new timeline, adds its list to the one in force: it never takes a revocation back).
With ``tls`` (``relay_tls.py``) the relay speaks mutual TLS with the actor's certificate, and the
revoked list also covers certificates and the parents this node will fetch from.

Which version to receive, with S the run's staleness bound (``train.staleness``): while version
p is being fetched and LATEST says L > p, the fetch goes on if L - p < S (a rollout generated
with p still has slack when p lands, so finishing p beats starting over), and is abandoned for
L once L - p >= S (p would be too stale to be useful). Cancelling on every new LATEST instead
would mean that, when versions are published faster than one can be fetched, none ever
arrives. When a fetch completes (or fails), the same poll starts the newest LATEST if it is
newer. A LATEST that moved back (a resumed learner) replaces the fetch in flight. A resumed learner
also publishes again the numbers after its checkpoint: a version number is not an identity, so while
LATEST names the version held, its manifest's modification time is compared with the one fetched (a
HEAD at most every ``identity_check_s``); another manifest under the same number (the new timeline's),
or none (moved to ``orphaned/``), and the version held is dropped and LATEST fetched again.

Everything read from the store is input from outside the actor: a LATEST that is not
``{"version": <int >= 0>}`` is logged and skipped until it changes; a manifest that is not a
JSON object, names a file outside its folder, fails its signature, or is signed for another
version is logged and rejected for good (a manifest is written once). Neither ever stops the actor;
while LATEST names a rejected version the receiver takes the newest version folder it has not
rejected, so a forged pointer cannot hold it back either.

A parent of the plan that failed to deliver (``relay.py``: fell behind the rate it is held to over a run,
refused, died, sent bad bytes), or that delivered a version at under half this actor's need, is remembered
with the version it failed: the receiver asks it for nothing for
``topology.REPORT_VERSIONS`` versions, whatever later plans say, and reports it in its peer record
(``failed_parents``), from which the learner plans around it (``topology.plan``).

Rates: the receiver puts the upload and download rates its relay measured on real transfers
(``relay_node.RelayNode.rates``, ``rates.py``) in its peer record at every heartbeat (``up_mbit``,
``down_mbit``; None until enough moved), for the learner's plan. It holds each parent to its share of the
upload the signed plan carries for it (``up_mbit`` over the plan's fan-out, where the plan has it) and to
what this actor needs: the version's chunk bytes over the median of the last (up to five) times between
new LATEST versions as this actor saw them, once it saw two (``rates.min_rate_mbit``).

What the actor read, for the bill (``fleet/bill/egress.py``): every chunk byte read from the store (counted as it
is read, whatever becomes of its fetch: abandoned, failed or a delta chain's link) and every chunk byte a
parent peer delivered and that matched the manifest, per the parent's site in the signed plan (counted when
its fetch ends, done or not; a chunk that failed its hash is not counted). Manifests and pointers (a few KB)
are not counted. The counters go into the peer record (``read_bytes``) at every heartbeat, and a fetch that
ends wakes the heartbeat at once; with ``broadcast.mode: store`` (no heartbeat) the record is written after
each fetch ends, for the counters alone (the learner plans nothing in store mode), and removed at ``close``
as in relay mode.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import statistics
import threading
import time
from concurrent.futures import Future
from typing import Iterator

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from echo2.broadcast import topology
from echo2.broadcast.protocol import FetchPolicy, Peer, VersionBuffer
from echo2.broadcast.relay_node import RelayNode
from echo2.broadcast.relay_tls import RelayTLS
from echo2.config import BroadcastConfig
from echo2.data import layout
from echo2.data.manifest import Chunk, ManifestRejected, chunk_table, verify_signature
from echo2.data.relay_tokens import RelayAuth
from echo2.data.store import NotFound, ObjectStore
from echo2.data.weights import read_manifest

log = logging.getLogger("echo2.broadcast")

MAX_PEER_SITES = 8
"""Sites the counters may hold (``fleet/bill/egress.py``'s ``MAX_SITES``), "" included: bytes from parents of
further sites count under "" (unknown, billed as within the actor's own site)."""
IDENTITY_CHECK_S = 10.0
"""How often the manifest of the version held is checked to still be the one in the store (one HEAD)."""


class PolicyReceiver:
    def __init__(self, store: ObjectStore, actor_id: str, public_key: Ed25519PublicKey, relay_token: str,
                 config: BroadcastConfig, *, staleness: int, run_id: str, tls: RelayTLS | None = None,
                 site: str | None = None):
        """``public_key``: the run's, from ``run.json`` (verifies manifests and peers' tokens);
        ``relay_token``: this actor's own, which its requests to peers carry (it cannot sign anything);
        ``tls``: this actor's certificate and the run's CA, where the relay speaks TLS (``relay_tls``);
        ``site``: this machine's ``provider/region`` where known (``rollout/machine.machine_site``): a version
        whose plan does not name this actor yet is then fetched from a leaf of that site
        (``topology.guest_sources``)."""
        self.store = store
        self.actor_id = actor_id
        self.site = site
        self.public_key = public_key
        self.config = config
        self.staleness = staleness
        policy = FetchPolicy(expected_mbit=config.expected_mbit, min_rate_fraction=config.min_rate_fraction,
                             floor_mbit=config.floor_mbit, pipeline_wait_s=config.pipeline_wait_s,
                             answer_grace_s=config.answer_grace_s, window=config.window)
        self.auth = RelayAuth(public_key, run_id)
        # only an ObjectStore that says it streams: a stand-in that wraps one (overriding get_range, delegating
        # the rest) would otherwise have its chunk reads go around its get_range
        streams = isinstance(store, ObjectStore) and store.can_stream
        self.node = RelayNode(relay_token, self.auth, self._store_read, host=config.host, port=config.port,
                              policy=policy, tls=tls, store_stream=self._store_stream if streams else None)
        self._revocations_of: int | None = None  # the version whose revoked list is in force
        self.current: int | None = None
        self.last_fetch_seconds: float | None = None
        """Seconds the newest completed fetch took, from its start to the last chunk verified."""
        self.rejected: set[int] = set()
        self.identity_check_s = IDENTITY_CHECK_S
        self._held_stamp: float | None = None  # modification time of the held version's manifest
        self._pending_stamp: float | None = None
        self._identity_checked_at = 0.0
        self._pending: tuple[int, Future] | None = None
        self._pending_sites: dict[str, str] = {}  # str(Peer) -> site, of the fetch in flight
        self._bad_latest: bytes | None = None  # the malformed LATEST already logged
        self._failed_parents: dict[str, int] = {}
        """Parent -> the newest version it failed to deliver to us (written on the relay loop, read by the
        heartbeat)."""
        self._failed_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._read_store = 0
        self._read_peers: dict[str, int] = {}
        """Parent's site -> chunk bytes parents there delivered (``read_bytes``)."""
        self._registered = False
        self._newest_seen: int | None = None
        self._newest_seen_at: float | None = None
        self._intervals: collections.deque[float] = collections.deque(maxlen=5)
        self._stop = threading.Event()
        self._wake = threading.Event()  # a beat now (a fetch ended), not at the next heartbeat_s
        self._heartbeat: threading.Thread | None = None
        if config.mode == "relay":
            self._beat()
            self._heartbeat = threading.Thread(target=self._beat_loop, name="echo2-heartbeat", daemon=True)
            self._heartbeat.start()

    @property
    def url(self) -> str:
        advertised = self.config.advertise_host or self.config.host
        scheme = "https" if self.node.server.tls is not None else "http"
        return f"{scheme}://{advertised}:{self.node.server.port}"

    def _store_read(self, chunk: Chunk, manifest: dict) -> bytes:
        key = f"{layout.policy_dir(int(manifest['version']))}/{chunk.file}"
        data = self.store.get_range(key, chunk.offset, chunk.offset + chunk.size)
        with self._read_lock:
            self._read_store += len(data)
        return data

    def _store_stream(self, chunks: list[Chunk], manifest: dict) -> Iterator[bytes]:
        """Consecutive chunks of one file as one streamed ranged read, each chunk's bytes counted as it is read."""
        key = f"{layout.policy_dir(int(manifest['version']))}/{chunks[0].file}"
        for data in self.store.stream_range(key, chunks[0].offset, [chunk.size for chunk in chunks]):
            with self._read_lock:
                self._read_store += len(data)
            yield data

    @property
    def read_bytes(self) -> dict:
        """What this actor read so far: {"store": bytes, "peers": {parent's site: bytes}} (a copy)."""
        with self._read_lock:
            return {"store": self._read_store, "peers": dict(self._read_peers)}

    def _count_peer_chunks(self, buffer: VersionBuffer, sites: dict[str, str]) -> None:
        """Add the chunks of ``buffer`` that peers delivered; ``sites``: str(Peer) -> the parent's site."""
        with self._read_lock:
            for chunk, source in zip(buffer.chunks, buffer.sources):
                if source is not None and source in sites:
                    site = sites[source]
                    named = len(self._read_peers) - ("" in self._read_peers)
                    if site not in self._read_peers and named >= MAX_PEER_SITES - 1:
                        site = ""  # at most MAX_PEER_SITES - 1 named sites and "": the record stays valid
                    self._read_peers[site] = self._read_peers.get(site, 0) + chunk.size

    def _fetch_ended(self, future: Future, manifest: dict, sites: dict[str, str]) -> None:
        """Count what peers delivered to a fetch that failed or was cancelled (a done one: ``_collect``)."""
        if not future.cancelled() and future.exception() is None:
            return
        buffer = self.node.server.buffers.get(int(manifest["version"]))
        if buffer is not None and buffer.manifest is manifest:  # else dropped by the relay: uncounted
            self._count_peer_chunks(buffer, sites)

    def _beat(self) -> None:
        up, down = self.node.rates
        topology.register(self.store, self.actor_id, self.url, self.current, self.failed_parents, self.read_bytes,
                          up_mbit=up, down_mbit=down)
        self._registered = True

    def _saw_latest(self, latest: int) -> None:
        """Note when a newer LATEST was first seen: the time between versions is what a fetch has."""
        if self._newest_seen is None or latest > self._newest_seen:
            now = time.monotonic()
            if self._newest_seen is not None and self._newest_seen_at is not None:
                self._intervals.append(now - self._newest_seen_at)
            self._newest_seen, self._newest_seen_at = latest, now

    def need_mbit(self, manifest: dict) -> float | None:
        """The rate at which ``manifest``'s version must arrive to keep up with publishing: its chunk bytes
        over the median time between the learner's last versions as this actor saw them; None before two
        intervals were seen (``rates.min_rate_mbit``)."""
        if len(self._intervals) < 2:
            return None
        interval = statistics.median(self._intervals)
        size = sum(chunk.size for chunk in chunk_table(manifest))
        return size * 8 / max(interval, 0.1) / 1e6 if size else None

    @property
    def failed_parents(self) -> dict[str, int]:
        """Parents that failed to deliver to this actor lately -> the newest version each failed (a copy)."""
        with self._failed_lock:
            return dict(self._failed_parents)

    def _parent_failed(self, peer: Peer, version: int, why: str) -> None:
        """A parent left mid-fetch for a failure (not a 404): asked for nothing for a while, and reported."""
        with self._failed_lock:
            self._failed_parents[peer.actor_id] = max(version, self._failed_parents.get(peer.actor_id, version))
            newest = sorted(self._failed_parents.items(), key=lambda kv: kv[1])[-topology.MAX_FAILED_PARENTS:]
            self._failed_parents = dict(newest)  # the record stays small: the most recent reports win

    def _avoided(self, version: int) -> set[str]:
        """Parents not to ask for ``version``: those that failed us within ``REPORT_VERSIONS`` before it."""
        with self._failed_lock:
            self._failed_parents = {p: v for p, v in self._failed_parents.items()
                                    if v >= version - topology.REPORT_VERSIONS}
            return set(self._failed_parents)

    def _beat_loop(self) -> None:
        while True:
            self._wake.wait(self.config.heartbeat_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._beat()
            except Exception as exc:  # a missed heartbeat only makes us look dead for a while
                log.warning("heartbeat failed: %s", exc)

    def poll(self) -> VersionBuffer | None:
        """Return a version that finished, verified (or None); start receiving LATEST if the rule says so."""
        done = self._collect()
        latest = self._latest()
        if latest is not None:
            self._saw_latest(latest)
        if latest is not None and self._orphaned(latest):
            log.warning("v%d was published again (a resumed learner's new timeline): fetching it again", latest)
            self.current = self._held_stamp = None
        if latest is not None and latest in self.rejected:
            latest = self._newest_not_rejected()
        if latest is not None and latest not in self.rejected and self._wanted(latest):
            self._begin(latest)
        return done

    def _manifest_stamp(self, version: int) -> float | None:
        """When the store committed ``version``'s manifest; None if it has none, or the store cannot say
        (then the number alone identifies a version, as before)."""
        try:
            return self.store.modified(layout.manifest_key(layout.policy_dir(version)))
        except (NotFound, NotImplementedError):
            return None

    def _orphaned(self, latest: int) -> bool:
        """Whether LATEST names the number held but the store's manifest under it is not the one fetched."""
        if latest != self.current or self._pending is not None or self._held_stamp is None:
            return False
        if time.time() - self._identity_checked_at < self.identity_check_s:
            return False
        self._identity_checked_at = time.time()
        return self._manifest_stamp(latest) != self._held_stamp

    def _newest_not_rejected(self) -> int | None:
        """LATEST names a version already rejected (a pointer someone with write access to the store moved
        to a forgery): the newest version folder newer than the one held that is not rejected yet, so that a
        forged LATEST cannot stall the actor until the learner publishes again (it is verified as any other;
        one listing of the folder names per poll while LATEST stays bad)."""
        listed = (layout.parse_version_dir(name) for name in self.store.list_folders(layout.POLICY))
        candidates = [v for v in listed if v is not None and v not in self.rejected
                      and (self.current is None or v > self.current)]
        return max(candidates, default=None)

    def _wanted(self, latest: int) -> bool:
        """Whether to start ``latest`` now (see the module docstring)."""
        if latest == self.current or (self._pending is not None and latest == self._pending[0]):
            return False
        if self._pending is None:
            return True
        p = self._pending[0]
        return not p < latest < p + self.staleness  # keep p while it will still be fresh when it lands

    def _collect(self) -> VersionBuffer | None:
        if self._pending is None or not self._pending[1].done():
            return None
        version, future = self._pending
        self._pending = None
        try:
            buffer = future.result()
        except Exception as exc:
            log.error("receiving v%d failed (will retry): %s", version, exc)
            self._report_reads()
            return None
        self.current, self._held_stamp = version, self._pending_stamp
        self._count_peer_chunks(buffer, self._pending_sites)
        self._report_reads()
        sources = {s for s in buffer.sources}
        log.info("v%d received and verified (%d chunks, from %s)", version, len(buffer.chunks),
                 ", ".join(sorted(sources)))
        return buffer

    def _report_reads(self) -> None:
        """The counters into the peer record now that a fetch ended: by waking the heartbeat (no store write on
        the actor's own path), or with no heartbeat (store mode) here."""
        if self._heartbeat is not None:
            self._wake.set()
            return
        try:
            self._beat()
        except Exception as exc:  # the next heartbeat or fetch tries again
            log.warning("could not report the bytes read: %s", exc)

    def fetch_blocking(self, version: int) -> VersionBuffer:
        """A whole older version (the base of a LoRA adapter, a link of a delta chain) from the store,
        verified, now."""
        return self.node.start_fetch(self._manifest(version), []).result()

    def manifest(self, version: int) -> dict:
        """The signed manifest of ``version`` from the store (ManifestRejected, NotFound)."""
        return self._manifest(version)

    def _latest(self) -> int | None:
        """The version LATEST points at; None if there is none yet, or it is malformed (logged once)."""
        try:
            raw = self.store.get(layout.LATEST)
        except NotFound:
            return None
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not text, absurdly nested
            record = None
        version = record.get("version") if isinstance(record, dict) else None
        if isinstance(version, int) and not isinstance(version, bool) and version >= 0:
            self._bad_latest = None
            return version
        if raw != self._bad_latest:  # once per bad value, not at every poll
            log.error("ignoring a malformed %s: %r", layout.LATEST, raw[:200])
            self._bad_latest = raw
        return None

    def _manifest(self, version: int) -> dict:
        """The signed manifest of ``version``; ManifestRejected if malformed, naming a file outside its
        folder (``read_manifest`` checks names), forged, or for another version."""
        try:
            manifest = read_manifest(self.store, layout.policy_dir(version))
        except (ValueError, RecursionError) as exc:
            raise ManifestRejected(f"manifest of version {version} is not JSON: {exc}") from None
        verify_signature(manifest, self.public_key)
        signed_for = manifest.get("version")
        if signed_for != version or isinstance(signed_for, bool):  # a genuine manifest replayed elsewhere
            raise ManifestRejected(f"manifest under {layout.policy_dir(version)} is signed for version {signed_for!r}")
        revoked = manifest.get("revoked", [])
        if not isinstance(revoked, list) or not all(isinstance(a, str) for a in revoked):
            raise ManifestRejected(f"manifest of version {version} has a malformed revoked list")
        if self._revocations_of is None or version >= self._revocations_of:  # the newest signed list wins
            self.auth.revoke(revoked)
            self._revocations_of = version
        else:  # a lower number: a resumed learner's new timeline; revocations in a run only ever add up
            self.auth.revoke(self.auth.revoked | set(revoked))
        return manifest

    def _begin(self, version: int) -> None:
        stamp = self._manifest_stamp(version)  # before the read: a manifest replaced meanwhile is fetched again
        try:
            manifest = self._manifest(version)
        except ManifestRejected as exc:
            log.error("rejected: %s", exc)
            self.rejected.add(version)
            return
        except NotFound:
            return  # garbage-collected between LATEST and now: a newer one is coming
        relay = manifest.get("relay", {})
        sources = []
        if self.config.mode == "relay":  # its place in the plan, or, not in it yet, a leaf with an idle uplink
            sources = (topology.source_peers(relay, self.actor_id)
                       or topology.guest_sources(relay, self.actor_id, self.site))
        peers = [Peer(url, peer, _share_mbit(relay, peer)) for url, peer in sources]
        avoid = self._avoided(version)
        if avoided := [p for p in peers if p.actor_id in avoid]:
            log.info("v%d: not asking %s: failed to deliver lately", version, ", ".join(map(str, avoided)))
            peers = [p for p in peers if p not in avoided]
        if self._pending is not None:
            log.info("leaving v%d for v%d (staleness %d)", self._pending[0], version, self.staleness)
            self._pending[1].cancel()
        started = time.time()
        sites = {str(p): topology.site_of(relay, p.actor_id) for p in peers}
        future = self.node.start_fetch(manifest, peers, on_left=self._parent_failed, need_mbit=self.need_mbit(manifest))
        future.add_done_callback(lambda f: self._fetch_ended(f, manifest, sites))
        # how long the transfer itself took (not the wait for the actor to swap): the capacity fit's D
        future.add_done_callback(lambda f: setattr(self, "last_fetch_seconds", time.time() - started))
        self._pending, self._pending_stamp, self._pending_sites = (version, future), stamp, sites

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if self._registered:
            try:
                topology.unregister(self.store, self.actor_id)
            except Exception as exc:
                log.warning("could not unregister %s: %s", self.actor_id, exc)
        self.node.close()


def _share_mbit(relay: dict, peer: str) -> float | None:
    """``peer``'s share of its measured upload as the signed plan carries it: its ``up_mbit`` over its children
    in the plan (the entries naming it as their ``parent``; in a plan without explicit parents, the fan-out);
    None if the plan says nothing usable (``rates.min_rate_mbit``)."""
    peers = [p for p in relay.get("peers", []) if isinstance(p, dict)]
    entry = next((p for p in peers if p.get("id") == peer), None)
    up = (entry or {}).get("up_mbit")
    if isinstance(up, bool) or not isinstance(up, (int, float)) or not math.isfinite(up) or up <= 0:
        return None
    if any("parent" in p for p in peers):
        children = sum(1 for p in peers if p.get("parent") == peer)
    else:
        fanout = relay.get("fanout", 1)
        children = fanout if isinstance(fanout, int) and not isinstance(fanout, bool) else 1
    return float(up) / max(1, children)
