"""The ObjectStore contract on local files, memory:// and S3 (moto's server on loopback)."""

import threading

import pytest

from echo2.data.store import AlreadyExists, NotFound, open_store


@pytest.fixture(params=["file", "memory", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(str(tmp_path / "store"))
    if request.param == "memory":
        import uuid

        return open_store(f"memory://echo2-test-{uuid.uuid4().hex}")
    return request.getfixturevalue("s3_store")


def test_put_get_list_delete(store):
    store.put("a/b/one.bin", b"1")
    store.put("a/two.bin", b"22")
    store.put("c.txt", b"333")
    assert store.get("a/b/one.bin") == b"1"
    assert store.list("a/") == ["a/b/one.bin", "a/two.bin"]
    assert store.list() == ["a/b/one.bin", "a/two.bin", "c.txt"]
    assert store.exists("c.txt") and not store.exists("nope")
    store.delete("a/two.bin")
    assert store.list("a/") == ["a/b/one.bin"]
    with pytest.raises(NotFound):
        store.get("a/two.bin")
    assert store.list("missing/") == []


def test_create_if_absent_is_exclusive(store):
    store.put("k", b"first")
    with pytest.raises(AlreadyExists):
        store.put("k", b"second")
    assert store.get("k") == b"first"


def test_pointer_overwrites(store):
    store.put_pointer("policy/LATEST", b'{"version": 1}')
    store.put_pointer("policy/LATEST", b'{"version": 2}')
    assert store.get_json("policy/LATEST") == {"version": 2}


def test_child_store_is_rooted(store):
    run = store.child("runs/r1")
    run.put_json("run.json", {"x": 1})
    assert store.get_json("runs/r1/run.json") == {"x": 1}
    assert run.list() == ["run.json"]


def test_move_keeps_the_bytes(store):
    store.put("rollouts/v000001/a.arrow", b"data")
    store.move("rollouts/v000001/a.arrow", "quarantine/rollouts/v000001/a.arrow")
    assert not store.exists("rollouts/v000001/a.arrow")
    assert store.get("quarantine/rollouts/v000001/a.arrow") == b"data"


def test_concurrent_creators_exactly_one_wins(tmp_path):
    store = open_store(str(tmp_path))
    wins, losses = [], []

    def writer(i):
        try:
            store.put("commit", str(i).encode())
            wins.append(i)
        except AlreadyExists:
            losses.append(i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 15
    assert store.get("commit") == str(wins[0]).encode()
    assert store.list() == ["commit"]  # no temp files left behind


def test_s3_create_if_absent_uses_the_wire_protocol(s3_store, s3_server):
    """The second create is refused by the server (412), not by a client-side check."""
    import boto3
    from botocore.exceptions import ClientError

    s3_store.put("x", b"1")
    bucket = s3_store.root.split("/")[0]
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    with pytest.raises(ClientError) as err:
        client.put_object(Bucket=bucket, Key="root/x", Body=b"2", IfNoneMatch="*")
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412


def test_unreachable_s3_store_fails_check(monkeypatch):
    from echo2.data.fsspec_store import FsspecStore
    from echo2.data.store import StoreError

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    store = FsspecStore("s3://nobucket/x", {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {
        "connect_timeout": 1, "retries": {"max_attempts": 1}}})
    with pytest.raises(StoreError, match="unreachable"):
        store.check()
