"""The relay: an HTTP server in every actor that serves the chunks it holds, and a fetcher that
fills a version chunk by chunk from its parent peer, falling back to the store.

Pipelining: a child asks its parent for chunk i as soon as it wants it; if the parent is still
receiving that chunk, the request waits until the parent has it verified, then gets it. So a
chain of peers moves a version in about one link's transfer time plus one chunk per hop.

A parent holds a request only for a chunk that may still come: one of the newest version it has
(still arriving), or of a version newer than everything it has (it may not have started it
yet), each for at most ``pipeline_wait_s``. A chunk it lacks of an older version (dropped,
abandoned for a newer one, or never fetched) or of a version whose fetch failed will not come:
that is a 404 at once, so the child moves on to its next source without waiting.

Falling back: any failure of a peer (refused, dead or stalled connection, a peer that dies
mid-chunk, a non-200 answer, a body of the wrong size, a chunk that fails its sha256, a rate
below ``min_rate_fraction``) leaves that peer for the rest of the version and moves on to the
next source; only a failure of the store fails the version. A child reads at most one chunk
(+1 byte, to see an excess) from a peer, whatever the peer announces or sends.

Timeouts, per chunk request to a peer: the answer (status and headers) must come within
``pipeline_wait_s`` + ``ANSWER_GRACE_S``, since an honest parent holds a request at most
``pipeline_wait_s`` and then answers 503; the body must then come within ``chunk_timeout`` of its
size (a read timeout scaled to the bytes expected), so a peer that trickles bytes is left within a
few seconds, not at the end of the hold. Every failure but a 404 (the honest "I will not have it")
is reported to the fetch's ``on_left`` (the receiver puts it in its peer record, ``topology.py``), so
a parent that holds every request costs its children one hold, not one per version.

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
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from aiohttp import ClientError, ClientResponse, ClientSession, ClientTimeout, web

from echo2.broadcast.relay_tls import RelayTLS, TLSListener
from echo2.data.manifest import Chunk, chunk_table
from echo2.data.relay_tokens import RelayAuth, TokenRefused

log = logging.getLogger("echo2.relay")


ANSWER_GRACE_S = 2.0
"""How much longer than the pipeline hold a child waits for a peer's answer (network and scheduling)."""


class SourceFailed(Exception):
    """A source (peer) was dead, slow, or served a chunk that failed verification."""


class NotThere(SourceFailed):
    """The peer answered 404: it will not have the chunk (superseded, abandoned, never fetched); an
    honest answer, given at once, so it is not reported against the peer."""


class Peer(NamedTuple):
    """A parent from the signed relay plan: where it says it listens, and who it must prove to be (TLS)."""

    url: str
    actor_id: str

    def __str__(self) -> str:
        return f"{self.actor_id} at {self.url}"


@dataclass
class VersionBuffer:
    """A version being received or held: verified chunks and when each arrived."""

    version: int
    manifest: dict
    chunks: list[Chunk]
    data: list[bytes | None] = field(default_factory=list)
    arrived_at: list[float | None] = field(default_factory=list)
    sources: list[str | None] = field(default_factory=list)
    events: list[asyncio.Event] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    failed: BaseException | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the fetch stopped short (failed or cancelled): missing chunks will not come."""

    def __post_init__(self) -> None:
        n = len(self.chunks)
        self.data = [None] * n
        self.arrived_at = [None] * n
        self.sources = [None] * n
        self.events = [asyncio.Event() for _ in range(n)]

    def put(self, index: int, data: bytes, source: str) -> None:
        chunk = self.chunks[index]
        if len(data) != chunk.size or hashlib.sha256(data).hexdigest() != chunk.sha256:
            raise SourceFailed(f"chunk {index} of v{self.version} from {source} does not match the manifest")
        self.data[index] = data
        self.arrived_at[index] = time.time()
        self.sources[index] = source
        self.events[index].set()
        if all(d is not None for d in self.data):
            self.done.set()

    def abandon(self, exc: BaseException) -> None:
        self.failed = exc
        self.ended.set()

    def files(self) -> dict[str, bytes]:
        """Whole files, once every chunk is in (already verified chunk by chunk)."""
        out: dict[str, list[bytes]] = {}
        for chunk, data in zip(self.chunks, self.data):
            assert data is not None
            out.setdefault(chunk.file, []).append(data)
        return {name: b"".join(parts) for name, parts in out.items()}


@dataclass
class FetchPolicy:
    expected_mbit: float = 200.0
    """Link rate a healthy parent should sustain."""
    min_rate_fraction: float = 0.2
    """A parent slower than this fraction of ``expected_mbit`` on a chunk is abandoned."""
    pipeline_wait_s: float = 30.0
    """How long a server holds a request for a chunk it is still receiving."""
    window: int = 4
    """Chunk requests in flight to the store. From a peer, chunks come one at a time: parallel
    transfers would share the parent's uplink and finish every chunk later, adding latency at
    every hop of the pipeline."""

    def chunk_timeout(self, size: int) -> float:
        return 2.0 + size * 8 / (self.expected_mbit * 1e6 * self.min_rate_fraction)


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
        if not self._authorized(request):
            return web.Response(status=401, text="missing, invalid or revoked relay token")
        try:
            version, index = int(request.match_info["version"]), int(request.match_info["index"])
        except ValueError:
            return web.Response(status=404, text="no such chunk")
        deadline = time.monotonic() + self.pipeline_wait_s
        while True:  # re-checked whenever a version is added or this chunk or its version ends
            buffer = self.buffers.get(version)
            if buffer is not None:
                if not 0 <= index < len(buffer.chunks):
                    return web.Response(status=404, text=f"version {version} has no chunk {index}")
                if buffer.data[index] is not None:
                    return web.Response(body=buffer.data[index], content_type="application/octet-stream")
            if any(v > version for v in self.buffers):
                # moved on to a newer version: what is missing of this one will not come
                return web.Response(status=404, text=f"version {version} is superseded here")
            if buffer is not None and buffer.failed is not None:
                return web.Response(status=404, text=f"receiving version {version} failed here")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if buffer is None:
                    return web.Response(status=404, text=f"version {version} not here")
                return web.Response(status=503, text=f"chunk {index} of version {version} not received yet")
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


class Fetcher:
    """Fills a ``VersionBuffer`` from an ordered list of sources: parent peer(s) first, the store last."""

    def __init__(self, token: str, store_read: Callable[[Chunk, dict], bytes], policy: FetchPolicy, *,
                 tls: RelayTLS | None = None, auth: RelayAuth | None = None):
        """``tls``: speak TLS to peers (only to ``Peer``s on https URLs, each checked to be its actor);
        ``auth``: whose revocations to honour when choosing parents."""
        self.token = token
        self.store_read = store_read  # blocking; runs in a worker thread
        self.policy = policy
        self.tls = tls
        self.auth = auth

    def _dialable(self, peer: str | Peer, version: int) -> bool:
        """Whether ``peer`` may be asked at all: a peer this node cannot verify, or a revoked one, is not."""
        url = peer.url if isinstance(peer, Peer) else peer
        why = None
        if self.tls is not None and not (isinstance(peer, Peer) and url.startswith("https://")):
            why = "this relay speaks TLS, and the peer is not an https:// peer of the relay plan"
        elif self.tls is None and not url.startswith("http://"):
            why = "this relay speaks plain HTTP (broadcast.tls)"
        elif isinstance(peer, Peer) and self.auth is not None and peer.actor_id in self.auth.revoked:
            why = f"{peer.actor_id} is revoked"
        if why is not None:
            log.warning("v%d: skipping %s: %s", version, peer, why)
        return why is None

    async def fetch(self, buffer: VersionBuffer, peers: list[str | Peer],
                    on_left: Callable[[Peer, int, str], None] | None = None) -> VersionBuffer:
        """Fill ``buffer``; ``on_left(peer, version, why)`` is called (on the relay's loop) for each peer of
        the plan left because it failed to deliver (not for a 404)."""
        try:
            return await self._fill(buffer, peers, on_left)
        except BaseException as exc:  # failed or cancelled: requests held for its chunks are answered now
            buffer.abandon(exc)
            raise

    async def _fill(self, buffer: VersionBuffer, peers: list[str | Peer],
                    on_left: Callable[[Peer, int, str], None] | None) -> VersionBuffer:
        sources = [p for p in peers if self._dialable(p, buffer.version)] + ["store"]
        dead: set[str] = set()
        queue: asyncio.Queue[int] = asyncio.Queue()
        for chunk in buffer.chunks:
            queue.put_nowait(chunk.index)
        gates = {s: asyncio.Semaphore(self.policy.window if s == "store" else 1) for s in sources}
        timeout = ClientTimeout(total=None, sock_connect=3)
        # raw bytes only: a peer's gzip must not turn a bounded read into an unbounded inflate
        async with ClientSession(timeout=timeout, headers={"Authorization": f"Bearer {self.token}"},
                                 auto_decompress=False) as session:

            async def worker() -> None:
                while True:
                    try:
                        index = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    while buffer.data[index] is None:
                        source = next(s for s in sources if s not in dead)
                        try:
                            async with gates[source]:
                                if source in dead:
                                    continue  # another worker gave up on it while we queued
                                data = await self._get(session, source, buffer, index)
                            buffer.put(index, data, str(source))
                        # ClientError: a peer that dies mid-chunk (ServerDisconnectedError, ClientPayloadError)
                        except (SourceFailed, OSError, asyncio.TimeoutError, ValueError, ClientError) as exc:
                            if source == "store":
                                raise
                            if source not in dead:
                                why = str(exc) or type(exc).__name__
                                log.warning("v%d: leaving %s for the next source: %s", buffer.version, source, why)
                                dead.add(source)
                                if on_left is not None and isinstance(source, Peer) and not isinstance(exc, NotThere):
                                    on_left(source, buffer.version, why)

            await asyncio.gather(*(worker() for _ in range(self.policy.window)))
        return buffer

    async def _get(self, session: ClientSession, source: str | Peer, buffer: VersionBuffer, index: int) -> bytes:
        chunk = buffer.chunks[index]
        if source == "store":
            return await asyncio.to_thread(self.store_read, chunk, buffer.manifest)
        base = source.url if isinstance(source, Peer) else source
        url = f"{base}/v1/versions/{buffer.version}/chunks/{index}"
        tls = {} if self.tls is None else {  # the certificate must name the plan's peer, whatever the address
            "ssl": self.tls.client_context, "server_hostname": RelayTLS.server_hostname(source.actor_id)}
        # the parent may legitimately hold the request while it receives the chunk itself (pipelining), for at
        # most pipeline_wait_s; once it answers, the body has the time a chunk of its size takes at the lowest
        # acceptable rate, so a peer that trickles bytes is left as soon as it falls below that rate
        answer_s = self.policy.pipeline_wait_s + ANSWER_GRACE_S
        body_s = self.policy.chunk_timeout(chunk.size)
        answered = False
        try:
            async with asyncio.timeout(answer_s) as deadline:
                async with session.get(url, **tls) as resp:
                    answered = True
                    deadline.reschedule(asyncio.get_running_loop().time() + body_s)
                    if resp.status == 404:
                        raise NotThere(f"{url} answered 404")
                    if resp.status != 200:
                        raise SourceFailed(f"{url} answered {resp.status}")
                    if resp.content_length is not None and resp.content_length != chunk.size:
                        raise SourceFailed(f"{url} announces {resp.content_length} bytes for a chunk of {chunk.size}")
                    data = await _read_at_most(resp, chunk.size + 1)
                    if len(data) != chunk.size:  # raised in here, the connection is dropped with the rest unread
                        sent = f"more than {chunk.size}" if len(data) > chunk.size else str(len(data))
                        raise SourceFailed(f"{url} sent {sent} bytes for a chunk of {chunk.size}")
        except TimeoutError:
            if not answered:
                raise SourceFailed(f"{source} held chunk {index} for {answer_s:.1f} s without answering") from None
            raise SourceFailed(f"{source} sent chunk {index} below {self.policy.min_rate_fraction:g} of "
                               f"{self.policy.expected_mbit:g} Mbit/s (not within {body_s:.1f} s)") from None
        return data


async def _read_at_most(resp: ClientResponse, limit: int) -> bytes:
    """The body up to ``limit`` bytes: never more, whatever the peer sends or announces."""
    data = bytearray()
    while len(data) < limit:
        block = await resp.content.read(limit - len(data))
        if not block:  # end of the body
            break
        data += block
    return bytes(data)


def new_buffer(manifest: dict) -> VersionBuffer:
    return VersionBuffer(int(manifest["version"]), manifest, chunk_table(manifest))


class RelayNode:
    """A relay server and fetcher on a private event loop in a daemon thread."""

    def __init__(self, token: str, auth: RelayAuth, store_read: Callable[[Chunk, dict], bytes], *,
                 host: str = "127.0.0.1", port: int = 0, policy: FetchPolicy | None = None,
                 server_cls: type[RelayServer] = RelayServer, tls: RelayTLS | None = None):
        """``token``: this node's own (what it sends to its parents); ``auth``: what it accepts;
        ``tls``: this node's certificate and the run's CA (mutual TLS both ways), None for plain HTTP."""
        self.policy = policy or FetchPolicy()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="echo2-relay", daemon=True)
        self.thread.start()
        self.server = server_cls(auth, host=host, port=port, tls=tls)
        self.server.pipeline_wait_s = self.policy.pipeline_wait_s
        self.fetcher = Fetcher(token, store_read, self.policy, tls=tls, auth=auth)
        self._call(self.server.start())

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return self.server.url

    def start_fetch(self, manifest: dict, peers: list[str | Peer],
                    on_left: Callable[[Peer, int, str], None] | None = None):
        """Begin receiving a version in the background; returns a concurrent future of its buffer.
        ``on_left``: told of each peer left because it failed to deliver (``Fetcher.fetch``)."""

        async def run() -> VersionBuffer:
            buffer = new_buffer(manifest)
            self.server.add(buffer)
            return await self.fetcher.fetch(buffer, peers, on_left)

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
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
