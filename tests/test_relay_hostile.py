"""The receiver's choice of version under fast publishing, and hostile peers and store records:
huge bodies, peers dying mid-chunk, malformed peer records, LATEST and manifests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
from aiohttp import web

from echo2.broadcast.receiver import PolicyReceiver
from echo2.broadcast.relay import FetchPolicy, RelayNode
from echo2.broadcast.topology import live_peers, register
from echo2.config import BroadcastConfig
from echo2.data import layout
from echo2.data.store import open_store

from relay_helpers import CHUNK, PUBLIC, RUN_ID, TOKEN, auth, make_version, nodes, raw_peer, slow_store_reader


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


# -- a fetch in flight vs. newer versions (staleness) ------------------------------------------------

def publish(store, version, sizes=(300_000,)):
    """Commit a signed version the way the learner does: shards, manifest, then LATEST."""
    manifest, files = make_version(store, version, sizes)
    store.put_json(layout.manifest_key(layout.policy_dir(version)), manifest)
    store.put_pointer(layout.LATEST, json.dumps({"version": version}).encode())
    return manifest, files


class GatedStore:
    """The run's store, except that chunk reads of a version wait until the test opens that
    version's gate: a store slower than publishing, made deterministic (a test double of the store,
    not of the code under test)."""

    def __init__(self, store):
        self._store = store
        self._gates: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._all_open = False

    def gate(self, version: int) -> threading.Event:
        with self._lock:
            gate = self._gates.setdefault(version, threading.Event())
            if self._all_open:
                gate.set()
            return gate

    def open_all(self) -> None:
        with self._lock:
            self._all_open = True
            for g in self._gates.values():
                g.set()

    def get_range(self, key, start, end):
        version = layout.version_of_folder_key(key, layout.POLICY)
        self.gate(version).wait(timeout=30)
        return self._store.get_range(key, start, end)

    def __getattr__(self, name):
        return getattr(self._store, name)


def poll_until(receiver, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (buf := receiver.poll()) is not None:
            return buf
        time.sleep(0.02)
    return None


def test_a_fetch_in_flight_completes_while_its_version_is_still_fresh(store):
    """Publishing faster than one version can be fetched must still deliver versions."""
    _, files1 = publish(store, 1)
    gated = GatedStore(store)
    receiver = PolicyReceiver(gated, "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=2, run_id=RUN_ID)
    try:
        assert receiver.poll() is None  # v1 started; its chunk reads wait at the gate
        _, files2 = publish(store, 2)
        for _ in range(3):
            assert receiver.poll() is None  # 2 - 1 < S = 2: v1 keeps going
        gated.open_all()
        first = poll_until(receiver)
        assert first is not None and first.version == 1 and first.files() == files1
        second = poll_until(receiver)  # then the newest
        assert second is not None and second.version == 2 and second.files() == files2
    finally:
        gated.open_all()
        receiver.close()


@pytest.mark.parametrize("staleness, newer", [(0, (2,)), (2, (2, 3))])
def test_a_fetch_in_flight_is_abandoned_for_the_newest_once_too_stale(store, staleness, newer):
    publish(store, 1)
    gated = GatedStore(store)
    receiver = PolicyReceiver(gated, "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=staleness, run_id=RUN_ID)
    try:
        assert receiver.poll() is None  # v1 started, held at the gate
        for v in newer:
            _, files = publish(store, v)
        assert receiver.poll() is None  # L - 1 >= S: v1 is dropped, the newest started
        gated.gate(newer[-1]).set()
        got = poll_until(receiver)
        assert got is not None and got.version == newer[-1] and got.files() == files
        gated.open_all()  # v1 could finish now, but it was abandoned: it is never handed over
        for _ in range(10):
            assert receiver.poll() is None
            time.sleep(0.02)
        assert receiver.current == newer[-1]
    finally:
        gated.open_all()
        receiver.close()


# -- a parent answers at once for what it will not have ---------------------------------------------

async def get_chunk(url, version, index, timeout=10.0):
    """(status, seconds) of one chunk request with the run token; raises on the client timeout."""
    t0 = time.monotonic()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(f"{url}/v1/versions/{version}/chunks/{index}") as r:
            await r.read()
            return r.status, time.monotonic() - t0


def test_parent_answers_404_at_once_for_a_version_older_than_its_newest(store):
    m1, _ = make_version(store, 1)
    m2, _ = make_version(store, 2)
    m3, files3 = make_version(store, 3)
    gated = GatedStore(store)
    parent = RelayNode(TOKEN, auth(), slow_store_reader(gated, 0), policy=FetchPolicy(pipeline_wait_s=60))
    pool = ThreadPoolExecutor(2)
    try:
        # receiving v1 (held at the gate); a child waits for chunk 0 of it (pipelined) ...
        f1 = parent.start_fetch(m1, [])
        held = pool.submit(asyncio.run, get_chunk(parent.url, 1, 0))
        time.sleep(0.3)
        assert not held.done()
        # ... when the parent gives v1 up for v2: the held request is answered 404 now, not in 60 s
        f1.cancel()
        f2 = parent.start_fetch(m2, [])
        status, seconds = held.result(timeout=10)
        assert status == 404 and seconds < 5
        # a version older than the one it is still receiving: 404 at once
        status, seconds = asyncio.run(get_chunk(parent.url, 1, 1))
        assert status == 404 and seconds < 5
        # a version newer than all it has is held (pipelining) and served once it arrives
        newer = pool.submit(asyncio.run, get_chunk(parent.url, 3, 0, timeout=30))
        time.sleep(0.3)
        assert not newer.done()
        gated.open_all()
        f2.result(timeout=30)
        parent.start_fetch(m3, []).result(timeout=30)
        assert newer.result(timeout=30)[0] == 200
        # and a version older than one it holds whole: 404 at once too
        status, seconds = asyncio.run(get_chunk(parent.url, 1, 0))
        assert status == 404 and seconds < 5
    finally:
        gated.open_all()
        parent.close()
        pool.shutdown(wait=False, cancel_futures=True)


# -- hostile and dying test peers -------------------------------------------------------------------

class HugeBodyPeer:
    """A test peer (aiohttp app on 127.0.0.1) that answers every chunk request with a body far larger
    than any chunk, and counts how much of it the client let it send."""

    TOTAL = 64 * 2**20

    def __init__(self, announce: bool):
        self.announce = announce
        self.sent = 0
        self.finished = threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        app = web.Application()
        app.router.add_get("/v1/versions/{version}/chunks/{index}", self._chunk)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        asyncio.run_coroutine_threadsafe(self.runner.setup(), self.loop).result(10)
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        asyncio.run_coroutine_threadsafe(site.start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _chunk(self, request):
        resp = web.StreamResponse()
        if self.announce:
            resp.content_length = self.TOTAL
        block = b"\x00" * 2**20
        try:
            await resp.prepare(request)
            while self.sent < self.TOTAL:
                await resp.write(block)
                self.sent += len(block)
        except ConnectionError:  # the client hung up: what we want
            pass
        finally:
            self.finished.set()
        return resp

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.mark.parametrize("announce", [False, True], ids=["chunked", "content-length"])
def test_a_peer_sending_a_huge_body_is_left_after_one_chunk_worth(store, announce):
    manifest, files = make_version(store)
    peer = HugeBodyPeer(announce)
    (child,) = nodes(store, 1)
    try:
        buf = child.start_fetch(manifest, [peer.url]).result(timeout=60)
        assert buf.files() == files and set(buf.sources) == {"store"}
        assert peer.finished.wait(10)
        assert peer.sent < peer.TOTAL // 2  # the child stopped reading: at most socket buffers went out
    finally:
        child.close()
        peer.close()


@pytest.mark.parametrize("answer", [
    # 200 with the Content-Length of one chunk, a third of the body, then the peer is gone
    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % CHUNK + b"\x00" * (CHUNK // 3),
    b"",  # gone before answering
], ids=["mid-body", "before-answer"])
def test_a_peer_dying_mid_chunk_means_fall_back_not_abort(store, answer):
    """aiohttp reports these as ClientPayloadError and ServerDisconnectedError (not OSError)."""
    manifest, files = make_version(store)
    url, stop = raw_peer(answer)
    (child,) = nodes(store, 1)
    try:
        buf = child.start_fetch(manifest, [url]).result(timeout=60)
        assert buf.files() == files and set(buf.sources) == {"store"}
    finally:
        child.close()
        stop()


# -- malformed records in the store ------------------------------------------------------------------

def test_malformed_peer_records_are_skipped_never_raised(store):
    now = time.time()
    register(store, "a0", "http://127.0.0.1:8000", None)
    register(store, "a1", "https://relay-1.example.net:443", 3)
    record = {"url": "http://127.0.0.1:9", "version": None, "heartbeat": now}
    bad = {
        "notjson": b"{not json",
        "notutf8": b"\xff\xfe\x00",
        "list": b"[1, 2]",
        "string": b'"peer"',
        "noid": {k: v for k, v in record.items()},
        "nourl": {"id": "nourl", "heartbeat": now},
        "nobeat": {"id": "nobeat", "url": "http://127.0.0.1:9"},
        "textbeat": {**record, "id": "textbeat", "heartbeat": "now"},
        "boolbeat": {**record, "id": "boolbeat", "heartbeat": True},
        "infbeat": {**record, "id": "infbeat", "heartbeat": float("inf")},
        "ftp": {**record, "id": "ftp", "url": "ftp://127.0.0.1:21"},
        "noport": {**record, "id": "noport", "url": "http://127.0.0.1"},
        "badport": {**record, "id": "badport", "url": "http://127.0.0.1:99999"},
        "path": {**record, "id": "path", "url": "http://127.0.0.1:9/steal?x=1"},
        "userinfo": {**record, "id": "userinfo", "url": "http://me@127.0.0.1:9"},
        "newline": {**record, "id": "newline", "url": "http://127.0.0.1:9\n"},
        "urlint": {**record, "id": "urlint", "url": 9},
        "oddversion": {**record, "id": "oddversion", "version": "latest"},
        "impostor": {**record, "id": "a0"},  # may not speak for another actor
        "idint": {**record, "id": 5},
    }
    for name, rec in bad.items():
        store.put_pointer(layout.peer_key(name), rec if isinstance(rec, bytes) else json.dumps(rec).encode())
    store.put_pointer(layout.peer_key("bad name"), json.dumps({**record, "id": "bad name"}).encode())
    assert live_peers(store, max_age_s=60) == {"a0": "http://127.0.0.1:8000", "a1": "https://relay-1.example.net:443"}


def test_receiver_skips_a_malformed_latest_or_manifest(store):
    receiver = PolicyReceiver(store, "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=2, run_id=RUN_ID)
    try:
        for latest in (b"{", b"\xff", b"[3]", b'"3"', b"{}", b'{"version": "3"}', b'{"version": null}',
                       b'{"version": true}', b'{"version": -1}', b'{"version": 1.5}'):
            store.put_pointer(layout.LATEST, latest)
            assert receiver.poll() is None
        bodies = [b"not json", b"\xff\xfe", b"[]", b'"manifest"', b"7", json.dumps({"version": 5}).encode()]
        for version, body in enumerate(bodies, start=1):
            store.put(layout.manifest_key(layout.policy_dir(version)), body)
            store.put_pointer(layout.LATEST, json.dumps({"version": version}).encode())
            assert receiver.poll() is None
        assert len(bodies) in receiver.rejected  # the unsigned one: rejected as before
        # a correctly signed manifest of another version, replayed under a newer folder
        replayed, _ = make_version(store, 1)
        store.put_json(layout.manifest_key(layout.policy_dir(8)), replayed)
        store.put_pointer(layout.LATEST, json.dumps({"version": 8}).encode())
        assert receiver.poll() is None and 8 in receiver.rejected
        _, files = publish(store, 9)
        got = poll_until(receiver)
        assert got is not None and got.version == 9 and got.files() == files
    finally:
        receiver.close()
