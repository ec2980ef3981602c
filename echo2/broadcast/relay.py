"""The relay: an HTTP server in every actor that serves the chunks it holds, and a fetcher that
fills a version from its parent peer, falling back to its ancestors and then the store (``fetcher.py``).

Runs of chunks, pipelined: a child asks its parent once for every chunk it still lacks
(``GET /v1/versions/<v>/chunks/<first>?run=<k>``), and the parent streams them in order, each as soon
as it has it verified: one round trip per run, not per chunk, and a parent still receiving the
version sends each chunk the moment it lands, so a chain of peers moves a version in about one
link's transfer time plus one chunk and one one-way delay per hop. In the stream each chunk is one
tag byte and then the chunk's bytes (its size is the manifest's): ``TAG_CHUNK``, or, ending the
run, ``TAG_NOT_THERE`` (it will not come here: the honest 404) or ``TAG_NOT_YET`` (held
``pipeline_wait_s`` and not arrived: the 503). Before it holds for a chunk it does not have yet, the
parent says so: ``TAG_HOLD`` and how many of the version's chunks it holds (its progress), so that a
child can tell a hold while the parent's own copy fills from a parent that sits on what it has. Without
``run`` a request gets one chunk, as before.

Why a streamed run, chosen by measurement (``docs/runs/2026-12-03-broadcast-wan.md``, "Keeping long links busy", has
the dated numbers): a chain of 3 and 5 hops from a seeded root, every hop behind a delaying, rate-shaping
TCP forwarder on loopback (``tests/unit/broadcast/test_relay_wan.py``: 50-100 Mbit/s uplinks, 80 and 200 ms round
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

Timeouts, over the whole run (``rates.RunBudget``; per chunk, a parent could hold each chunk until
just before its deadline, for ever): the first answer (a chunk or a hold notice) within
``answer_grace_s``, then every byte by the time the run's bytes take at the rate the parent is held to
(``rates.min_rate_mbit``: a fraction of the lesser of its measured rate and what the child needs, never
below ``floor_mbit``), one slack, and the holds it declared while its own copy filled at the floor rate
at least (after waiting at most ``pipeline_wait_s`` for it to start); so a peer that trickles bytes or
sits on chunks is left within seconds, and one that lies about its holds costs at most the version at the
floor rate. Every failure but a 404 (the honest "I will not have it") is reported to the fetch's
``on_left`` (the receiver puts it in its peer record, ``topology.py``), and so is a parent that kept every
run's pace yet delivered the version at under ``version_need_fraction`` of what the child needs: a parent
that holds every request costs its children one hold, not one per version. Every node measures its upload
and download rates on these transfers (``rates.py``), and the receiver reports them in its peer record.

A child that does not read: every write of a run (a chunk, a notice) has a deadline, the chunk's size at
``floor_mbit`` plus ``chunk_slack_s``, and a child that misses it has its connection reset; a request never
holds a version (it looks the buffer up at each chunk, and a version ``keep_versions`` drops is released),
so such a child pins no version in memory; an actor may have ``MAX_STREAMS_PER_PEER`` requests open at a
relay, and a relay ``MAX_STREAMS`` in all; and a relay the version's signed plan names streams it only to
the actors the plan sends to it (children and their descendants falling back, and a joiner the guest rule,
``topology.guest_sources``, sends there): 403 to anyone else.

Safety: a chunk enters a node's buffer only after its sha256 matched the signed manifest, so a
bad chunk is never served on and never loaded. Requests need ``Authorization: Bearer <token>``:
an actor's own token, signed by the learner and checked with the run's public key
(``data/relay_tokens.py``); a refusal is a 401, logged with its reason but never the token.

Across hosts the relay speaks mutual TLS with certificates of the run's CA (``relay_tls.py``): a
client must present an actor's certificate, the token must name the same actor, a revoked actor is
refused by certificate as by token, and a client checks that the server is the peer the signed plan
names (``Peer``). A fetch also skips a parent that the newest signed manifest revoked.

Everything runs on one asyncio loop in a background thread (``RelayNode``, ``relay_node.py``), so an actor keeps
relaying to its children while it generates.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
import time
import weakref

from aiohttp import web

from echo2.broadcast import topology
from echo2.broadcast.protocol import (
    HOLD_BYTES,
    TAG_CHUNK,
    TAG_HOLD,
    TAG_NOT_THERE,
    TAG_NOT_YET,
    FetchPolicy,
    VersionBuffer,
)
from echo2.broadcast.rates import UploadMeter
from echo2.broadcast.relay_tls import RelayTLS, TLSListener
from echo2.data.relay_tokens import RelayAuth, TokenRefused

log = logging.getLogger("echo2.relay")


class _Stalled(Exception):
    """A child did not take a write within its deadline (it stopped reading)."""


class RelayServer:
    MAX_STREAMS_PER_PEER = 4
    """Requests one actor may have open at this relay at once (a child has one per version it fetches, and a
    cancelled one may linger until its hold ends); more are refused (503)."""
    MAX_STREAMS = 64
    """Requests open at this relay at once, all actors together; more are refused (503)."""

    def __init__(self, auth: RelayAuth, *, host: str = "127.0.0.1", port: int = 0, keep_versions: int = 2,
                 tls: RelayTLS | None = None, policy: FetchPolicy | None = None, me: str | None = None):
        """``policy``: the floor and slack a child's reads are held to (``FetchPolicy.chunk_timeout``) and the hold;
        ``me``: this relay's own actor, whose place in each version's plan says whom it serves (None: anyone
        with a valid token, as for a relay outside any plan)."""
        self.auth = auth
        self.tls = tls
        self.policy = policy or FetchPolicy()
        self.me = me
        self.refusals = 0
        """Requests refused for their token or certificate (the chaos suite counts them)."""
        self.handshake_refusals = 0
        """Connections refused in the TLS handshake (no or a foreign certificate, plain HTTP)."""
        self.refused_streams = 0
        """Requests refused for who asked (not a child, descendant or guest of this relay in the version's plan)
        or for the stream limits (``MAX_STREAMS_PER_PEER``, ``MAX_STREAMS``)."""
        self.stalled_streams = 0
        """Streams cut because the child did not read a chunk within its write deadline."""
        self._streams: collections.Counter[str] = collections.Counter()
        self._listener: TLSListener | None = None
        self._refusals_logged: set[tuple] = set()
        self.host = host
        self.port = port
        self.keep_versions = keep_versions
        self.buffers: dict[int, VersionBuffer] = {}
        self._version_added: asyncio.Event | None = None
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
        """Serve ``buffer``; a version ``keep_versions`` drops is released if its fetch is over (one still
        running is its fetch's, and ends with it), so no request still answering it holds its bytes."""
        self.buffers[buffer.version] = buffer
        for v in sorted(self.buffers)[: -self.keep_versions]:
            dropped = self.buffers.pop(v)
            if dropped is not buffer and (dropped.done.is_set() or dropped.ended.is_set()):
                dropped.release()
        assert self._version_added is not None
        self._version_added.set()
        self._version_added = asyncio.Event()

    def _authorized(self, request: web.Request) -> str | None:
        """The actor a request speaks for, or None (refused, logged)."""
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
            return actor
        except TokenRefused as exc:  # the reason names the actor, never the token
            self.refusals += 1
            self._log_refusal(request.remote, f"a request for {request.path}", str(exc))
            return None

    def _refused_handshake(self, remote: str, reason: str) -> None:
        self.handshake_refusals += 1
        self._log_refusal(remote, "a TLS connection", reason)

    def _log_refusal(self, remote: str | None, what: str, reason: str) -> None:
        self._warn_once((remote, reason), f"relay refused {what} from {remote}: {reason}")

    def _warn_once(self, key: tuple, message: str) -> None:
        if key not in self._refusals_logged:  # once each: a flood must not flood the log
            if len(self._refusals_logged) >= 4096:  # bounded, as RelayAuth's cache is
                self._refusals_logged.clear()
            self._refusals_logged.add(key)
            log.warning("%s", message)

    async def _health(self, request: web.Request) -> web.Response:
        if self._authorized(request) is None:
            return web.Response(status=401, text="missing, invalid or revoked relay token")
        return web.json_response({"versions": sorted(self.buffers)})

    def may_serve(self, manifest: dict, actor: str) -> bool:
        """Whether ``actor`` may fetch ``manifest``'s version from this relay: the version's signed plan names
        this relay among its sources (its parent, or an ancestor it falls back to), or, not in the plan, the
        guest rule sends it here (``topology.guest_sources``, for any site of the plan). A relay the plan does not
        name (it joined after the plan was signed, so nobody is sent to it by this plan; or a relay outside any
        run's plan: the benchmark), or one that does not know who it is, serves every valid token: what a child
        that never reads can cost it is bounded by the stream limits and the write deadline alone."""
        relay = manifest.get("relay")
        peers = relay.get("peers") if isinstance(relay, dict) else None
        if self.me is None or not isinstance(peers, list) or not any(
                isinstance(p, dict) and p.get("id") == self.me for p in peers):
            return True
        if any(peer == self.me for _, peer in topology.source_peers(relay, actor)):
            return True
        sites = {p.get("site", "") for p in peers if isinstance(p, dict)} if "site_roots" in relay else {None}
        return any(peer == self.me for site in sites for _, peer in topology.guest_sources(relay, actor, site))

    def streams_of(self, actor: str) -> int:
        """Requests of ``actor`` this relay is answering now."""
        return self._streams.get(actor, 0)

    def _refuse(self, status: int, actor: str, why: str) -> web.Response:
        self.refused_streams += 1
        self._log_refusal(actor, "a stream", why)
        return web.Response(status=status, text=why)

    async def _chunk(self, request: web.Request) -> web.StreamResponse:
        """One chunk, or with ``?run=k`` a stream of chunks ``index`` .. ``index + k - 1`` (module docstring)."""
        actor = self._authorized(request)
        if actor is None:
            return web.Response(status=401, text="missing, invalid or revoked relay token")
        try:
            version, index = int(request.match_info["version"]), int(request.match_info["index"])
            run = int(request.query["run"]) if "run" in request.query else None
        except ValueError:
            return web.Response(status=404, text="no such chunk")
        status, found = self._now(version, index)
        if status == 404:
            return web.Response(status=status, text=found)
        if (buffer := self.buffers.get(version)) is not None and not self.may_serve(buffer.manifest, actor):
            return self._refuse(403, actor, f"the signed plan does not send {actor} to {self.me}")
        del buffer  # a request holds no version: it looks it up at every chunk
        if self._streams[actor] >= self.MAX_STREAMS_PER_PEER or sum(self._streams.values()) >= self.MAX_STREAMS:
            return self._refuse(503, actor, f"over the stream limits ({self.MAX_STREAMS_PER_PEER} per actor, "
                                            f"{self.MAX_STREAMS} in all)")
        self._streams[actor] += 1
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        key = id(resp)
        self.upload.open(key, request.transport)
        try:
            if run is None:
                return await self._single(request, resp, key, actor, version, index)
            return await self._run(request, resp, key, actor, version, index, run)
        except _Stalled:  # cut: what it had not taken is dropped with the connection
            self.stalled_streams += 1
            self.upload.drop(key)
            self._warn_once((actor, "stalled"), f"v{version}: {actor} stopped reading a stream (from chunk {index}): "
                                                f"cut at its write deadline (logged once per actor)")
            _reset(request.transport)
            return resp
        except ConnectionError:  # the child left mid-run (killed, moved on: reset, or "Connection lost"): no answer
            self.upload.drop(key)
            log.debug("child left a run of v%d from chunk %d", version, index)
            return resp
        finally:
            self.upload.close(key)
            self._streams[actor] -= 1
            if self._streams[actor] <= 0:
                del self._streams[actor]

    async def _single(self, request: web.Request, resp: web.StreamResponse, key: int, actor: str, version: int,
                      index: int) -> web.StreamResponse:
        """One chunk: held up to ``pipeline_wait_s`` while it may still come (404 / 503 otherwise)."""
        status, found = await self._wait_for(version, index)
        if status != 200:
            return web.Response(status=status, text=found)
        buffer = self.buffers[version]
        if not self.may_serve(buffer.manifest, actor):
            return self._refuse(403, actor, f"the signed plan does not send {actor} to {self.me}")
        data = self._data(buffer, index)
        del buffer
        resp.content_length = len(data)
        await self._send(resp, key, [data], len(data), prepare=request)
        await resp.write_eof()
        return resp

    async def _run(self, request: web.Request, resp: web.StreamResponse, key: int, actor: str, version: int,
                   index: int, run: int) -> web.StreamResponse:
        """The run: each chunk as soon as it is here; a hold notice (with this node's progress) before each wait;
        the run's honest end in one byte. The version is looked up at every chunk, never held across a wait or a
        write (a weak reference tells a buffer received again meanwhile)."""
        await self._send(resp, key, [], 0, prepare=request)
        ref = None
        for j in range(index, index + max(1, run)):
            if (buffer := self.buffers.get(version)) is not None and j >= len(buffer.chunks):
                break  # a run ends with its version
            del buffer
            status, _ = self._now(version, j)
            if status is None:  # not here yet: say so, with how far this node's own copy is, then hold
                held = buffer.held if (buffer := self.buffers.get(version)) is not None else 0
                del buffer
                await self._send(resp, key, [TAG_HOLD + held.to_bytes(HOLD_BYTES, "big")], HOLD_BYTES + 1)
                status, _ = await self._wait_for(version, j)
            buffer = self.buffers.get(version)
            if status == 200 and buffer is not None:
                if ref is None:
                    if not self.may_serve(buffer.manifest, actor):  # the plan came with the version: not for it
                        self.refused_streams += 1
                        self._log_refusal(actor, "a stream", f"the signed plan does not send {actor} to {self.me}")
                        status = 404
                    ref = weakref.ref(buffer)
                elif ref() is not buffer:
                    status = 404  # the number was received again meanwhile (a resumed learner): not this run's
            if status != 200 or buffer is None:  # the honest end of a run: why, in one byte
                await self._send(resp, key, [TAG_NOT_THERE if status == 404 else TAG_NOT_YET], 1)
                break
            data = self._data(buffer, j)
            del buffer
            await self._send(resp, key, [TAG_CHUNK, data], len(data))  # as soon as it is verified: the pipeline
            del data
        await resp.write_eof()
        return resp

    async def _send(self, resp: web.StreamResponse, key: int, parts: list[bytes], size: int,
                    prepare: web.Request | None = None) -> None:
        """Write ``parts`` (``size`` bytes that count) within the write deadline: ``chunk_timeout`` of ``size`` at
        the floor rate; a child that does not take them by then stopped reading (``_Stalled``)."""
        self.upload.writing(key, sum(map(len, parts)))
        try:
            async with asyncio.timeout(self.policy.chunk_timeout(size)):
                if prepare is not None:
                    await resp.prepare(prepare)
                for part in parts:
                    await resp.write(part)
        except TimeoutError:
            raise _Stalled from None

    def _data(self, buffer: VersionBuffer, index: int) -> bytes:
        """What is served of a chunk that is here (a test's hostile server changes it)."""
        data = buffer.data[index]
        assert data is not None
        return data

    def _now(self, version: int, index: int) -> tuple[int | None, str]:
        """(200, "") if chunk ``index`` of ``version`` is here; (404, why) if it will not come; (None, "") if it
        may still come."""
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
        return None, ""

    async def _wait_for(self, version: int, index: int) -> tuple[int, str]:
        """(200, "") once chunk ``index`` of ``version`` is here; (404, why) if it will not come; (503, why)
        after holding the request ``pipeline_wait_s``."""
        deadline = time.monotonic() + self.policy.pipeline_wait_s
        while True:  # re-checked whenever a version is added or this chunk or its version ends
            status, why = self._now(version, index)
            if status is not None:
                return status, why
            buffer = self.buffers.get(version)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if buffer is None:
                    return 404, f"version {version} not here"
                return 503, f"chunk {index} of version {version} not received yet"
            events = [buffer.events[index], buffer.ended] if buffer is not None else []
            del buffer  # the wait holds the version's events, not the version
            await self._until_changed(events, remaining)

    async def _until_changed(self, events: list[asyncio.Event], timeout: float) -> None:
        """Wait for a new version, or for one of ``events`` (this chunk arrived, its version ended), or the
        timeout."""
        assert self._version_added is not None
        waiters = [asyncio.ensure_future(e.wait()) for e in [self._version_added, *events]]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()


def _reset(transport) -> None:
    """Cut a connection at once, with a reset: a plain close would leave what the kernel still queues for a child
    that does not read to wait there (and the child none the wiser) until the kernel gives up."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
