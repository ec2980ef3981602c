"""The actor's side of dissemination: follow ``policy/LATEST``, receive each new version through
the relay (parent peer first, store as fallback) in the background, hand over verified files.

A version is handed over only when every chunk matched the signed manifest; a manifest whose
signature fails is rejected and never fetched.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from echo2.broadcast import topology
from echo2.data.manifest import Chunk, ManifestRejected, verify_signature
from echo2.data.run_key import relay_token
from echo2.broadcast.relay import FetchPolicy, RelayNode, VersionBuffer
from echo2.config import BroadcastConfig
from echo2.data import layout
from echo2.data.store import NotFound, ObjectStore
from echo2.data.weights import latest_version, read_manifest

log = logging.getLogger("echo2.broadcast")


class PolicyReceiver:
    def __init__(self, store: ObjectStore, actor_id: str, key: bytes, config: BroadcastConfig):
        self.store = store
        self.actor_id = actor_id
        self.key = key
        self.config = config
        policy = FetchPolicy(expected_mbit=config.expected_mbit, min_rate_fraction=config.min_rate_fraction,
                             pipeline_wait_s=config.pipeline_wait_s, window=config.window)
        self.node = RelayNode(relay_token(key), self._store_read, host=config.host, port=config.port, policy=policy)
        self.current: int | None = None
        self.rejected: set[int] = set()
        self._pending: tuple[int, Future] | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if config.mode == "relay":
            self._beat()
            self._heartbeat = threading.Thread(target=self._beat_loop, name="echo2-heartbeat", daemon=True)
            self._heartbeat.start()

    @property
    def url(self) -> str:
        advertised = self.config.advertise_host or self.config.host
        return f"http://{advertised}:{self.node.server.port}"

    def _store_read(self, chunk: Chunk, manifest: dict) -> bytes:
        key = f"{layout.policy_dir(int(manifest['version']))}/{chunk.file}"
        return self.store.get_range(key, chunk.offset, chunk.offset + chunk.size)

    def _beat(self) -> None:
        topology.register(self.store, self.actor_id, self.url, self.current)

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                self._beat()
            except Exception as exc:  # a missed heartbeat only makes us look dead for a while
                log.warning("heartbeat failed: %s", exc)

    def poll(self) -> VersionBuffer | None:
        """Start receiving a newer version if there is one; return a version that finished, verified."""
        latest = latest_version(self.store)
        pending_version = self._pending[0] if self._pending else None
        if latest is not None and latest != self.current and latest != pending_version and latest not in self.rejected:
            self._begin(latest)
        if self._pending is None or not self._pending[1].done():
            return None
        version, future = self._pending
        self._pending = None
        try:
            buffer = future.result()
        except Exception as exc:
            log.error("receiving v%d failed (will retry): %s", version, exc)
            return None
        self.current = version
        sources = {s for s in buffer.sources}
        log.info("v%d received and verified (%d chunks, from %s)", version, len(buffer.chunks), ", ".join(sorted(sources)))
        return buffer

    def fetch_blocking(self, version: int) -> VersionBuffer:
        """A whole older version (the base of a LoRA adapter) from the store, verified, now."""
        manifest = verify_signature(read_manifest(self.store, layout.policy_dir(version)), self.key)
        return self.node.start_fetch(manifest, []).result()

    def _begin(self, version: int) -> None:
        try:
            manifest = verify_signature(read_manifest(self.store, layout.policy_dir(version)), self.key)
        except ManifestRejected as exc:
            log.error("rejected: %s", exc)
            self.rejected.add(version)
            return
        except NotFound:
            return  # garbage-collected between LATEST and now: a newer one is coming
        peers = topology.sources(manifest.get("relay", {}), self.actor_id) if self.config.mode == "relay" else []
        if self._pending is not None:
            self._pending[1].cancel()
        self._pending = (version, self.node.start_fetch(manifest, peers))

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
            try:
                topology.unregister(self.store, self.actor_id)
            except Exception as exc:
                log.warning("could not unregister %s: %s", self.actor_id, exc)
        self.node.close()
