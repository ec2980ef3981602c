"""``ObjectStore.stream_range``: a byte range as consecutive pieces, from one request, on local files, memory and
S3 (moto's server); and the actor's receiver handing it to its relay node, so that a root reads the store one
streamed ranged read per run of chunks (``fetcher.Fetcher._store_runs``) instead of one request per chunk.

Requests to S3 are counted by the fault-injecting proxy with no faults (``echo2.chaos.s3_proxy``, ``forwarded``:
every request it passed on to moto), or, where the ranges matter, by a wrapper of s3fs's ``_call_s3``."""

from __future__ import annotations

import json
import os

import pytest
from botocore.exceptions import ResponseStreamingError
from relay_helpers import PUBLIC, RUN_ID, TOKEN, make_version, poll_until

from echo2.broadcast.receiver import PolicyReceiver
from echo2.config import BroadcastConfig
from echo2.data import layout
from echo2.data.store import NotFound, is_transient, open_store
from echo2.data.store.base import ShortRead
from echo2.data.store.fsspec_store import FsspecStore

DATA = os.urandom(300_001)


@pytest.fixture
def store(each_store):  # every backend (conftest.py)
    return each_store


def test_the_pieces_are_the_bytes_get_range_reads(store):
    store.put("w/shard.safetensors", DATA)
    assert store.can_stream
    sizes = [65_536, 65_536, 1, 0, 100_000, 68_928]  # to the last byte of the object
    pieces = list(store.stream_range("w/shard.safetensors", 0, sizes))
    assert [len(p) for p in pieces] == sizes
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    # an empty piece is b"" without a read; so is get_range of an empty span (on S3 it used to ask for
    # "bytes=o-(o-1)", which S3 and moto answer with the whole object)
    assert pieces == [store.get_range("w/shard.safetensors", o, o + n) for o, n in zip(offsets, sizes)]
    assert store.get_range("w/shard.safetensors", 70_000, 70_000) == b""
    assert list(store.stream_range("w/shard.safetensors", 1000, [7, 9])) == [DATA[1000:1007], DATA[1007:1016]]
    assert list(store.stream_range("w/shard.safetensors", 5, [])) == []


def test_a_short_object_yields_its_whole_pieces_then_raises_naming_the_key_and_the_sizes(store):
    store.put("w/short", DATA[:1000])
    pieces = []
    with pytest.raises(ShortRead) as err:
        for piece in store.stream_range("w/short", 100, [400, 400, 400]):
            pieces.append(piece)
    assert pieces == [DATA[100:500], DATA[500:900]]  # never the short third one
    assert "w/short" in str(err.value) and "[400, 400, 400]" in str(err.value)
    with pytest.raises(ShortRead, match="w/short"):  # the range starts past the end (S3: 416 InvalidRange)
        list(store.stream_range("w/short", 5000, [10]))


def test_a_missing_key_is_not_found(store):
    with pytest.raises(NotFound):
        list(store.stream_range("w/absent", 0, [10]))


def test_a_store_that_cannot_stream_says_so(tmp_path):
    http = FsspecStore("http://127.0.0.1:9/nothing", {})  # fsspec's http filesystem: no request is made here
    assert not http.can_stream
    with pytest.raises(NotImplementedError):
        http.stream_range("x", 0, [1])


def test_a_body_that_ended_before_its_length_is_transient():
    """botocore's IncompleteReadError: the connection dropped mid-body (a stream's piece is asked for again)."""
    from botocore.exceptions import IncompleteReadError

    assert is_transient(IncompleteReadError(actual_bytes=10, expected_bytes=20))


def test_s3_reads_a_range_with_one_request(s3_server, moto_credentials):
    import boto3

    from echo2.chaos.s3_proxy import FaultyS3Proxy

    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket="echo2-stream-count")
    proxy = FaultyS3Proxy(s3_server, fail_rate=0.0)
    url = proxy.start()
    try:
        store = open_store("s3://echo2-stream-count/root", {"endpoint_url": url, "skip_instance_cache": True})
        store.put("k", DATA)
        sizes = [65_536] * 4 + [10]
        before = proxy.forwarded
        assert b"".join(store.stream_range("k", 3, sizes)) == DATA[3 : 3 + sum(sizes)]
        assert proxy.forwarded - before == 1  # one GetObject, read a piece at a time
    finally:
        proxy.stop()


def test_s3_a_stream_broken_mid_range_asks_again_from_the_piece_it_broke_in(s3_store, monkeypatch):
    """The first GetObject's body fails (a reset connection, as aiobotocore reports it) once the first piece is
    read: the second request starts at the second piece, and no piece is yielded twice."""
    s3_store.put("k", DATA)
    fs, ranges = s3_store.fs, []
    real_call = fs._call_s3

    async def call_s3_whose_first_body_breaks(method, *args, **kwargs):
        answer = await real_call(method, *args, **kwargs)
        if method == "get_object":
            ranges.append(kwargs["Range"])
            if len(ranges) == 1:
                body, real_read, read = answer["Body"], answer["Body"].read, []

                async def read_then_break(n):
                    if sum(read) >= 1000:
                        raise ResponseStreamingError(error="test double: connection reset mid-body")
                    read.append(len(data := await real_read(n)))
                    return data

                body.read = read_then_break
        return answer

    monkeypatch.setattr(fs, "_call_s3", call_s3_whose_first_body_breaks)
    pieces = list(s3_store.stream_range("k", 0, [1000, 2000, 3000]))
    assert pieces == [DATA[:1000], DATA[1000:3000], DATA[3000:6000]]
    assert ranges == ["bytes=0-5999", "bytes=1000-5999"]


# -- the receiver: a root reads the store streamed, every chunk verified and counted -----------------------------

@pytest.fixture(params=["file", "s3"])
def run_store(request, tmp_path):
    return open_store(str(tmp_path / "run")) if request.param == "file" else request.getfixturevalue("s3_store")


def test_the_receiver_reads_each_file_of_a_version_as_one_stream(run_store, monkeypatch):
    manifest, files = make_version(run_store, 1)  # 64 KB chunks: runs of 5, 4 and 1 chunks
    run_store.put_json(layout.manifest_key(layout.policy_dir(1)), manifest)
    run_store.put_pointer(layout.LATEST, json.dumps({"version": 1}).encode())
    streamed, real_stream = [], run_store.stream_range

    def stream_range(key, start, sizes):
        streamed.append((key, start, len(sizes)))
        return real_stream(key, start, sizes)

    monkeypatch.setattr(run_store, "stream_range", stream_range)
    receiver = PolicyReceiver(run_store, "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=2,
                              run_id=RUN_ID)
    try:
        assert receiver.node.fetcher.store_stream is not None
        buffer = poll_until(receiver, 1)
    finally:
        receiver.close()
    assert buffer.files() == files and set(buffer.sources) == {"store"}
    assert sorted(streamed) == [(f"{layout.policy_dir(1)}/{name}", 0, n)
                                for name, n in zip(sorted(files), (5, 4, 1))]
    assert receiver.read_bytes["store"] == sum(len(d) for d in files.values())  # billed as read


def test_a_store_wrapped_by_a_stand_in_is_read_chunk_by_chunk(tmp_path):
    """A stand-in that overrides ``get_range`` and delegates the rest (as tests' gated and slow stores do) is
    not an ``ObjectStore``: a stream would go around its ``get_range``, so the receiver does not stream."""
    store = open_store(str(tmp_path / "run"))

    class Wrapped:
        def get_range(self, key, start, end):
            return store.get_range(key, start, end)

        def __getattr__(self, name):
            return getattr(store, name)

    receiver = PolicyReceiver(Wrapped(), "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=2,
                              run_id=RUN_ID)
    try:
        assert receiver.node.fetcher.store_stream is None
    finally:
        receiver.close()
