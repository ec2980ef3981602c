"""The receiver's choice of version under fast publishing, and hostile peers and store records:
huge bodies, peers dying mid-chunk, parents that hold or trickle (reported, planned around), malformed,
unreadable, huge or stale peer records and records of actors the fleet never launched, LATEST and manifests."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
import torch
from aiohttp import web
from helpers import wait_until
from relay_helpers import (
    CHUNK,
    KEY,
    PUBLIC,
    RUN_ID,
    TOKEN,
    _bare_peer,
    _read_head,
    auth,
    make_version,
    nodes,
    raw_peer,
    slow_store_reader,
)
from relay_helpers import poll_until as poll_until_version

from echo2.broadcast.protocol import FetchPolicy, Peer
from echo2.broadcast.receiver import PolicyReceiver
from echo2.broadcast.relay_node import RelayNode
from echo2.broadcast.topology import MAX_RECORD_BYTES, live_peers, order, register
from echo2.config import BroadcastConfig, PublishConfig, TrainConfig
from echo2.data import layout
from echo2.data.ledger import write_event
from echo2.data.store import open_store
from echo2.learner.publisher import Publisher


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
    receiver = PolicyReceiver(gated, "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=staleness,
                              run_id=RUN_ID)
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
    register(store, "a1", "https://relay-1.example.net:443", 3, {"a0": 2})
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
        "reportlist": {**record, "id": "reportlist", "failed_parents": ["a0"]},
        "reportname": {**record, "id": "reportname", "failed_parents": {"a 0": 1}},
        "reportversion": {**record, "id": "reportversion", "failed_parents": {"a0": -1}},
        "reportbool": {**record, "id": "reportbool", "failed_parents": {"a0": True}},
        "reportmany": {**record, "id": "reportmany", "failed_parents": {f"p{i}": 1 for i in range(17)}},
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


# -- peer records the learner cannot trust: unreadable, huge, from the future, of strangers -------------

class CountingStore:
    """The run's store, except that it counts the bytes each read returns, per key (a test double of the
    store that only counts, not of the code under test)."""

    def __init__(self, store):
        self._store = store
        self.read: dict[str, int] = {}

    def get(self, key):
        data = self._store.get(key)
        self.read[key] = self.read.get(key, 0) + len(data)
        return data

    def get_range(self, key, start, end):
        data = self._store.get_range(key, start, end)
        self.read[key] = self.read.get(key, 0) + len(data)
        return data

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_huge_peer_record_is_never_read_whole(store, tmp_path, caplog):
    register(store, "a0", "http://127.0.0.1:8000", 1)
    huge = tmp_path / "store" / "peers" / "huge.json"  # 64 MB, sparse: a well-formed start, then nothing
    with open(huge, "wb") as f:
        f.write(json.dumps({"id": "huge", "url": "http://127.0.0.1:9", "heartbeat": time.time()}).encode())
        f.truncate(64 * 2**20)
    counting = CountingStore(store)
    for _ in range(3):  # three publishes
        assert live_peers(counting, max_age_s=60) == {"a0": "http://127.0.0.1:8000"}
    assert counting.read["peers/huge.json"] <= 3 * (MAX_RECORD_BYTES + 1)  # a bounded read each time
    logged = [r.getMessage() for r in caplog.records if r.name == "echo2.broadcast"]
    assert logged == [f"skipping peer record peers/huge.json: malformed: more than {MAX_RECORD_BYTES} bytes"]


def test_a_glacier_peer_record_does_not_crash_publish(s3_store, s3_server, caplog):
    """HEAD works, GET is 403 (PermissionError): the record is skipped, logged once, and publish goes on."""
    import boto3

    for actor in ("a0", "a1"):
        write_event(s3_store, "launch", actor)
    register(s3_store, "a0", "http://127.0.0.1:8000", None)
    bucket, root = s3_store.root.split("/", 1)
    record = {"id": "a1", "url": "http://127.0.0.1:8001", "version": None, "heartbeat": time.time()}
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").put_object(
        Bucket=bucket, Key=f"{root}/{layout.peer_key('a1')}", Body=json.dumps(record).encode(), StorageClass="GLACIER")
    publisher = Publisher(s3_store, train=TrainConfig(), broadcast=BroadcastConfig(mode="relay"), key=KEY,
                          extra_files={})
    for version in (0, 1):
        manifest, _ = publisher.publish(version, {"w": torch.ones(8)}, {"weights": "full"})
        assert [p["id"] for p in manifest["relay"]["peers"]] == ["a0"]
    logged = [r.getMessage() for r in caplog.records if r.name == "echo2.broadcast" and "a1" in r.getMessage()]
    assert len(logged) == 1 and "peers/a1.json: cannot be read (PermissionError" in logged[0], logged


def test_a_heartbeat_from_the_future_does_not_keep_a_dead_peer_live(store, tmp_path):
    """Liveness is the store's commit time of the record, not the time the actor claims."""
    register(store, "a0", "http://127.0.0.1:8000", 1)
    hour = 3600
    for actor, claimed, committed in [("ghost", time.time() + 10**7, time.time() - hour),  # claims 2027+, stopped
                                      ("stale", time.time() - hour, time.time() - hour),   # an honest dead peer
                                      ("forged", time.time(), time.time() + hour)]:        # a commit time forged ahead
        record = {"id": actor, "url": "http://127.0.0.1:9", "version": None, "heartbeat": claimed}
        store.put_pointer(layout.peer_key(actor), json.dumps(record).encode())
        os.utime(tmp_path / "store" / layout.peer_key(actor), (committed, committed))
    assert live_peers(store, max_age_s=60) == {"a0": "http://127.0.0.1:8000"}


def test_the_plan_holds_only_actors_the_fleet_launched(store, caplog):
    write_event(store, "launch", "a0")
    write_event(store, "requested", "a1")  # chosen by the fleet, its launch still under way
    write_event(store, "resize", "fleet", actors_from=1, actors_to=2, reason="test")
    for actor in ("a0", "a1", "a2", "stranger"):
        register(store, actor, "http://127.0.0.1:9", None)
    publisher = Publisher(store, train=TrainConfig(), broadcast=BroadcastConfig(mode="relay"), key=KEY, extra_files={})
    manifest, _ = publisher.publish(0, {"w": torch.ones(8)}, {"weights": "full"})
    assert sorted(p["id"] for p in manifest["relay"]["peers"]) == ["a0", "a1"]
    write_event(store, "launch", "a2")  # launched since: in the next plan, unless revoked
    manifest, _ = publisher.publish(1, {"w": torch.ones(8)}, {"weights": "full"}, revoked={"a1"})
    assert sorted(p["id"] for p in manifest["relay"]["peers"]) == ["a0", "a2"]
    assert "skipping peer record peers/stranger.json: the fleet never launched this actor" in caplog.text


# -- a parent that fails to deliver: reported by its children, left out of the next plans ---------------

def _receive_in_plan_order(manifest, receivers, version):
    """Every receiver of the plan takes ``version``, parents first (a parent then holds the version whole
    before its children ask, so where each chunk came from is decided by the plan, not by timing)."""
    in_plan = [p["id"] for p in manifest["relay"]["peers"] if p["id"] in receivers]
    return {actor: poll_until_version(receivers[actor], version, timeout=60) for actor in in_plan}


def _first_of_order(names, version, prefix):
    """A peer name that the hash order puts first (a root) at every version in ``version``."""
    return next(f"{prefix}{i}" for i in range(10_000)
                if all(order(names + [f"{prefix}{i}"], v)[0] == f"{prefix}{i}" for v in version))


@pytest.fixture
def relay_run(store):
    """A publisher and two honest receivers (c1, c2) of a run whose fleet launched them and ``evil``; the
    test decides who ``evil`` is. Short holds (pipeline_wait_s) keep a hold cheap in test time."""
    broadcast = BroadcastConfig(mode="relay", chunk_mb=0.01, fanout=2, roots=1, pipeline_wait_s=0.5,
                                heartbeat_s=0.1, peer_timeout_s=3600)
    receivers = {}

    def start(actors, evil):
        for actor in [*actors, evil]:
            write_event(store, "launch", actor)
        for actor in actors:
            receivers[actor] = PolicyReceiver(store, actor, PUBLIC, TOKEN, broadcast, staleness=2, run_id=RUN_ID)
        publisher = Publisher(store, train=TrainConfig(), publish=PublishConfig(keep_versions=10),
                              broadcast=broadcast, key=KEY, extra_files={})
        return publisher, receivers

    yield start
    for receiver in receivers.values():
        receiver.close()


def _left(caplog, version):
    """(who left, whom) of every peer a child left while fetching ``version`` (its cost: one hold each)."""
    return [r.getMessage().split(" for the next source")[0] for r in caplog.records
            if r.getMessage().startswith(f"v{version}: leaving ")]


@pytest.mark.e2e
def test_a_parent_that_holds_every_request_costs_its_children_one_version(store, relay_run, caplog):
    """Before: a holding parent stayed in every plan, and each version its children waited out the hold
    (~33 s at the defaults) before the store. Now both children report it at v1 and it is out of every
    later plan: the cost is one hold per child, once."""
    caplog.set_level(logging.INFO)
    evil_url, stop_evil = raw_peer(None)  # accepts every connection, never answers
    evil = _first_of_order(["c1", "c2"], [1], "evil")  # the root at v1: c1 and c2 are its children (fan-out 2)
    register(store, evil, evil_url, None)  # a record that stays live (peer_timeout_s): only reports remove it
    publisher, receivers = relay_run(["c1", "c2"], evil)
    try:
        sources = {}
        for version in range(1, 5):
            manifest, _ = publisher.publish(version, {"w": torch.full((20_000,), float(version))}, {"weights": "full"})
            plan = [p["id"] for p in manifest["relay"]["peers"]]
            if version == 1:
                assert plan[0] == evil
            got = _receive_in_plan_order(manifest, receivers, version)
            sources[version] = {actor: set(buf.sources) for actor, buf in got.items()}
            if version == 1:  # both children say so in their records before the next publish
                wait_until(lambda: all(evil in store.get_json(layout.peer_key(a)).get("failed_parents", {})
                                       for a in receivers), 20, f"c1 and c2 to report {evil}")
            else:
                assert evil not in plan, (version, plan)
                root, child = plan
                url = {p["id"]: p["url"] for p in manifest["relay"]["peers"]}[root]
                assert sources[version] == {root: {"store"}, child: {f"{root} at {url}"}}, sources[version]
        assert sources[1] == {"c1": {"store"}, "c2": {"store"}}
        # the cost per version: holds waited out (each: pipeline_wait_s + grace, at the defaults ~32 s)
        cost = {v: sorted(_left(caplog, v)) for v in range(1, 5)}
        assert cost == {1: [f"v1: leaving {evil} at {evil_url}"] * 2, 2: [], 3: [], 4: []}, cost
        assert f"{evil} is left out of the relay plan: c1, c2 report it failed to deliver" in caplog.text
    finally:
        stop_evil()


@pytest.mark.e2e
def test_one_childs_report_moves_only_that_child(store, relay_run, caplog):
    """A single report (which a lying child could make about an honest parent) takes nobody out of the
    plan; the reporter alone stops asking that parent."""
    caplog.set_level(logging.INFO)
    evil_url, stop_evil = raw_peer(None)
    evil = _first_of_order(["c1"], [1, 2], "evil")  # the root at v1 and v2, c1 its child
    register(store, evil, evil_url, None)
    publisher, receivers = relay_run(["c1"], evil)
    try:
        manifest, _ = publisher.publish(1, {"w": torch.ones(20_000)}, {"weights": "full"})
        assert set(_receive_in_plan_order(manifest, receivers, 1)["c1"].sources) == {"store"}
        wait_until(lambda: store.get_json(layout.peer_key("c1")).get("failed_parents") == {evil: 1}, 20,
                   f"c1 to report {evil}")
        manifest, _ = publisher.publish(2, {"w": torch.zeros(20_000)}, {"weights": "full"})
        assert [p["id"] for p in manifest["relay"]["peers"]] == [evil, "c1"]  # one report: the plan is as it was
        assert set(_receive_in_plan_order(manifest, receivers, 2)["c1"].sources) == {"store"}
        assert _left(caplog, 1) == [f"v1: leaving {evil} at {evil_url}"] and _left(caplog, 2) == []
        assert f"v2: not asking {evil} at {evil_url}: failed to deliver lately" in caplog.text
    finally:
        stop_evil()


def trickling_run_peer(interval_s: float = 0.1):
    """A test peer on a bare socket that answers every request at once with a 200 and the tag of a chunk
    (``protocol.TAG_CHUNK``), then sends the chunk's bytes one per ``interval_s`` (a parent that holds by
    trickling); returns (url, stop)."""
    def trickle(conn, stop):
        with conn:
            try:
                _read_head(conn)
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nC\r\n")
                while not stop.wait(interval_s):
                    conn.sendall(b"1\r\n\x00\r\n")
            except OSError:  # the client hung up: what we want
                pass

    return _bare_peer(lambda conn, stop: threading.Thread(target=trickle, args=(conn, stop), daemon=True).start())


@pytest.mark.e2e
def test_a_trickling_parent_is_left_at_its_body_timeout_and_a_404_is_not_reported(store, caplog):
    """A parent that answers at once and then trickles the body is left once the body falls below the
    lowest acceptable rate (before: at the end of the whole hold allowance, 60 s here); with nothing known
    of the parent's rate or the child's need that is the floor (``floor_mbit``). A 404, the honest "I will
    not have it", is not reported against its peer; the trickle is."""
    manifest, files = make_version(store)
    trickle_url, stop_trickle = trickling_run_peer()
    gone_url, stop_gone = raw_peer(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    (child,) = nodes(store, 1, FetchPolicy(pipeline_wait_s=60, floor_mbit=5))
    reported = []
    try:
        peers = [Peer(gone_url, "gone"), Peer(trickle_url, "trickler")]
        buf = child.start_fetch(manifest, peers, on_left=lambda p, v, why: reported.append((p.actor_id, v, why)))
        buf = buf.result(timeout=120)
        assert buf.files() == files and set(buf.sources) == {"store"}
        assert [(a, v) for a, v, _ in reported] == [("trickler", 1)], reported
        assert "below 5 Mbit/s over the run" in reported[0][2], reported
    finally:
        child.close()
        stop_trickle()
        stop_gone()
