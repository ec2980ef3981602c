"""How a relay root reads the store (``fetcher.py``): enough chunk requests in flight to cover the store's
bandwidth-delay product when chunks are small (``FetchPolicy.store_requests``), or, where the store can stream a
byte range, one streamed ranged read per run of chunks, in order, every chunk still checked against the signed
manifest as it comes (a bad one is never put; what is left is read chunk by chunk). Also the buffer's count of
missing chunks, which replaced a scan of every chunk per chunk put.

Real parts: ``RelayNode``s on loopback, a real local store, signed test versions (``relay_helpers``)."""

from __future__ import annotations

import threading

import pytest
from relay_helpers import TOKEN, auth, make_version

from echo2.broadcast.protocol import MAX_STORE_REQUESTS, FetchPolicy, SourceFailed
from echo2.broadcast.relay_node import RelayNode, new_buffer
from echo2.data.store import open_store

SMALL = 16 * 1024  # the test versions' chunks are 64 KB (relay_helpers.CHUNK)


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


def _reader(store):
    def read(chunk, manifest):
        return store.get_range(f"policy/v{int(manifest['version']):06d}/{chunk.file}", chunk.offset,
                               chunk.offset + chunk.size)
    return read


def _fetch_from_the_store(manifest, store_read, store_stream):
    """A root's fetch of ``manifest`` with no peers: from the store's stream, chunk reads where it fails."""
    node = RelayNode(TOKEN, auth(), store_read, store_stream=store_stream)
    try:
        return node.start_fetch(manifest, []).result(30)
    finally:
        node.close()


def test_small_chunks_get_more_store_requests_in_flight_never_fewer_than_the_window():
    policy = FetchPolicy(window=4, store_bytes_in_flight=8 * 2**20)
    assert policy.store_requests(2**20) == 8  # 8 MB in flight
    assert policy.store_requests(256 * 1024) == 32
    assert policy.store_requests(8 * 2**20) == 4  # large chunks: the window
    assert policy.store_requests(1024) == MAX_STORE_REQUESTS  # bounded: threads
    assert FetchPolicy(window=40).store_requests(1024) == 40  # a configured window is never cut


def test_a_root_keeps_store_requests_in_flight_beyond_the_window(store):
    """Eight requests must be in flight at once (a barrier of 8 that the reads wait at); with the window's 4
    alone it would break (``BrokenBarrierError`` fails the version)."""
    manifest, files = make_version(store, sizes=(8 * 64 * 1024,))
    read = _reader(store)
    barrier = threading.Barrier(8, timeout=20)

    def store_read(chunk, m):
        if chunk.index < 8:
            barrier.wait()
        return read(chunk, m)

    node = RelayNode(TOKEN, auth(), store_read, policy=FetchPolicy(window=4, store_bytes_in_flight=8 * 64 * 1024))
    try:
        buffer = node.start_fetch(manifest, []).result(30)
    finally:
        node.close()
    assert buffer.missing == 0 and b"".join(buffer.data) == files["shard-0000.safetensors"]
    assert set(buffer.sources) == {"store"}


def test_a_streaming_store_is_read_in_order_once_per_file_and_every_chunk_verified(store):
    manifest, files = make_version(store)  # three files: one stream each
    read = _reader(store)
    streams, reads = [], []

    def store_stream(chunks, m):
        streams.append([c.index for c in chunks])
        for chunk in chunks:
            yield read(chunk, m)

    def store_read(chunk, m):
        reads.append(chunk.index)
        return read(chunk, m)

    buffer = _fetch_from_the_store(manifest, store_read, store_stream)
    assert reads == []
    assert [len(s) for s in streams] == [5, 4, 1]  # 300 000, 200 000 and 5 bytes in 64 KB chunks, per file
    assert sum(streams, []) == list(range(len(buffer.chunks)))
    assert buffer.files() == files


def test_a_bad_chunk_in_the_store_stream_is_never_put_and_the_rest_is_read_chunk_by_chunk(store):
    manifest, files = make_version(store)
    read = _reader(store)
    arrived = []

    def store_stream(chunks, m):
        for chunk in chunks:
            data = read(chunk, m)
            yield b"\x00" + data[1:] if chunk.index == 2 else data  # the store's stream corrupts chunk 2

    def store_read(chunk, m):
        arrived.append(chunk.index)
        return read(chunk, m)

    buffer = _fetch_from_the_store(manifest, store_read, store_stream)
    assert 2 in arrived and 0 not in arrived and 1 not in arrived  # before the bad one: from the stream
    assert buffer.files() == files  # every chunk verified; the corrupted one came again, whole


def test_a_store_stream_that_ends_early_is_finished_chunk_by_chunk(store):
    manifest, files = make_version(store)
    read = _reader(store)

    def store_stream(chunks, m):
        yield read(chunks[0], m)  # then nothing: a connection that closed

    node = RelayNode(TOKEN, auth(), read, store_stream=store_stream)
    try:
        buffer = node.start_fetch(manifest, []).result(30)
    finally:
        node.close()
    assert buffer.files() == files and buffer.missing == 0


def test_the_buffer_counts_what_is_missing_and_is_done_at_the_last_chunk(store):
    manifest, files = make_version(store, sizes=(3 * 64 * 1024,))
    buffer = new_buffer(manifest)
    data = files["shard-0000.safetensors"]
    assert buffer.missing == 3 and not buffer.done.is_set()
    with pytest.raises(SourceFailed):
        buffer.put(0, b"x" * buffer.chunks[0].size, "bad")
    assert buffer.missing == 3
    for i in (2, 0, 0):  # a chunk put twice counts once
        c = buffer.chunks[i]
        buffer.put(i, data[c.offset : c.offset + c.size], "t")
    assert buffer.missing == 1 and not buffer.done.is_set()
    c = buffer.chunks[1]
    buffer.put(1, data[c.offset : c.offset + c.size], "t")
    assert buffer.missing == 0 and buffer.done.is_set()
