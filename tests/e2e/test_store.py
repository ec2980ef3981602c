"""The ObjectStore contract on local files, memory:// and S3 (moto's server on loopback)."""

import threading

import pytest

from echo2.data.store import AlreadyExists, NotFound, is_transient, open_store


@pytest.fixture
def store(each_store):  # every backend (conftest.py)
    return each_store


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


def test_copy_replaces_the_target_and_keeps_the_source(store):
    store.put("rollouts/v000001/a.arrow", b"data")
    store.put("quarantine/rollouts/v000001/a.arrow", b"what an interrupted earlier move left")
    store.copy("rollouts/v000001/a.arrow", "quarantine/rollouts/v000001/a.arrow")
    assert store.get("quarantine/rollouts/v000001/a.arrow") == b"data"
    assert store.get("rollouts/v000001/a.arrow") == b"data"
    with pytest.raises(NotFound):
        store.copy("rollouts/v000001/missing.arrow", "quarantine/x")
    assert not store.exists("quarantine/x")
    assert not [k for k in store.list() if ".tmp-" in k]


def test_a_huge_local_file_is_moved_without_reading_it(tmp_path):
    """Moving (quarantine, resume's orphan move) links the file under its new name: a sparse file far
    over any rollout limit moves at once, as the very same file (inode), never read."""
    store = open_store(str(tmp_path / "store"))
    key = "rollouts/v000001/a-000001.arrow"
    path = tmp_path / "store" / key
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(512 * 2**20)  # sparse: no block of it is written
    inode = path.stat().st_ino
    store.move(key, "quarantine/" + key)
    moved = tmp_path / "store" / "quarantine" / key
    assert moved.stat().st_ino == inode and moved.stat().st_size == 512 * 2**20
    assert not path.exists()


def test_a_create_that_meets_its_own_bytes_succeeds(store):
    """A create whose object is already there with exactly its bytes has succeeded (an earlier try of
    its own landed); any other object there is a conflict, whatever its size."""
    store.put("rollouts/v000001/a.arrow", b"payload")
    store.put("rollouts/v000001/a.arrow", b"payload")
    for other in (b"PAYLOAD", b"payload, longer", b"p"):
        with pytest.raises(AlreadyExists):
            store.put("rollouts/v000001/a.arrow", other)
    assert store.get("rollouts/v000001/a.arrow") == b"payload"


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


def test_s3_create_if_absent_is_refused_by_the_server(s3_store, monkeypatch):
    """The second create is refused by the server (412 on If-None-Match), not by a client-side check.

    Every way s3fs could look the key up first is made to lie ("absent"): a put that relied on a
    check-then-write would then overwrite the object instead of raising.
    """
    s3_store.put("x", b"1")
    fs = s3_store.fs

    def lookup_double_says_absent(*args, **kwargs):
        raise FileNotFoundError("test double: every lookup says absent")

    async def async_lookup_double_says_absent(*args, **kwargs):
        raise FileNotFoundError("test double: every lookup says absent")

    def exists_double_says_no(*args, **kwargs):
        return False

    async def async_exists_double_says_no(*args, **kwargs):
        return False

    with monkeypatch.context() as m:
        # both the sync and the async names: fsspec binds each sync method to its async twin
        for name in ("exists", "isfile"):
            m.setattr(fs, name, exists_double_says_no)
            m.setattr(fs, f"_{name}", async_exists_double_says_no)
        m.setattr(fs, "info", lookup_double_says_absent)
        m.setattr(fs, "_info", async_lookup_double_says_absent)
        assert not fs.exists(f"{s3_store.root}/x")  # the lie is in place
        with pytest.raises(AlreadyExists):
            s3_store.put("x", b"2", if_absent=True)
        s3_store.put_pointer("p", b"old")
        s3_store.put_pointer("p", b"new")
    assert s3_store.get("x") == b"1"
    assert s3_store.get("p") == b"new"


def _lose_first_response(patch, fs, *, first_call_reaches_server: bool) -> list:
    """Test double around s3fs's ``pipe_file``: the first call fails with a ``ConnectionError``.

    With ``first_call_reaches_server`` the object is really written before the error (a lost
    response); without it the request never arrives. Returns the list of calls made.
    """
    real_pipe_file = fs.pipe_file
    calls = []

    def pipe_file_losing_first_response(path, data, **kwargs):
        calls.append(data)
        if len(calls) == 1:
            if first_call_reaches_server:
                real_pipe_file(path, data, **kwargs)
            raise ConnectionError("test double: connection reset before the response arrived")
        return real_pipe_file(path, data, **kwargs)

    patch.setattr(fs, "pipe_file", pipe_file_losing_first_response)
    return calls


def test_s3_create_survives_a_lost_response(s3_store, monkeypatch):
    """The put landed but its response was lost; the retry's 412 must not turn success into failure."""
    with monkeypatch.context() as m:
        calls = _lose_first_response(m, s3_store.fs, first_call_reaches_server=True)
        s3_store.put("rollouts/v000001/a.arrow", b"payload")
    assert len(calls) == 2  # the retry happened and met the object the first attempt wrote
    assert s3_store.get("rollouts/v000001/a.arrow") == b"payload"


def test_s3_retried_create_still_refuses_other_bytes(s3_store, monkeypatch):
    """A retry that meets somebody else's object is a genuine conflict."""
    s3_store.put("commit", b"theirs")
    with monkeypatch.context() as m:
        calls = _lose_first_response(m, s3_store.fs, first_call_reaches_server=False)
        with pytest.raises(AlreadyExists):
            s3_store.put("commit", b"ours")
    assert len(calls) == 2  # the 412 came on the retry, where the object is read back
    assert s3_store.get("commit") == b"theirs"


def test_s3_create_retried_inside_the_client_library_succeeds(s3_store, monkeypatch):
    """The lost response was retried by botocore or s3fs inside one attempt of ours: the object landed
    and the library's own retry got 412, so our first attempt sees AlreadyExists (issue 18, item 11)."""
    real_pipe_file = s3_store.fs.pipe_file
    calls = []

    def pipe_file_whose_library_retry_got_412(path, data, **kwargs):
        calls.append(data)
        real_pipe_file(path, data, **kwargs)  # the PutObject landed; its answer was lost
        raise FileExistsError("test double: the library's retry of the PutObject got 412 Precondition Failed")

    with monkeypatch.context() as m:
        m.setattr(s3_store.fs, "pipe_file", pipe_file_whose_library_retry_got_412)
        s3_store.put("rollouts/v000001/a-000001.arrow", b"payload")
        assert len(calls) == 1  # settled on the first attempt, by reading the object back
        with pytest.raises(AlreadyExists):  # the same lost answer over another's object is a conflict
            s3_store.put("rollouts/v000001/a-000001.arrow", b"another")
    assert s3_store.get("rollouts/v000001/a-000001.arrow") == b"payload"


@pytest.mark.e2e
def test_one_layer_retries_a_failing_store(s3_server, moto_credentials):
    """echo2's retry loop is the only one: botocore and s3fs make one request per attempt of ours, so a
    dead store surfaces after ``retry_s`` (issue 18, item 11: the layers stacked to over 8 minutes).
    The store is behind the fault-injecting proxy in an outage (503 SlowDown, 500, connection reset
    in turn, each of which botocore and s3fs used to retry); ``retry_s=0`` is one attempt of ours."""
    from echo2.chaos.s3_proxy import FaultyS3Proxy

    proxy = FaultyS3Proxy(s3_server, fail_rate=0.0)
    url = proxy.start()
    try:
        proxy.outage(3600)
        store = open_store("s3://echo2-outage/root", {"endpoint_url": url, "skip_instance_cache": True}, retry_s=0)
        for attempt in range(3):  # the proxy's three kinds of failure meet each operation in turn
            for op in (lambda: store.get("k"), lambda: store.put("k", b"1"), lambda: store.get_range("k", 0, 1)):
                before = proxy.failed
                with pytest.raises(Exception) as err:
                    op()
                assert is_transient(err.value), repr(err.value)
                # one request; two where the proxy reset a pooled keep-alive connection, on which aiohttp
                # sends the request once more (before: 7 to 15 requests, botocore's and s3fs's retries)
                assert 1 <= proxy.failed - before <= 2, (attempt, repr(err.value))
    finally:
        proxy.stop()


def test_answers_about_an_object_are_not_transient():
    """A 4xx answer is about the request, even where s3fs files an unknown code under EIO (a GLACIER
    object's CopyObject: ObjectNotInActiveTierError): retrying it would only delay the quarantine."""
    import errno

    from botocore.exceptions import ClientError

    def translated(status: int, code: str) -> OSError:
        exc = OSError(errno.EIO, f"{code} (test value, as s3fs translates an unknown code)")
        exc.__cause__ = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")
        return exc

    assert not is_transient(translated(403, "ObjectNotInActiveTierError"))
    assert not is_transient(translated(400, "InvalidRequest"))
    assert not is_transient(PermissionError("The operation is not valid for the object's storage class"))
    for status, code in ((503, "SlowDown"), (500, "InternalError"), (429, "TooManyRequests"), (400, "RequestTimeout")):
        assert is_transient(translated(status, code)), code
    assert is_transient(OSError(errno.EIO, "no answer")) and is_transient(ConnectionResetError())


def test_size(store):
    store.put("a/b.bin", b"12345")
    store.put("empty", b"")
    assert store.size("a/b.bin") == 5
    assert store.size("empty") == 0
    with pytest.raises(NotFound):
        store.size("missing")
    with pytest.raises(NotFound):
        store.size("a")  # a folder (or common prefix) is not an object


@pytest.mark.parametrize("remover", ["delete", "delete_prefix"])
def test_removal_never_breaks_a_concurrent_writer(tmp_path, remover):
    """Removing files must not pull the folder from under another writer of the same folder.

    One thread writes ``d/x-<i>`` and removes it (by key, or the whole ``d/``), the other writes
    and deletes ``d/y-<i>``. When removal tidied folders left empty, it could remove ``d``
    between a writer's ``mkdir`` and the open of its temp file: ``FileNotFoundError``.
    """
    store = open_store(str(tmp_path / "store"))
    errors = []
    stop = threading.Event()

    def churn(name, remove):
        try:
            for i in range(400):
                if stop.is_set():
                    return
                store.put(f"d/{name}-{i}", b"x")
                remove(name, i)
        except Exception as exc:  # collected and asserted on below; the thread must not die silently
            errors.append(exc)
            stop.set()

    def remove_x(name, i):
        if remover == "delete":
            store.delete(f"d/{name}-{i}")
        else:
            store.delete_prefix("d/")

    threads = [
        threading.Thread(target=churn, args=("x", remove_x)),
        threading.Thread(target=churn, args=("y", lambda name, i: store.delete(f"d/{name}-{i}"))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_delete_prefix_tidies_its_folders(tmp_path):
    store = open_store(str(tmp_path / "store"))
    store.put("policy/v000001/manifest.json", b"{}")
    store.put("policy/v000001/sub/shard-0000.safetensors", b"w")
    store.put("policy/v000002/manifest.json", b"{}")
    store.delete_prefix("policy/v000001/")
    assert store.list() == ["policy/v000002/manifest.json"]
    assert not (tmp_path / "store" / "policy" / "v000001").exists()
    assert (tmp_path / "store" / "policy" / "v000002").is_dir()


@pytest.mark.e2e
def test_unreachable_s3_store_fails_check(monkeypatch):
    from echo2.data.store import StoreError
    from echo2.data.store.fsspec_store import FsspecStore

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    store = FsspecStore("s3://nobucket/x", {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {
        "connect_timeout": 1, "retries": {"max_attempts": 1}}})
    with pytest.raises(StoreError, match="unreachable"):
        store.check()
