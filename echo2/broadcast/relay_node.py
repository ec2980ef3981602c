"""A relay node: the relay's server (``relay.py``) and its fetcher (``fetcher.py``) on one private asyncio loop in a
daemon thread, so an actor keeps relaying to its children while it generates; what the actor and the broadcast
benchmark call (start a version's fetch, seed a version in hand, read the measured rates, close).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Iterator

from echo2.broadcast.fetcher import Fetcher
from echo2.broadcast.protocol import FetchPolicy, Peer, VersionBuffer
from echo2.broadcast.relay import RelayServer
from echo2.broadcast.relay_tls import RelayTLS
from echo2.data.manifest import Chunk, chunk_table
from echo2.data.relay_tokens import RelayAuth, TokenRefused


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
        self.server = server_cls(auth, host=host, port=port, tls=tls, policy=self.policy, me=_actor_of(auth, token))

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



def _actor_of(auth: RelayAuth, token: str) -> str | None:
    """The actor this node's own token names (whose place in each plan says whom its relay serves); None if the
    token does not verify here (then the relay serves every valid token)."""
    try:
        return auth.actor_of(token)
    except TokenRefused:
        return None
