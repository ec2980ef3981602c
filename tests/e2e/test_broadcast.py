"""The relay over real HTTP on loopback: chains, trees, pipelining, bad peers, signatures, tokens."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from relay_helpers import KEY, PUBLIC, RUN_ID, TOKEN, auth, make_version, nodes, raw_peer, slow_store_reader

from echo2.broadcast.protocol import FetchPolicy
from echo2.broadcast.receiver import PolicyReceiver
from echo2.broadcast.relay import RelayServer
from echo2.broadcast.relay_node import RelayNode
from echo2.broadcast.topology import parent_index, plan, sources
from echo2.config import BroadcastConfig
from echo2.data.manifest import ManifestRejected, sign, verify_signature
from echo2.data.store import open_store


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


def run_topology(store, manifest, n, fanout):
    relay = plan({f"a{i}": "" for i in range(n)}, 1, fanout=fanout, roots=1)
    ns = nodes(store, n)
    try:
        urls = {f"a{i}": node.url for i, node in enumerate(ns)}
        for p in relay["peers"]:
            p["url"] = urls[p["id"]]
        by_id = {f"a{i}": node for i, node in enumerate(ns)}
        futures = {pid: by_id[pid].start_fetch(manifest, sources(relay, pid)) for pid in urls}
        return relay, {pid: f.result(timeout=60) for pid, f in futures.items()}
    finally:
        for node in ns:
            node.close()


@pytest.mark.parametrize("n, fanout", [(4, 1), (6, 2)])
def test_chain_and_tree_deliver_identical_bytes_pipelined(store, n, fanout):
    manifest, files = make_version(store)
    relay, buffers = run_topology(store, manifest, n, fanout)
    order = [p["id"] for p in relay["peers"]]
    for pid, buf in buffers.items():
        assert buf.files() == files
        k = order.index(pid)
        parent = parent_index(k, fanout=fanout, roots=1)
        if parent is None:
            assert set(buf.sources) == {"store"}
        else:
            assert "store" not in buf.sources  # everything came through its parent
            # pipelining: the child had its first chunk before the parent had its last
            parent_buf = buffers[order[parent]]
            assert min(buf.arrived_at) < max(parent_buf.arrived_at)


class EvilServer(RelayServer):
    """A peer that serves a corrupted chunk 2, alone or in a run (a test peer, not production code)."""

    def _data(self, buffer, index):
        data = super()._data(buffer, index)
        return b"\x00" * len(data) if index == 2 else data


def test_corrupted_chunk_is_never_used_or_passed_on(store):
    manifest, files = make_version(store)
    evil = RelayNode(TOKEN, auth(), slow_store_reader(store, 0), server_cls=EvilServer)
    evil_server = evil.server
    evil.start_fetch(manifest, []).result(timeout=30)
    child, grandchild = nodes(store, 2)
    try:
        buf = child.start_fetch(manifest, [evil_server.url]).result(timeout=30)
        assert buf.files() == files
        assert buf.sources[2] == "store" and buf.sources[0] == evil_server.url
        # the grandchild, fed by the child, never sees the bad bytes either
        assert grandchild.start_fetch(manifest, [child.url]).result(timeout=30).files() == files
    finally:
        for node in (evil, child, grandchild):
            node.close()


def test_parent_dying_mid_transfer(store):
    manifest, files = make_version(store, sizes=(2_000_000,))
    parent, child = nodes(store, 2)
    try:
        pfut = parent.start_fetch(manifest, [])
        cfut = child.start_fetch(manifest, [parent.url])

        def child_has_a_chunk():
            buf = child.server.buffers.get(1)
            return buf is not None and any(d is not None for d in buf.data)

        deadline = time.time() + 20
        while time.time() < deadline and not child_has_a_chunk():
            time.sleep(0.005)
        parent.close()  # the parent dies with most of the version still to send
        buf = cfut.result(timeout=60)
        assert buf.files() == files
        assert parent.url in buf.sources and "store" in buf.sources
    finally:
        child.close()
        pfut.cancel()


@pytest.mark.e2e
def test_stalled_parent_is_left_for_the_store(store):
    manifest, files = make_version(store)
    url, stop = raw_peer(None)
    (child,) = nodes(store, 1, FetchPolicy(pipeline_wait_s=0.5, expected_mbit=100))
    try:
        t0 = time.time()
        buf = child.start_fetch(manifest, [url]).result(timeout=60)
        assert buf.files() == files and set(buf.sources) == {"store"}
        assert time.time() - t0 < 30
    finally:
        child.close()
        stop()


def test_requests_without_the_run_token_get_401(store):
    manifest, _ = make_version(store)
    (node,) = nodes(store, 1)
    try:
        node.start_fetch(manifest, []).result(timeout=30)

        async def get(headers):
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{node.url}/v1/versions/1/chunks/0", headers=headers) as r:
                    return r.status

        assert asyncio.run(get({})) == 401
        assert asyncio.run(get({"Authorization": "Bearer wrong"})) == 401
        assert asyncio.run(get({"Authorization": f"Bearer {TOKEN}"})) == 200
    finally:
        node.close()


def test_forged_and_re_signed_manifests_are_rejected(store):
    import hashlib
    import hmac
    import json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    manifest, _ = make_version(store)
    assert verify_signature(manifest, PUBLIC) == manifest
    forged = {**manifest, "files": manifest["files"][:1]}
    with pytest.raises(ManifestRejected):
        verify_signature(forged, PUBLIC)
    with pytest.raises(ManifestRejected):
        verify_signature(sign(forged, Ed25519PrivateKey.generate()), PUBLIC)
    body = json.dumps({k: v for k, v in forged.items() if k != "signature"}, sort_keys=True, separators=(",", ":"))
    with pytest.raises(ManifestRejected):  # what the old HMAC scheme would sign, under what an actor holds
        mac = hmac.new(TOKEN.encode(), body.encode(), hashlib.sha256).hexdigest()
        verify_signature({**forged, "signature": mac}, PUBLIC)
    for bad in (None, 7, "zz", manifest["signature"][:-2], ["x"]):
        with pytest.raises(ManifestRejected):
            verify_signature({**manifest, "signature": bad}, PUBLIC)
    with pytest.raises(ManifestRejected):
        verify_signature({k: v for k, v in manifest.items() if k != "signature"}, PUBLIC)


def test_receiver_refuses_a_manifest_signed_with_another_key(store, tmp_path):
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from echo2.data.weights import publish_version

    publish_version(store, 0, {"w": torch.ones(4)}, extra_files={}, shard_mb=1, key=Ed25519PrivateKey.generate())
    receiver = PolicyReceiver(store, "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=2, run_id=RUN_ID)
    try:
        assert receiver.poll() is None and 0 in receiver.rejected
        publish_version(store, 1, {"w": torch.ones(4)}, extra_files={}, shard_mb=1, key=KEY)
        deadline = time.time() + 10
        got = None
        while got is None and time.time() < deadline:
            got = receiver.poll()
            time.sleep(0.05)
        assert got is not None and got.version == 1
    finally:
        receiver.close()


def test_a_latest_pinned_to_a_forgery_does_not_hold_the_actor_back(store):
    """Someone with write access to policy/ plants a forged version and keeps LATEST on it: the receiver
    rejects it and takes the newest genuine version anyway (it would otherwise wait for the next publish)."""
    import json

    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from echo2.data import layout
    from echo2.data.weights import publish_version

    receiver = PolicyReceiver(store, "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=2, run_id=RUN_ID)
    try:
        publish_version(store, 0, {"w": torch.ones(4)}, extra_files={}, shard_mb=1, key=KEY)
        publish_version(store, 1, {"w": torch.ones(4)}, extra_files={}, shard_mb=1, key=KEY)
        publish_version(store, 99, {"w": torch.zeros(4)}, extra_files={}, shard_mb=1, key=Ed25519PrivateKey.generate())
        store.put_pointer(layout.LATEST, json.dumps({"version": 99}).encode())
        deadline = time.time() + 10
        got = None
        while got is None and time.time() < deadline:
            got = receiver.poll()
            time.sleep(0.05)
        assert 99 in receiver.rejected and got is not None and got.version == 1
        assert store.get_json(layout.LATEST) == {"version": 99}  # the pointer is never written by an actor
    finally:
        receiver.close()


def test_topology_rule():
    assert [parent_index(k, fanout=1, roots=1) for k in range(4)] == [None, 0, 1, 2]
    assert [parent_index(k, fanout=2, roots=1) for k in range(5)] == [None, 0, 0, 1, 1]
    assert [parent_index(k, fanout=2, roots=2) for k in range(6)] == [None, None, 0, 0, 1, 1]
    relay = plan({"a": "ua", "b": "ub", "c": "uc"}, 7, fanout=1, roots=1)
    ids = [p["id"] for p in relay["peers"]]
    assert relay == plan({"c": "uc", "a": "ua", "b": "ub"}, 7, fanout=1, roots=1)  # deterministic
    assert sources(relay, ids[0]) == [] and sources(relay, "stranger") == []
    assert sources(relay, ids[2]) == [f"u{ids[1]}", f"u{ids[0]}"]  # parent, then grandparent


def test_reports_of_failed_parents_need_two_reporters_to_move_the_plan():
    """One report (a lying child's about an honest parent, say) changes no one's place; two distinct
    reporters take the parent out. Only recent reports of published versions between planned peers count."""
    from echo2.broadcast.topology import QUORUM, REPORT_VERSIONS, PeerRecord, standing_reports

    def records(**failed):
        return {a: PeerRecord(f"http://{a}:1", 0.0, failed.get(a, {})) for a in ("a", "b", "c", "d")}

    live = {a: f"http://{a}:1" for a in "abcd"}
    version = 30
    lone = standing_reports(records(a={"b": 29}), version)
    assert lone == {"b": {"a"}} and plan(live, version, fanout=1, roots=1, reports=lone) == plan(
        live, version, fanout=1, roots=1)
    two = standing_reports(records(a={"b": 29}, c={"b": 29 - REPORT_VERSIONS + 1}), version)
    assert two == {"b": {"a", "c"}} and QUORUM == 2
    assert [p["id"] for p in plan(live, version, fanout=1, roots=1, reports=two)["peers"]] == [
        i for i in [p["id"] for p in plan(live, version, fanout=1, roots=1)["peers"]] if i != "b"]
    ignored = records(a={"b": version - REPORT_VERSIONS - 1},  # too old
                      c={"b": version + 5, "stranger": 29, "c": 29},  # from the future, of a non-peer, of itself
                      d={"b": 29})
    assert standing_reports(ignored, version) == {"b": {"d"}}
