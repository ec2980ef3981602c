"""The relay protocol's shared parts, which the server (``relay.py``) and the client (``fetcher.py``) both use:
the tags of a streamed run of chunks, the errors a source fails with, a parent as the plan names it, the
buffer a version is received into (every chunk checked against the manifest as it is put), and the fetch
policy. The protocol itself is described in ``relay.py``'s module docstring."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from echo2.data.manifest import Chunk

ANSWER_GRACE_S = 2.0
"""How long a child waits for a peer's first answer to a run, a chunk or a hold notice (network and scheduling;
an honest parent answers at once), and the grace a run's budget starts with (``rates.RunBudget``)."""
MAX_STORE_REQUESTS = 32
"""No more chunk requests than this in flight to the store (threads: the store's client is blocking)."""
TAG_CHUNK = b"C"
"""In a run (``?run=k``): the chunk's bytes follow (its size is the manifest's)."""
TAG_NOT_THERE = b"N"
"""In a run: the next chunk will not come here (superseded, failed); the run ends. The honest 404."""
TAG_NOT_YET = b"H"
"""In a run: the next chunk was held ``pipeline_wait_s`` and did not arrive; the run ends. The 503."""
TAG_HOLD = b"W"
"""In a run: the next chunk is not here yet, so the parent holds the run, and says how far its own copy is:
``HOLD_BYTES`` bytes, big-endian, the count of the version's chunks it holds verified (0: none yet, or it has
not started the version). Sent as each hold begins; the run goes on with the chunk, or with its end. What a
child excuses of a hold is in ``rates.RunBudget``."""
HOLD_BYTES = 4


class SourceFailed(Exception):
    """A source (peer) was dead, slow, or served a chunk that failed verification."""


class NotThere(SourceFailed):
    """The peer answered 404: it will not have the chunk (superseded, abandoned, never fetched); an
    honest answer, given at once, so it is not reported against the peer."""


class Peer(NamedTuple):
    """A parent from the signed relay plan: where it says it listens, who it must prove to be (TLS), and
    its share of its measured upload (its up_mbit over its children in the plan; None if unknown)."""

    url: str
    actor_id: str
    share_mbit: float | None = None

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
    missing: int = 0
    """Chunks not in yet (kept as they are put: no scan of every chunk per chunk)."""
    released: bool = False
    """The relay dropped this version and let its bytes go (``release``)."""

    def __post_init__(self) -> None:
        n = len(self.chunks)
        self.missing = n
        self.data = [None] * n
        self.arrived_at = [None] * n
        self.sources = [None] * n
        self.events = [asyncio.Event() for _ in range(n)]

    def put(self, index: int, data: bytes, source: str) -> None:
        chunk = self.chunks[index]
        if len(data) != chunk.size or hashlib.sha256(data).hexdigest() != chunk.sha256:
            raise SourceFailed(f"chunk {index} of v{self.version} from {source} does not match the manifest")
        if self.data[index] is None:
            self.missing -= 1
        self.data[index] = data
        self.arrived_at[index] = time.time()
        self.sources[index] = source
        self.events[index].set()
        if self.missing == 0:
            self.done.set()

    def abandon(self, exc: BaseException) -> None:
        self.failed = exc
        self.ended.set()

    @property
    def held(self) -> int:
        """Chunks in, verified (what a hold notice says: ``TAG_HOLD``)."""
        return len(self.chunks) - self.missing

    def release(self) -> None:
        """Let the chunks' bytes go now: the relay no longer serves this version, and whatever still refers to
        the buffer (a request being answered, a future) must not keep a whole version in memory."""
        self.released = True
        self.data = [None] * len(self.chunks)

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
    """Not used by the health rule any more (``rates.min_rate_mbit``: a parent is held to its measured rate and
    the child's need); kept so that callers that set it still work."""
    min_rate_fraction: float = 0.2
    """A parent slower over a run than this fraction of the lesser of its own rate and the child's need is
    left (``rates.min_rate_mbit``, ``rates.RunBudget``)."""
    floor_mbit: float = 5.0
    """The rate no parent may fall below over a run, whatever is (not) known: a stalling parent is left. Also
    the rate a holding parent's own copy must fill at, and the one a child that stopped reading is held to
    (the relay's write deadline, ``chunk_timeout``)."""
    version_need_fraction: float = 0.5
    """A parent that delivered the version (from the first byte asked for, holds included) at less than this
    fraction of what the child needs is reported, though kept for the version: the learner then plans it at
    the leaves. Half: the need is a median of recent intervals between versions, and an honest parent on a
    version that came late must not be reported for that."""
    pipeline_wait_s: float = 30.0
    """How long a server holds a request for a chunk it is still receiving."""
    answer_grace_s: float = ANSWER_GRACE_S
    """How long a peer has to answer a run (a chunk, or a hold notice), which is also what a peer that never
    answers costs a child, once per version."""
    window: int = 4
    """Chunk requests in flight to the store, at least (``store_requests``). From a peer, chunks come as one
    streamed run (module docstring)."""
    store_bytes_in_flight: int = 8 * 2**20
    """Bytes of chunk requests kept in flight to the store, at least: small chunks get more requests, so that
    what is in flight still covers the store's bandwidth-delay product (8 MB: 200 Mbit/s over 320 ms, 1 Gbit/s
    over 64 ms); the window's 4 requests of small chunks over a long round trip leave the store's uplink idle
    between answers (measured: ``docs/runs/2026-12-03-broadcast-wan.md``, "A root reading the store")."""
    chunk_slack_s: float = 2.0
    """Seconds a chunk's bytes may take beyond its size at the rate the parent is held to (scheduling)."""

    def store_requests(self, chunk_size: int) -> int:
        """Chunk requests in flight to the store for chunks of ``chunk_size`` bytes (``window``,
        ``store_bytes_in_flight``), at most ``MAX_STORE_REQUESTS``."""
        return max(self.window, min(MAX_STORE_REQUESTS, -(-self.store_bytes_in_flight // max(1, chunk_size))))

    def chunk_timeout(self, size: int, rate_mbit: float | None = None) -> float:
        """Seconds a chunk's bytes may take once they start, at ``rate_mbit`` (default: the floor)."""
        return self.chunk_slack_s + size * 8 / ((rate_mbit or self.floor_mbit) * 1e6)
