"""The relay's client side: fills a ``VersionBuffer`` from the parents of the signed plan, one streamed run
of chunks per parent, then from the store (the protocol, its timeouts and why it streams: ``relay.py``;
the rate a parent is held to: ``rates.py``)."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from aiohttp import ClientError, ClientResponse, ClientSession, ClientTimeout

from echo2.broadcast.protocol import (
    HOLD_BYTES,
    MAX_STORE_REQUESTS,
    TAG_CHUNK,
    TAG_HOLD,
    TAG_NOT_THERE,
    TAG_NOT_YET,
    FetchPolicy,
    NotThere,
    Peer,
    SourceFailed,
    VersionBuffer,
)
from echo2.broadcast.rates import RateMeter, RunBudget, min_rate_mbit
from echo2.broadcast.relay_tls import RelayTLS
from echo2.data.manifest import Chunk
from echo2.data.relay_tokens import RelayAuth

log = logging.getLogger("echo2.relay")


class Fetcher:
    """Fills a ``VersionBuffer`` from an ordered list of sources: parent peer(s) first, the store last."""

    def __init__(self, token: str, store_read: Callable[[Chunk, dict], bytes], policy: FetchPolicy, *,
                 tls: RelayTLS | None = None, auth: RelayAuth | None = None,
                 store_stream: Callable[[list[Chunk], dict], Iterator[bytes]] | None = None):
        """``tls``: speak TLS to peers (only to ``Peer``s on https URLs, each checked to be its actor);
        ``auth``: whose revocations to honour when choosing parents; ``store_stream``: where the store can stream
        a byte range, consecutive chunks of one file -> their bytes, one chunk per item, in order (blocking; one
        ranged GET), which a root then reads in order instead of ``store_read``'s parallel requests."""
        self.token = token
        self.store_read = store_read  # blocking; runs in a worker thread
        self.store_stream = store_stream
        self.policy = policy
        self.tls = tls
        self.auth = auth
        self.download = RateMeter()
        """What this node's downloads achieved (``rates.py``)."""
        self._store_pool: ThreadPoolExecutor | None = None  # the blocking store reads (asyncio's own pool has 6
        # threads on 2 cores: too few for small chunks over a long path)

    def close(self) -> None:
        """Let the store-read threads go (a read still running ends on its own)."""
        if self._store_pool is not None:
            self._store_pool.shutdown(wait=False, cancel_futures=True)
            self._store_pool = None

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
                    on_left: Callable[[Peer, int, str], None] | None = None,
                    need_mbit: float | None = None) -> VersionBuffer:
        """Fill ``buffer``; ``on_left(peer, version, why)`` is called (on the relay's loop) for each peer of
        the plan left because it failed to deliver (not for a 404), and for one that delivered the version too
        slowly for this node's need (``_judge``); ``need_mbit``: the rate this node needs the version at
        (``rates.min_rate_mbit``), None if unknown."""
        try:
            return await self._fill(buffer, peers, on_left, need_mbit)
        except BaseException as exc:  # failed or cancelled: requests held for its chunks are answered now
            buffer.abandon(exc)
            raise

    async def _fill(self, buffer: VersionBuffer, peers: list[str | Peer],
                    on_left: Callable[[Peer, int, str], None] | None, need_mbit: float | None) -> VersionBuffer:
        sources = [p for p in peers if self._dialable(p, buffer.version)]
        timeout = ClientTimeout(total=None, sock_connect=3)
        # raw bytes only: a peer's gzip must not turn a bounded read into an unbounded inflate
        async with ClientSession(timeout=timeout, headers={"Authorization": f"Bearer {self.token}"},
                                 auto_decompress=False) as session:
            for source in sources:  # each peer streams what is still missing, in order, until it fails
                asked, got = asyncio.get_running_loop().time(), 0
                try:
                    for first, last in _runs([i for i, d in enumerate(buffer.data) if d is None]):
                        got += await self._stream(session, source, buffer, first, last, need_mbit)
                    self._judge(source, buffer.version, got, asked, need_mbit, on_left)
                    return buffer
                # ClientError: a peer that dies (ServerDisconnectedError, ClientPayloadError, ClientConnectorError
                # for a refused connection): left at once, its children's next source takes over
                except (SourceFailed, OSError, asyncio.TimeoutError, ValueError, ClientError) as exc:
                    why = str(exc) or type(exc).__name__
                    log.warning("v%d: leaving %s for the next source: %s", buffer.version, source, why)
                    if on_left is not None and isinstance(source, Peer) and not isinstance(exc, NotThere):
                        on_left(source, buffer.version, why)
        await self._from_store(buffer)
        return buffer

    def _judge(self, source: str | Peer, version: int, nbytes: int, asked: float, need_mbit: float | None,
               on_left: Callable[[Peer, int, str], None] | None) -> None:
        """Report a parent that delivered its part of the version (from the first byte asked for to the last,
        holds included) at under ``version_need_fraction`` of what this node needs: it kept every run's pace,
        yet this node could not keep up with publishing through it."""
        if not isinstance(source, Peer) or not nbytes or not need_mbit or on_left is None:
            return
        seconds = max(asyncio.get_running_loop().time() - asked, 1e-6)
        mbit = nbytes * 8 / seconds / 1e6
        if mbit < self.policy.version_need_fraction * need_mbit:
            why = (f"delivered v{version} at {mbit:.3g} Mbit/s ({nbytes} bytes in {seconds:.1f} s), under "
                   f"{self.policy.version_need_fraction:g} of the {need_mbit:.3g} Mbit/s this node needs")
            log.warning("v%d: reporting %s: %s", version, source, why)
            on_left(source, version, why)

    async def _from_store(self, buffer: VersionBuffer) -> None:
        """What is still missing, ``FetchPolicy.store_requests`` chunks at a time (``window``, or enough to cover
        the store's bandwidth-delay product with small chunks); a failure here fails the version."""
        if self._store_pool is None:
            self._store_pool = ThreadPoolExecutor(MAX_STORE_REQUESTS, thread_name_prefix="echo2-store")
        if self.store_stream is not None:
            try:
                await self._store_runs(buffer)
            except (OSError, ValueError, SourceFailed) as exc:  # what is still missing: one request a chunk
                log.warning("v%d: streaming from the store failed (%s); reading chunk by chunk", buffer.version, exc)
        queue = [i for i, d in enumerate(buffer.data) if d is None][::-1]
        if not queue:
            return
        loop = asyncio.get_running_loop()

        async def worker() -> None:
            while queue:
                chunk = buffer.chunks[queue.pop()]
                self.download.start()
                data = b""
                try:
                    data = await loop.run_in_executor(self._store_pool, self.store_read, chunk, buffer.manifest)
                finally:
                    self.download.stop(len(data))
                buffer.put(chunk.index, data, "store")

        n = min(len(queue), self.policy.store_requests(max(c.size for c in buffer.chunks)))
        await asyncio.gather(*(worker() for _ in range(n)))

    async def _store_runs(self, buffer: VersionBuffer) -> None:
        """What is missing, one streamed ranged read per run of consecutive chunks of a file, each chunk put
        (verified) as it comes: in order, so a root serves its children from the first chunk on, where parallel
        requests sharing the store's uplink finish chunk 0 only about a window's transfer time later."""
        assert self.store_stream is not None and self._store_pool is not None
        loop = asyncio.get_running_loop()
        missing = [i for i, d in enumerate(buffer.data) if d is None]
        for first, last in _runs(missing):
            chunks = buffer.chunks[first : last + 1]
            for run in _by_file(chunks):
                queue: asyncio.Queue = asyncio.Queue()
                stop = threading.Event()

                def read(run: list[Chunk] = run, queue: asyncio.Queue = queue, stop: threading.Event = stop) -> None:
                    try:  # each chunk handed to the loop as it is read; then None, or the error
                        for data in self.store_stream(run, buffer.manifest):
                            if stop.is_set():  # the loop gave up on this run (a bad chunk, a cancel)
                                return
                            loop.call_soon_threadsafe(queue.put_nowait, data)
                        loop.call_soon_threadsafe(queue.put_nowait, None)
                    except BaseException as exc:  # noqa: BLE001 - handed to the loop, raised there
                        loop.call_soon_threadsafe(queue.put_nowait, exc)

                reader = loop.run_in_executor(self._store_pool, read)
                self.download.start()
                got = 0
                try:
                    for chunk in run:
                        item = await queue.get()
                        if isinstance(item, BaseException):
                            raise item
                        if item is None:
                            raise SourceFailed(f"the store's stream ended before chunk {chunk.index}")
                        got += len(item)
                        buffer.put(chunk.index, item, "store")
                except BaseException:
                    stop.set()
                    raise
                finally:
                    self.download.stop(got)
                await reader

    async def _stream(self, session: ClientSession, source: str | Peer, buffer: VersionBuffer, first: int,
                      last: int, need_mbit: float | None) -> int:
        """Chunks ``first`` .. ``last`` from ``source`` as one streamed run, each put (verified) as it comes; the
        bytes delivered. The peer is held to a rate over the whole run from the moment it was asked, holds it
        declares with progress excused (``rates.RunBudget``), not per chunk."""
        base = source.url if isinstance(source, Peer) else source
        url = f"{base}/v1/versions/{buffer.version}/chunks/{first}?run={last - first + 1}"
        tls = {} if self.tls is None else {  # the certificate must name the plan's peer, whatever the address
            "ssl": self.tls.client_context, "server_hostname": RelayTLS.server_hostname(source.actor_id)}
        loop = asyncio.get_running_loop()
        share = source.share_mbit if isinstance(source, Peer) else None
        rate = min_rate_mbit(fraction=self.policy.min_rate_fraction, floor_mbit=self.policy.floor_mbit,
                             parent_mbit=share, need_mbit=need_mbit)
        sizes = [c.size for c in buffer.chunks]
        budget = RunBudget(loop.time(), rate_mbit=rate, floor_mbit=self.policy.floor_mbit,
                           grace_s=self.policy.answer_grace_s,
                           slack_s=self.policy.chunk_slack_s, start_s=self.policy.pipeline_wait_s,
                           chunks=len(sizes), mean_chunk=sum(sizes) / max(1, len(sizes)))
        index = first
        try:
            async with asyncio.timeout_at(budget.due()) as deadline:
                async with session.get(url, **tls) as resp:
                    if resp.status == 404:
                        raise NotThere(f"{url} answered 404")
                    if resp.status != 200:
                        raise SourceFailed(f"{url} answered {resp.status}")
                    while index <= last:
                        chunk = buffer.chunks[index]
                        deadline.reschedule(budget.due())
                        tag = await resp.content.read(1)
                        if tag == TAG_HOLD:  # not there yet at the parent: how far its own copy is
                            try:
                                held = int.from_bytes(await resp.content.readexactly(HOLD_BYTES), "big")
                            except asyncio.IncompleteReadError:
                                why = f"{source} ended the run in a hold notice at chunk {index}"
                                raise SourceFailed(why) from None
                            if (why := budget.hold(held, loop.time())) is not None:
                                raise SourceFailed(f"{source} sent junk at chunk {index}: {why}")
                            continue
                        if tag == TAG_NOT_THERE:
                            raise NotThere(f"{source} will not have chunk {index} of v{buffer.version}")
                        if tag != TAG_CHUNK:
                            what = {TAG_NOT_YET: "held it past its hold", b"": "ended the run"}.get(tag, "sent junk")
                            raise SourceFailed(f"{source} {what} at chunk {index}")
                        budget.chunk(loop.time())
                        deadline.reschedule(budget.due(chunk.size))
                        # timed from its tag to its verification: back to back, the next chunk's bytes arrive while
                        # this one is checked, so the periods join up; a hold before a tag is not counted
                        self.download.start()
                        data = b""
                        try:
                            data = await _read_at_most(resp, chunk.size)
                            if len(data) != chunk.size:  # raised in here: the connection is dropped, the rest unread
                                raise SourceFailed(f"{url} sent {len(data)} bytes for chunk {index} of {chunk.size}")
                            buffer.put(index, data, str(source))
                        finally:
                            self.download.stop(len(data))
                        budget.delivered(chunk.size)
                        index += 1
        except TimeoutError:
            if budget.answered is None:
                raise SourceFailed(f"{source} did not answer within {self.policy.answer_grace_s:.1f} s") from None
            raise SourceFailed(f"{source} fell behind at chunk {index}: {budget.done} bytes in "
                               f"{loop.time() - budget.started:.1f} s, below {rate:.3g} Mbit/s over the run "
                               f"(holds with progress excused)") from None
        return budget.done


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as (first, last) runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def _by_file(chunks: list[Chunk]) -> list[list[Chunk]]:
    """Consecutive chunks split where the file changes."""
    out: list[list[Chunk]] = []
    for chunk in chunks:
        if out and out[-1][-1].file == chunk.file:
            out[-1].append(chunk)
        else:
            out.append([chunk])
    return out


async def _read_at_most(resp: ClientResponse, limit: int) -> bytes:
    """The body up to ``limit`` bytes: never more, whatever the peer sends or announces (the blocks joined once:
    one copy of the chunk, not two)."""
    try:
        return await resp.content.readexactly(limit)
    except asyncio.IncompleteReadError as exc:  # end of the body first
        return exc.partial
