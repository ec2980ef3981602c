"""A streamed run of chunks (``relay.py``) from hostile or unlucky parents: every way a run can end (the
honest not-there is not reported; a hold, a junk tag, a bare end, a death mid-chunk are), a parent whose hold
on a chunk is up, a malformed ``?run=``, and a version received again while a run of it is streamed."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from helpers import wait_until
from relay_helpers import CHUNK, TOKEN, _bare_peer, _read_head, auth, make_version, nodes, slow_store_reader

from echo2.broadcast.protocol import FetchPolicy, Peer
from echo2.broadcast.relay_node import RelayNode, new_buffer
from echo2.data.store import open_store


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


def run_peer(first_chunk: bytes, ending: bytes):
    """A test peer on a bare socket that answers any request with a 200, a body delimited by the connection's
    close: chunk 0 as a run sends it (``TAG_CHUNK`` + its bytes), then ``ending``, then hangs up."""
    def serve(conn, stop):
        with conn:
            try:
                _read_head(conn)
                conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"C" + first_chunk + ending)
            except OSError:
                pass

    return _bare_peer(serve)


@pytest.mark.parametrize("ending, reported", [
    (b"N", None),  # the honest "it will not come here": not held against the peer
    (b"H", "held it past its hold"),
    (b"X", "sent junk"),
    (b"", "ended the run"),
    (b"C" + b"\x00" * 100, "sent 100 bytes for chunk 1"),  # dies mid-chunk
])
def test_a_run_that_ends_short_is_left_for_the_next_source(store, ending, reported):
    manifest, files = make_version(store)
    url, stop = run_peer(files["shard-0000.safetensors"][:CHUNK], ending)
    (child,) = nodes(store, 1, FetchPolicy(pipeline_wait_s=60))
    left = []
    try:
        buf = child.start_fetch(manifest, [Peer(url, "p")], on_left=lambda p, v, why: left.append(why))
        buf = buf.result(timeout=60)
        assert buf.files() == files and buf.sources[0] == f"p at {url}" and set(buf.sources[1:]) == {"store"}
        assert (left == []) if reported is None else (len(left) == 1 and reported in left[0]), left
    finally:
        child.close()
        stop()


async def hold_chunk_0_only(parent, manifest, files):
    """The parent holds chunk 0 of the version and nothing else (its slow store never delivers the rest)."""
    buffer = new_buffer(manifest)
    buffer.put(0, files["shard-0000.safetensors"][:CHUNK], "seed")
    parent.server.add(buffer)


def test_a_parent_still_waiting_for_a_chunk_ends_the_run_when_its_hold_is_up(store):
    """The parent has chunk 0 and never gets chunk 1: it streams chunk 0, holds chunk 1 ``pipeline_wait_s``
    and ends the run saying so (``TAG_NOT_YET``, the 503 of a single request); the child reports it."""
    manifest, files = make_version(store)
    parent = RelayNode(TOKEN, auth(), slow_store_reader(store, 0), policy=FetchPolicy(pipeline_wait_s=0.3))
    (child,) = nodes(store, 1, FetchPolicy(pipeline_wait_s=0.3))
    left = []

    try:
        parent._call(hold_chunk_0_only(parent, manifest, files))
        buf = child.start_fetch(manifest, [Peer(parent.url, "p")], on_left=lambda p, v, why: left.append(why))
        buf = buf.result(timeout=30)
        assert buf.files() == files and buf.sources[0] == f"p at {parent.url}" and buf.sources[1] == "store"
        assert len(left) == 1 and "held it past its hold at chunk 1" in left[0], left
    finally:
        child.close()
        parent.close()


@pytest.mark.parametrize("run, status, chunks", [("-5", 200, 1), ("0", 200, 1), ("abc", 404, 0),
                                                 (str(10**12), 200, 10)])
def test_a_malformed_run_is_bounded_by_the_version(store, run, status, chunks):
    manifest, files = make_version(store)
    (parent,) = nodes(store, 1)
    try:
        parent.start_fetch(manifest, []).result(timeout=30)

        async def get():
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
                async with s.get(f"{parent.url}/v1/versions/1/chunks/0?run={run}") as resp:
                    return resp.status, await resp.read()

        got, body = asyncio.run(get())
        assert got == status
        if status == 200:
            sizes = [c.size for c in parent.server.buffers[1].chunks]
            assert len(body) == sum(size + 1 for size in sizes[:chunks]) and body[:1] == b"C"
    finally:
        parent.close()


def test_a_run_ends_when_its_version_is_received_again_meanwhile(store):
    """A parent streaming v1 from the buffer it had when the run began gets a new v1 (a resumed learner's
    timeline): the run ends as not-there (not reported), never serving from the old buffer."""
    manifest, files = make_version(store)
    parent = RelayNode(TOKEN, auth(), slow_store_reader(store, 0), policy=FetchPolicy(pipeline_wait_s=30))
    (child,) = nodes(store, 1, FetchPolicy(pipeline_wait_s=30))
    left = []

    async def receive_it_again():  # same number, a new buffer, received whole; the old one never gets chunk 1
        again = new_buffer(manifest)
        parent.server.add(again)
        for chunk in again.chunks:
            again.put(chunk.index, files[chunk.file][chunk.offset:chunk.offset + chunk.size], "seed")

    try:
        parent._call(hold_chunk_0_only(parent, manifest, files))
        fut = child.start_fetch(manifest, [Peer(parent.url, "p")], on_left=lambda p, v, why: left.append(why))
        wait_until(lambda: (b := child.server.buffers.get(1)) is not None and b.data[0] is not None, 10, "chunk 0")
        parent._call(receive_it_again())
        buf = fut.result(timeout=20)
        assert buf.files() == files and buf.sources[0] == f"p at {parent.url}" and buf.sources[1] == "store"
        assert left == []  # the honest end of a run
    finally:
        child.close()
        parent.close()


def test_a_child_that_leaves_mid_run_ends_it_quietly(store, caplog):
    """A child that reads the head of a run and resets its connection (killed): the parent's run ends at debug
    level, not with aiohttp's 'Error handling request' traceback (reset, or aiohttp's 'Connection lost')."""
    import logging
    import socket
    import struct

    manifest, files = make_version(store, sizes=(128 * CHUNK,))
    (parent,) = nodes(store, 1)
    parent.seed(manifest, files)
    caplog.set_level(logging.DEBUG)
    try:
        conn = socket.create_connection(("127.0.0.1", parent.server.port))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.sendall(f"GET /v1/versions/1/chunks/0?run=128 HTTP/1.1\r\nHost: x\r\n"
                     f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
        _read_head(conn)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
        conn.close()
        wait_until(lambda: any("child left a run" in r.getMessage() for r in caplog.records), 20,
                   "the parent to notice the child left")
    finally:
        parent.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
