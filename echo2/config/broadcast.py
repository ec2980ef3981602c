"""``broadcast``: how versions reach the actors (the relay forest or the store alone, ``echo2/broadcast/``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from echo2.config._base import _Section
from echo2.data.manifest import chunk_size_for


class BroadcastConfig(_Section):
    mode: Literal["relay", "store"] = "relay"
    """``relay``: actors pass chunks along a relay tree, roots read the store; ``store``: every actor reads the
    store."""
    chunk_mb: float = Field(8.0, gt=0)
    """The largest chunk: the unit of verification (sha256 in the manifest), transfer and pipelining."""
    min_chunks: int = Field(256, ge=1)
    """A version is cut into at least this many chunks, down to ``min_chunk_mb`` each: a relay forwards a chunk
    once it has it whole, so each hop of a chain adds a chunk's transfer, and a small version (a sparse delta)
    in ``chunk_mb`` chunks would spend most of its time filling the chain (``chunk_bytes``)."""
    min_chunk_mb: float = Field(0.25, gt=0)
    """The smallest chunk ``min_chunks`` may cut to (``chunk_mb`` where that is smaller): each chunk costs a
    hash in the signed manifest and a tag on the wire."""
    fanout: int = Field(1, ge=1)
    """Children per relay node (1 = a chain: every node uploads each chunk once)."""
    roots: int = Field(1, ge=1)
    """Relay nodes that read from the store."""
    expected_mbit: float = Field(200.0, gt=0)
    """Not used by the relay's health rule any more (a parent is held to its measured rate and the actor's
    need, ``broadcast/rates.py``); accepted so that older configs still load."""
    min_rate_fraction: float = Field(0.2, gt=0, le=1)
    """A parent slower on a chunk than this fraction of the lesser of its measured rate (its share of its
    measured upload, from the signed plan) and the rate the actor needs to keep up with publishing is left for
    the next source (``broadcast/rates.py``)."""
    floor_mbit: float = Field(5.0, gt=0)
    """The rate (Mbit/s) below which a parent is left whatever is known of it: a stalling parent is left."""
    pipeline_wait_s: float = Field(30.0, gt=0)
    """How long a relay holds a request for a chunk it is still receiving."""
    answer_grace_s: float = Field(2.0, gt=0)
    """How long a parent has to answer a request for a run of chunks (the first chunk, or a notice that it
    holds): the network's round trips and scheduling, since an honest parent answers at once. A parent that
    does not answer costs each of its children this much, once per version (``broadcast/rates.py``)."""
    window: int = Field(4, ge=1)
    """Chunk requests in flight to the store (from a peer, chunks come as one streamed run per request)."""
    host: str = "127.0.0.1"
    """Address the relay server binds (0.0.0.0 on cloud VMs)."""
    advertise_host: str | None = None
    """Address peers use to reach this relay (default: host)."""
    port: int = Field(0, ge=0, le=65535)
    """Relay port (0 = any free port)."""
    heartbeat_s: float = Field(2.0, gt=0)
    """How often an actor refreshes its record under peers/."""
    peer_timeout_s: float = Field(10.0, gt=0)
    """A peer whose heartbeat is older than this is not given children."""
    tls: Literal["auto", "on", "off"] = "auto"
    """Mutual TLS between relay peers, with certificates from the run's CA (``broadcast/relay_tls.py``):
    ``auto`` = on whenever the relay binds a non-loopback address (a cloud VM), off on 127.0.0.1;
    ``on``; ``off`` (refused with the SkyPilot backend, whose relay port is open to the internet).
    Only peer-to-peer traffic: the store keeps its own transport."""

    @field_validator("tls", mode="before")
    @classmethod
    def _yaml_booleans(cls, value):
        """YAML reads a bare ``on`` / ``off`` as a boolean: take it as the word the user wrote."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    def chunk_bytes(self, version_bytes: int) -> int:
        """The chunk size of a version of ``version_bytes`` (``manifest.chunk_size_for``)."""
        return chunk_size_for(version_bytes, largest_mb=self.chunk_mb, smallest_mb=self.min_chunk_mb,
                              at_least=self.min_chunks)
