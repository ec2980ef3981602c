"""Shared pieces of the relay tests: signed test versions, relay nodes, a bare-socket test peer."""

from __future__ import annotations

import os
import socket
import threading
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.protocol import FetchPolicy
from echo2.broadcast.relay_node import RelayNode
from echo2.data.manifest import chunk_hashes, sign
from echo2.data.relay_tokens import RelayAuth, mint

KEY = Ed25519PrivateKey.from_private_bytes(b"k" * 32)  # the learner's signing key
PUBLIC = KEY.public_key()  # what actors verify with (run.json)
RUN_ID = "relay-test"
TOKEN = mint(KEY, RUN_ID, "a-test-actor", time.time() + 86400)  # an actor's own relay token


def auth() -> RelayAuth:
    """What a node of the test run accepts."""
    return RelayAuth(PUBLIC, RUN_ID)
CHUNK = 64 * 1024


def make_version(store, version=1, sizes=(300_000, 200_000, 5)):
    files = {f"shard-{i:04d}.safetensors": os.urandom(n) for i, n in enumerate(sizes)}
    entries = []
    for name, data in files.items():
        store.put(f"policy/v{version:06d}/{name}", data)
        entries.append({"name": name, "kind": "shard", "size": len(data), "chunks": chunk_hashes(data, CHUNK)})
    return sign({"version": version, "chunk_size": CHUNK, "files": entries}, KEY), files


def slow_store_reader(store, delay=0.02):
    def read(chunk, manifest):
        time.sleep(delay)  # a store slower than loopback, so pipelining shows in the timestamps
        key = f"policy/v{int(manifest['version']):06d}/{chunk.file}"
        return store.get_range(key, chunk.offset, chunk.offset + chunk.size)

    return read


def nodes(store, n, policy=None):
    """``n`` relay nodes reading the slow store; by default the window's 4 store reads at a time, no more for
    small chunks (``FetchPolicy.store_bytes_in_flight``), so that a root is still receiving while its children ask."""
    policy = policy or FetchPolicy(pipeline_wait_s=10, store_bytes_in_flight=0)
    return [RelayNode(TOKEN, auth(), slow_store_reader(store), policy=policy) for _ in range(n)]


def _bare_peer(handle):
    """A test peer on a bare loopback socket: every accepted connection goes to ``handle(conn, stop)`` in the
    accepting thread; returns (url, stop), where stop also ends ``handle``'s waits on the event."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    stop = threading.Event()

    def serve():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn = sock.accept()[0]
            except OSError:
                continue
            handle(conn, stop)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", lambda: (stop.set(), sock.close())


def _read_head(conn) -> None:
    head = b""
    while b"\r\n\r\n" not in head and (part := conn.recv(4096)):
        head += part


def raw_peer(answer: bytes | None):
    """A test peer on a bare socket: reads a request, sends ``answer`` and hangs up; with None it
    accepts connections and never answers (a stalled peer)."""
    conns = []

    def answer_once(conn, stop):
        if answer is None:
            conns.append(conn)  # held open, never answered
            return
        with conn:
            try:
                conn.settimeout(5)
                _read_head(conn)
                conn.sendall(answer)
            except OSError:
                pass

    url, stop = _bare_peer(answer_once)
    return url, lambda: (stop(), [c.close() for c in conns])


def trickling_peer(size: int, interval_s: float = 0.1):
    """A test peer on a bare socket that answers every request at once with a 200 announcing ``size``
    bytes, then sends the body one byte per ``interval_s`` (a peer that holds by trickling); returns
    (url, stop)."""
    def trickle(conn, stop):
        with conn:
            try:
                _read_head(conn)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
                for _ in range(size):
                    if stop.wait(interval_s):
                        return
                    conn.sendall(b"\x00")
            except OSError:  # the client hung up: what we want
                pass

    return _bare_peer(lambda conn, stop: threading.Thread(target=trickle, args=(conn, stop), daemon=True).start())


def env_of_a_launched_actor(store, key, tmp_path, names, **fleet_kwargs):
    """Start one actor through the real local fleet with a command that prints the environment variables
    ``names``; returns (its actor id, those variables, its log's text)."""
    import json
    import sys

    from echo2.config import LocalFleetConfig
    from echo2.fleet.make import make_fleet

    show = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {tuple(names)!r}}}))"
    fleet = make_fleet(LocalFleetConfig(actors=1), store, store_options={}, log_dir=tmp_path / "logs", run_key=key,
                       actor_command=[sys.executable, "-c", show], **fleet_kwargs)
    try:
        fleet.start()
        actor_id = fleet.slots[0].actor_id
        fleet.backend.procs[actor_id].wait(timeout=60)
        log_text = fleet.backend.logs[actor_id].read_text()
    finally:
        fleet.stop()
    return actor_id, json.loads(log_text.splitlines()[-1]), log_text


def poll_until(receiver, version, timeout=20.0):
    """Poll a ``PolicyReceiver`` until it hands over ``version``; returns its buffer."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (buf := receiver.poll()) is not None and buf.version == version:
            return buf
        time.sleep(0.02)
    raise AssertionError(f"v{version} never arrived")
