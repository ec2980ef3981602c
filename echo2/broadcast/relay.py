"""The relay: an HTTP server in every actor that serves the chunks it holds, and a fetcher that
fills a version from its parent peer, falling back to its ancestors and then the store (``fetcher.py``).

Runs of chunks, pipelined: a child asks its parent once for every chunk it still lacks
(``GET /v1/versions/<v>/chunks/<first>?run=<k>``), and the parent streams them in order, each as soon
as it has it verified: one round trip per run, not per chunk, and a parent still receiving the
version sends each chunk the moment it lands, so a chain of peers moves a version in about one
link's transfer time plus one chunk and one one-way delay per hop. In the stream each chunk is one
tag byte and then the chunk's bytes (its size is the manifest's): ``TAG_CHUNK``, or, ending the
run, ``TAG_NOT_THERE`` (it will not come here: the honest 404) or ``TAG_NOT_YET`` (held
``pipeline_wait_s`` and not arrived: the 503). Without ``run`` a request gets one chunk, as before.

Why a streamed run, chosen by measurement (``docs/broadcast.md``, "Keeping long links busy", has the
dated numbers): a chain of 3 and 5 hops from a seeded root, every hop behind a delaying, rate-shaping
TCP forwarder on loopback (``tests/test_relay_wan.py``: 50-100 Mbit/s uplinks, 80 and 200 ms round
trips, 256 KB to 2 MB chunks), timed until every node had the version, for one request at a time (as
before), 2 and 4 requests in flight, and one streamed run. One request at a time leaves every link idle
one round trip per chunk; k requests in flight cover the bandwidth-delay product only where the chunks
are small enough that k of them sharing the parent's uplink do not delay each one k-fold (with 1-2 MB
chunks 4 in flight was slower than one at a time); the streamed run was the fastest in every case, at
the chain's bound on the 5-hop one: the chunks go back to back on one connection whatever their size,
so TCP's window, not the protocol, covers the bandwidth-delay product, and each chunk still goes out
whole as soon as it is verified.

A parent holds a request only for a chunk that may still come: one of the newest version it has
(still arriving), or of a version newer than everything it has (it may not have started it
yet), each for at most ``pipeline_wait_s``. A chunk it lacks of an older version (dropped,
abandoned for a newer one, or never fetched) or of a version whose fetch failed will not come:
that is a 404 (or ``TAG_NOT_THERE`` in a run) at once, so the child moves on without waiting.

Falling back: any failure of a peer (refused or reset connection, a dead or stalled one, a peer
that dies mid-chunk, a non-200 answer, a junk tag, a chunk of the wrong size or that fails its
sha256, a rate below what it is held to) leaves that peer for the rest of the version, and the
next source streams what is still missing; only a failure of the store fails the version. A peer
that dies (refused, reset, closed) is left the moment the connection says so, not at a timeout,
so its children go on from their next source at once. A child reads at most the run's chunks from
a peer, whatever the peer announces or sends.

Timeouts, per chunk of a run: its tag (and, for the first, the answer) must come within
``pipeline_wait_s`` + ``ANSWER_GRACE_S``, since an honest parent holds a chunk at most
``pipeline_wait_s``; its bytes must then come within ``chunk_timeout`` at the rate the parent is
held to (``rates.min_rate_mbit``: a fraction of the lesser of its measured rate and what the child
needs, never below ``floor_mbit``), so a peer that trickles bytes is left within seconds. Every
failure but a 404 (the honest "I will not have it") is reported to the fetch's ``on_left`` (the
receiver puts it in its peer record, ``topology.py``), so a parent that holds every request costs
its children one hold, not one per version. Every node measures its upload and download rates on
these transfers (``rates.py``), and the receiver reports them in its peer record.

Safety: a chunk enters a node's buffer only after its sha256 matched the signed manifest, so a
bad chunk is never served on and never loaded. Requests need ``Authorization: Bearer <token>``:
an actor's own token, signed by the learner and checked with the run's public key
(``data/relay_tokens.py``); a refusal is a 401, logged with its reason but never the token.

Across hosts the relay speaks mutual TLS with certificates of the run's CA (``relay_tls.py``): a
client must present an actor's certificate, the token must name the same actor, a revoked actor is
refused by certificate as by token, and a client checks that the server is the peer the signed plan
names (``Peer``). A fetch also skips a parent that the newest signed manifest revoked.

Everything runs on one asyncio loop in a background thread (``RelayNode``), so an actor keeps
relaying to its children while it generates.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Iterator

from aiohttp import web

from echo2.broadcast.fetcher import Fetcher
from echo2.broadcast.protocol import (
    TAG_CHUNK,
    TAG_NOT_THERE,
    TAG_NOT_YET,
    FetchPolicy,
    Peer,
    VersionBuffer,
)
from echo2.broadcast.rates import UploadMeter
from echo2.broadcast.relay_tls import RelayTLS, TLSListener
from echo2.data.manifest import Chunk, chunk_table
from echo2.data.relay_tokens import RelayAuth, TokenRefused

log = logging.getLogger("echo2.relay")


class RelayServer:
    def __init__(self, auth: RelayAuth, *, host: str = "127.0.0.1", port: int = 0, keep_versions: int = 2,
                 tls: RelayTLS | None = None):
        self.auth = auth
        self.tls = tls
        self.refusals = 0
        """Requests refused for their token or certificate (the chaos suite counts them)."""
        self.handshake_refusals = 0
        """Connections refused in the TLS handshake (no or a foreign certificate, plain HTTP)."""
        self._listener: TLSListener | None = None
        self._refusals_logged: set[tuple] = set()
        self.host = host
        self.port = port
        self.keep_versions = keep_versions
        self.buffers: dict[int, VersionBuffer] = {}
        self._version_added: asyncio.Event | None = None
        self.pipeline_wait_s = 30.0
        self.upload = UploadMeter()
        """What this node's uploads achieved (``rates.py``)."""
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        self._version_added = asyncio.Event()
        app = web.Application()
        app.router.add_get("/v1/health", self._health)
        app.router.add_get("/v1/versions/{version}/chunks/{index}", self._chunk)
        # held (pipelined) requests must not keep a stopping relay alive for long
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        if self.tls is not None:
            self._listener = TLSListener(self._runner.server, self.tls.server_context, self._refused_handshake)
            self.port = await self._listener.start(self.host, self.port)
            return
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._listener is not None:
            await self._listener.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    def add(self, buffer: VersionBuffer) -> None:
        self.buffers[buffer.version] = buffer
        for v in sorted(self.buffers)[: -self.keep_versions]:
            del self.buffers[v]
        assert self._version_added is not None
        self._version_added.set()
        self._version_added = asyncio.Event()

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        try:
            certified = None
            if self.tls is not None:  # the handshake verified the chain; who it names, and whether they still count
                certified = RelayTLS.client_actor(request.transport)
                if certified is None:
                    raise TokenRefused("the client certificate names no actor")
                if certified in self.auth.revoked:
                    raise TokenRefused(f"the certificate of {certified} is revoked")
            if not header.startswith("Bearer "):
                raise TokenRefused("no bearer token")
            actor = self.auth.actor_of(header[7:])
            if certified is not None and actor != certified:
                raise TokenRefused(f"a token of {actor} over the certificate of {certified}")
            return True
        except TokenRefused as exc:  # the reason names the actor, never the token
            self.refusals += 1
            self._log_refusal(request.remote, f"a request for {request.path}", str(exc))
            return False

    def _refused_handshake(self, remote: str, reason: str) -> None:
        self.handshake_refusals += 1
        self._log_refusal(remote, "a TLS connection", reason)

    def _log_refusal(self, remote: str | None, what: str, reason: str) -> None:
        if (remote, reason) not in self._refusals_logged:  # once each: a flood must not flood the log
            if len(self._refusals_logged) >= 4096:  # bounded, as RelayAuth's cache is
                self._refusals_logged.clear()
            self._refusals_logged.add((remote, reason))
            log.warning("relay refused %s from %s: %s", what, remote, reason)

    async def _health(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.Response(status=401, text="missing, invalid or revoked relay token")
        return web.json_response({"versions": sorted(self.buffers)})

    async def _chunk(self, request: web.Request) -> web.StreamResponse:
        """One chunk, or with ``?run=k`` a stream of chunks ``index`` .. ``index + k - 1`` (module docstring)."""
        if not self._authorized(request):
            return web.Response(status=401, text="missing, invalid or revoked relay token")
        try:
            version, index = int(request.match_info["version"]), int(request.match_info["index"])
            run = int(request.query["run"]) if "run" in request.query else None
        except ValueError:
            return web.Response(status=404, text="no such chunk")
        status, found = await self._wait_for(version, index)
        if status != 200:
            return web.Response(status=status, text=found)
        buffer = self.buffers[version]
        if run is None:
            return web.Response(body=self._data(buffer, index), content_type="application/octet-stream")
        last = min(len(buffer.chunks), index + max(1, run)) - 1
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await resp.prepare(request)
        key = id(resp)
        self.upload.open(key, request.transport)
        try:
            for j in range(index, last + 1):
                if j > index:
                    status, found = await self._wait_for(version, j)
                    if status == 200 and self.buffers.get(version) is not buffer:
                        status = 404  # the number was received again meanwhile (a resumed learner): not this run's
                if status != 200:  # the honest end of a run: why, in one byte
                    await resp.write(TAG_NOT_THERE if status == 404 else TAG_NOT_YET)
                    break
                data = self._data(buffer, j)
                self.upload.writing(key, len(data) + 1)
                await resp.write(TAG_CHUNK)
                await resp.write(data)  # as soon as it is verified: the pipeline
            await resp.write_eof()
        except ConnectionError:  # the child left mid-run (killed, moved on: reset, or "Connection lost"): no answer
            log.debug("child left a run of v%d from chunk %d", version, index)
        finally:
            self.upload.close(key)
        return resp

    def _data(self, buffer: VersionBuffer, index: int) -> bytes:
        """What is served of a chunk that is here (a test's hostile server changes it)."""
        data = buffer.data[index]
        assert data is not None
        return data

    async def _wait_for(self, version: int, index: int) -> tuple[int, str]:
        """(200, "") once chunk ``index`` of ``version`` is here; (404, why) if it will not come; (503, why)
        after holding the request ``pipeline_wait_s``."""
        deadline = time.monotonic() + self.pipeline_wait_s
        while True:  # re-checked whenever a version is added or this chunk or its version ends
            buffer = self.buffers.get(version)
            if buffer is not None:
                if not 0 <= index < len(buffer.chunks):
                    return 404, f"version {version} has no chunk {index}"
                if buffer.data[index] is not None:
                    return 200, ""
            if any(v > version for v in self.buffers):
                # moved on to a newer version: what is missing of this one will not come
                return 404, f"version {version} is superseded here"
            if buffer is not None and buffer.failed is not None:
                return 404, f"receiving version {version} failed here"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if buffer is None:
                    return 404, f"version {version} not here"
                return 503, f"chunk {index} of version {version} not received yet"
            await self._until_changed(buffer, index, remaining)

    async def _until_changed(self, buffer: VersionBuffer | None, index: int, timeout: float) -> None:
        """Wait for a new version, or for this chunk to arrive or its version to end (or the timeout)."""
        assert self._version_added is not None
        events = [self._version_added] + ([buffer.events[index], buffer.ended] if buffer is not None else [])
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()


def new_buffer(manifest: dict) -> VersionBuffer:
    return VersionBuffer(int(manifest["version"]), manifest, chunk_table(manifest))


class RelayNode:
    """A relay server and fetcher on a private event loop in a daemon thread."""

    def __init__(self, token: str, auth: RelayAuth, store_read: Callable[[Chunk, dict], bytes], *,
                 host: str = "127.0.0.1", port: int = 0, policy: FetchPolicy | None = None,
                 server_cls: type[RelayServer] = RelayServer, tls: RelayTLS | None = None,
                 store_stream: Callable[[list[Chunk], dict], Iterator[bytes]] | None = None):
        """``token``: this node's own (what it sends to its parents); ``auth``: what it accepts;
        ``tls``: this node's certificate and the run's CA (mutual TLS both ways), None for plain HTTP;
        ``store_stream``: a streamed ranged read of the store, where it has one (``Fetcher``)."""
        self.policy = policy or FetchPolicy()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="echo2-relay", daemon=True)
        self.thread.start()
        self.server = server_cls(auth, host=host, port=port, tls=tls)
        self.server.pipeline_wait_s = self.policy.pipeline_wait_s

        self.fetcher = Fetcher(token, store_read, self.policy, tls=tls, auth=auth, store_stream=store_stream)
        self._call(self.server.start())

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def rates(self) -> tuple[float | None, float | None]:
        """(up, down) Mbit/s this node measured on its real transfers (``rates.py``); None where too little
        moved yet."""
        return self.server.upload.meter.mbit, self.fetcher.download.mbit

    def start_fetch(self, manifest: dict, peers: list[str | Peer],
                    on_left: Callable[[Peer, int, str], None] | None = None, need_mbit: float | None = None):
        """Begin receiving a version in the background; returns a concurrent future of its buffer.
        ``on_left``: told of each peer left because it failed to deliver; ``need_mbit``: the rate this node
        needs the version at (``Fetcher.fetch``)."""

        async def run() -> VersionBuffer:
            buffer = new_buffer(manifest)
            self.server.add(buffer)
            return await self.fetcher.fetch(buffer, peers, on_left, need_mbit)

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def seed(self, manifest: dict, files: dict[str, bytes]) -> None:
        """Hold a whole version already in hand (the benchmark's origin, or a learner that relays)."""

        async def run() -> None:
            buffer = new_buffer(manifest)
            for chunk in buffer.chunks:
                buffer.put(chunk.index, files[chunk.file][chunk.offset : chunk.offset + chunk.size], "seed")
            self.server.add(buffer)

        self._call(run())

    def close(self) -> None:
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:  # fetches and held requests end here, not in a garbage-collected loop
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.server.stop()

        try:
            self._call(shutdown(), timeout=10)
        finally:
            self.fetcher.close()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
