"""A fault-injecting reverse proxy in front of an S3 endpoint (moto's server), on loopback.

Every request is forwarded unchanged (method, path, query, headers, body) unless it is chosen to fail:
with probability ``fail_rate``, or always during an ``outage``. A failed request gets, in turn, S3's
own ``503 SlowDown`` (XML body, as S3 sends it), a ``500 InternalError``, or a connection reset with no
answer at all: the three ways a real store fails transiently. Counts of forwarded and failed requests
are kept for the report. moto runs with auth off, so re-sending a signed request from another port is
fine (the signature covers the Host header, which moto does not check).

Whether the clients noticed each fault is measured, not assumed (``retried``): a failed request counts as
detected when the same request (method, path and query, body) arrives again later, i.e. a client saw the
failure and retried it rather than carrying on without it.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import time

from aiohttp import ClientSession, ClientTimeout, web

_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
               "proxy-authenticate", "content-length", "host"}


class FaultyS3Proxy:
    def __init__(self, upstream: str, *, fail_rate: float = 0.1, seed: int = 0):
        self.upstream = upstream.rstrip("/")
        self.fail_rate = fail_rate
        self.forwarded = 0
        self.failed = 0
        self._rng = random.Random(seed)
        self._outage_until = 0.0
        self._requests: list[tuple[float, str, bool]] = []
        """(time, request's identity, whether it was failed) of every request, in arrival order."""
        self._kind = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="echo2-faulty-s3", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None
        self.url = ""

    def start(self) -> str:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self.url

    async def _start(self) -> None:
        self._session = ClientSession(timeout=ClientTimeout(total=60), auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def outage(self, seconds: float) -> None:
        """Fail every request for the next ``seconds``."""
        self._outage_until = time.time() + seconds

    def in_outage(self) -> bool:
        return time.time() < self._outage_until

    def retried(self, grace_s: float = 30.0) -> tuple[int, int, int]:
        """(failed requests judged, of them sent again later, failed requests too late to judge): a failure
        in the last ``grace_s`` of traffic that was not sent again may be one whose client was stopped
        while it waited to retry (the run ended), so it is neither counted as missed nor as detected."""
        seen_later: set[str] = set()
        judged = retried = late = 0
        end = self._requests[-1][0] if self._requests else 0.0
        for at, identity, failed in reversed(self._requests):
            if failed:
                again = identity in seen_later
                if again or at <= end - grace_s:
                    judged += 1
                    retried += again
                else:
                    late += 1
            seen_later.add(identity)
        return judged, retried, late

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        identity = f"{request.method} {request.path_qs} {hashlib.sha256(body).hexdigest()}"
        fail = self.in_outage() or self._rng.random() < self.fail_rate
        self._requests.append((time.time(), identity, fail))
        if fail:
            self.failed += 1
            self._kind += 1
            if self._kind % 3 == 0:  # the connection dies without an answer
                request.transport.close()
                return web.Response(status=503)
            body = _SLOW_DOWN if self._kind % 3 == 1 else _INTERNAL
            return web.Response(status=503 if self._kind % 3 == 1 else 500, body=body, content_type="application/xml")
        self.forwarded += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(request.method, f"{self.upstream}{request.path_qs}", headers=headers,
                                         data=body, allow_redirects=False) as upstream:
            payload = await upstream.read()
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
            if request.method == "HEAD":  # no body, but the object's size is in the answer
                if "Content-Length" in upstream.headers:
                    out["Content-Length"] = upstream.headers["Content-Length"]
                return web.Response(status=upstream.status, headers=out)
            return web.Response(status=upstream.status, headers=out, body=payload)

    def stop(self) -> None:
        async def shutdown():
            if self._runner is not None:
                await self._runner.cleanup()
            if self._session is not None:
                await self._session.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
