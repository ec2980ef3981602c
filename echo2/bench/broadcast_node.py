"""One node of the broadcast benchmark, run as its own process (inside a network namespace when
shaped). ``origin`` serves the payload over HTTP like an object store; ``receiver`` runs the real
relay code: a ``RelayNode`` that fetches chunks from its sources (peers, then the store) and
serves what it has verified to its children; given ``--base``, it then applies the sparse delta
it received to that base and checks every rebuilt tensor against the manifest's signed table.

A receiver that is a root (no sources) reads the origin through ``store_stream``: one ranged GET per run of
chunks, read a chunk at a time, as an object store streams it (``Fetcher``); single chunks through fsspec's
``cat_file`` where that fails.

With ``--rtt-ms`` the server listens on loopback and a ``wan.DelayForwarder`` on the node's address
stands in front of it (``wan.py``): whoever asks this node pays the round trip.

Protocol with the coordinator (stdin/stdout, one JSON object per line):
    node -> {"ready": url}         server is listening
    coord -> {"sources": [...]}    start fetching (receivers only)
    node -> {"half": t}            with --say-half: half the version's chunks are in (the churn's cue)
    node -> {"done": t, ...}       whole version in, every chunk verified (receivers only)
    coord -> {"verify": true}      once every receiver is done
    node -> {"verified": bool}     the whole files hash to the manifest's sha256 too
    coord -> {"rebuild": true}     with --base, once every receiver is done: apply the delta
    node -> {"rebuilt": bool}      every rebuilt tensor matched the signed table
    coord -> closes stdin          exit
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
import urllib.request
from pathlib import Path

import fsspec
from aiohttp import web

from echo2.bench.wan import DelayForwarder
from echo2.broadcast.protocol import FetchPolicy, Peer
from echo2.broadcast.relay_node import RelayNode
from echo2.broadcast.relay_tls import RelayTLS
from echo2.data.relay_certs import ActorCertificate
from echo2.data.relay_tokens import RelayAuth
from echo2.data.run_key import public_key_of


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _behind(host: str, port: int, rtt_ms: float) -> tuple[str, int]:
    """Where the server itself listens: the node's address, or loopback behind a delaying forwarder."""
    return ("127.0.0.1", 0) if rtt_ms > 0 else (host, port)


def _front(host: str, port: int, served_port: int, rtt_ms: float) -> int:
    """The port children dial: the server's own, or a forwarder's adding ``rtt_ms`` per round trip."""
    if rtt_ms <= 0:
        return served_port
    return DelayForwarder(host, port, "127.0.0.1", served_port, rtt_ms / 2000).start()


def run_origin(root: Path, host: str, port: int, rtt_ms: float = 0.0) -> None:
    async def main() -> None:
        app = web.Application()
        app.router.add_static("/", root)  # FileResponse answers Range requests, as object stores do
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, *_behind(host, port, rtt_ms))
        await site.start()
        _say({"ready": f"http://{host}:{_front(host, port, site._server.sockets[0].getsockname()[1], rtt_ms)}"})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the coordinator closes
        await runner.cleanup()

    asyncio.run(main())


def run_receiver(manifest_path: Path, origin: str, auth: dict, host: str, port: int, policy: FetchPolicy,
                 base: Path | None = None, rtt_ms: float = 0.0, say_half: bool = False) -> None:
    manifest = json.loads(manifest_path.read_text())
    http = fsspec.filesystem("http")

    def store_read(chunk, manifest):
        return http.cat_file(f"{origin}/{chunk.file}", start=chunk.offset, end=chunk.offset + chunk.size)

    def store_stream(chunks, manifest):  # one ranged GET, read a chunk at a time, as an object store streams it
        first, last = chunks[0], chunks[-1]
        request = urllib.request.Request(f"{origin}/{first.file}",
                                         headers={"Range": f"bytes={first.offset}-{last.offset + last.size - 1}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            for chunk in chunks:
                yield answer.read(chunk.size)

    public = public_key_of({"public_key": auth["public_key"], "run_id": auth["run_id"]})
    tls = RelayTLS(ActorCertificate(auth["tls"]["bundle"]), auth["tls"]["ca"]) if "tls" in auth else None
    listen_host, listen_port = _behind(host, port, rtt_ms)
    node = RelayNode(auth["token"], RelayAuth(public, auth["run_id"]), store_read, host=listen_host, port=listen_port,
                     policy=policy, tls=tls, store_stream=store_stream)
    _say({"ready": f"{node.url.split('://')[0]}://{host}:{_front(host, port, node.server.port, rtt_ms)}"})
    command = json.loads(sys.stdin.readline())
    # over TLS every receiver is the one bench actor: each parent must prove it is that actor
    sources = [Peer(url, auth["tls"]["actor"]) for url in command["sources"]] if tls else command["sources"]
    started = time.time()
    future = node.start_fetch(manifest, sources)
    if say_half:
        _say_half(node, int(manifest["version"]), future)
    buffer = future.result()
    done = time.time()
    _say({"done": done, "started": started, "first_chunk": min(buffer.arrived_at),
          "from_store": sum(s == "store" for s in buffer.sources), "chunks": len(buffer.chunks)})
    # told once every receiver is done (a whole version hashed again here would take CPU from transfers still
    # going on, on the same cores): the whole-file check on top of the per-chunk checks
    json.loads(sys.stdin.readline())
    verified = True
    for entry in manifest["files"]:
        digest = hashlib.sha256()
        for chunk, data in zip(buffer.chunks, buffer.data):
            if chunk.file == entry["name"]:
                digest.update(data)
        verified &= digest.hexdigest() == entry["sha256"]
    _say({"verified": verified})
    if base is not None:  # told once every receiver is done, so that no rebuild slows a transfer still going on
        json.loads(sys.stdin.readline())
        _say({"rebuilt": _rebuilds(base, manifest, buffer.files())})
    sys.stdin.read()  # keep serving children until the coordinator closes stdin
    node.close()


def _say_half(node: RelayNode, version: int, future) -> None:
    """Tell the coordinator once half the version's chunks are verified here (or the fetch ended)."""
    while not future.done():
        buffer = node.server.buffers.get(version)
        if buffer is not None and 2 * sum(d is not None for d in buffer.data) >= len(buffer.data):
            break
        time.sleep(0.02)
    _say({"half": time.time()})


def _rebuilds(base: Path, manifest: dict, files: dict[str, bytes]) -> bool:
    """Whether the sparse delta received applies to ``base`` and every rebuilt tensor hashes to the signed table."""
    from safetensors.torch import load as st_load

    from echo2.data.delta import DeltaRejected
    from echo2.data.delta_chain import apply_version

    tensors = st_load(base.read_bytes())
    try:
        apply_version(tensors, manifest, files)
    except DeltaRejected:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["origin", "receiver"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--root", type=Path)
    parser.add_argument("--manifest", type=Path)
    parser.add_argument("--origin")
    parser.add_argument("--token-file", type=Path)
    parser.add_argument("--expected-mbit", type=float, default=200.0)
    parser.add_argument("--base", type=Path,
                        help="a delta's base version (safetensors): rebuild and check after receiving")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="round trip a delaying forwarder adds (wan.py)")
    parser.add_argument("--say-half", action="store_true", help="say when half the version is in")
    args = parser.parse_args()
    if args.role == "origin":
        run_origin(args.root, args.host, args.port, args.rtt_ms)
    else:
        policy = FetchPolicy(expected_mbit=args.expected_mbit, min_rate_fraction=0.05, pipeline_wait_s=60)
        run_receiver(args.manifest, args.origin, json.loads(args.token_file.read_text()), args.host, args.port, policy,
                     base=args.base, rtt_ms=args.rtt_ms, say_half=args.say_half)


if __name__ == "__main__":
    main()
