"""What a relay node measures of its own links, and the rate a parent is held to.

Measured, never configured: every node measures its download rate on the chunks it receives (from a
parent or the store) and its upload rate on the chunks it serves, and puts both in its peer record
(``topology.register(..., up_mbit=, down_mbit=)``), from which the learner may plan (``topology.plan``).

``RateMeter``: bytes moved over the time at least one transfer was in progress (the union of the
transfers' intervals, so concurrent transfers share one clock: the rate is the link's, not one
transfer's), over the last ``SAMPLES`` busy periods. A download's interval runs from the moment its bytes
start to come (a stream's chunk tag, or the store call) until the chunk is verified: the time a parent
held the request waiting for the chunk itself is not counted, and the chunks of a stream, whose bytes
arrive while the one before is checked, make one joined-up period. It measures what the downloads
achieved, so the slower of the parent's share and this node's downlink: a lower bound of the downlink. An
upload is counted as the bytes that left this node (the bytes written less what still waits in the
transport's and, on Linux, the kernel's send queue, ``TIOCOUTQ``) each ``UPLOAD_TICK_S`` while a stream is
open, over the ticks in which anything was queued or left: a write returns once the data is queued (up to
a few MB of socket buffer), so timing the writes alone would count a 64 KB chunk as sent in no time. Rates
are None until ``MIN_BYTES`` over ``MIN_SECONDS`` were seen.

A stream whose queued bytes have not moved for ``STALL_S`` (a child that stopped reading) is idle: its
ticks count neither as upload time nor hold a period open, so one child that never reads cannot drag down
the rate a node measures (and reports, and is planned by).

The rate a parent is held to (``min_rate_mbit``): ``min_rate_fraction`` of the lesser of what the parent
can give this child (its share of its measured upload as the signed plan carries it: ``up_mbit`` over its
children) and what the child needs (the version's bytes over the time between the learner's versions, as
the receiver observes it), never below ``floor_mbit``, so a stalling parent is left even when nothing is
known. A parent of unknown rate to a child of unknown need is held to the floor alone: a 30 Mbit/s peer
is not "unhealthy" for missing a fixed 200 Mbit/s figure, and a fast peer is held to the rate it
measured. The rates are self-reported and untrusted: a parent that claims more than it gives is only held
to more (and left sooner), and the child's need caps what any claim can demand.

Over a whole run, not per chunk (``RunBudget``): timed per chunk, a parent could hold every chunk until just
before its own deadline and then send it at full speed, one chunk per hold, for ever. So the rate is held
over the run: the first answer (a chunk, or a hold notice) within ``answer_grace_s`` of the request; from
that answer on, every byte by the time the run's bytes so far take at the held rate, plus one slack. A hold
counts against it unless the parent says why (``protocol.TAG_HOLD``: it does not have the next chunk yet)
and shows progress: it may wait up to ``pipeline_wait_s`` for its own copy of the version to start, and its
copy must then fill at the floor rate at least (the chunks it says it holds, plus the one it waits for, at
``floor_mbit``), which bounds what a parent that lies about its holds can cost: the version at the floor
rate, once, plus the start-up wait, where before it was one hold per chunk. What a parent delivers over the
whole version is judged too (``Fetcher``, ``FetchPolicy.version_need_fraction``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import math
import struct
import termios
import threading
import time

SAMPLES = 16
"""Busy periods a meter averages over (a version streamed without a pause is one period)."""
MIN_BYTES = 256 * 1024
MIN_SECONDS = 0.01
UPLOAD_TICK_S = 0.05
STALL_S = 0.5
"""A stream with bytes queued that did not move for this long is stalled: its time is idle, not upload time."""


class RateMeter:
    """Bytes over busy time (module docstring). ``start``/``stop`` on one thread; ``mbit`` from any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._bytes = 0
        self._periods: collections.deque[tuple[int, float]] = collections.deque(maxlen=SAMPLES)

    def start(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since, self._bytes = time.monotonic(), 0
            self._active += 1

    def stop(self, nbytes: int) -> None:
        with self._lock:
            self._active = max(0, self._active - 1)
            self._bytes += max(0, nbytes)
            if self._active == 0:
                self._periods.append((self._bytes, time.monotonic() - self._since))

    def add(self, nbytes: int, seconds: float) -> None:
        """A period measured elsewhere (the upload ticks)."""
        with self._lock:
            self._periods.append((max(0, nbytes), max(0.0, seconds)))

    @property
    def mbit(self) -> float | None:
        with self._lock:
            nbytes = sum(b for b, _ in self._periods)
            seconds = sum(s for _, s in self._periods)
        if nbytes < MIN_BYTES or seconds < MIN_SECONDS:
            return None
        return nbytes * 8 / seconds / 1e6


def queued_bytes(transport) -> int:
    """Bytes written to ``transport`` that have not left this machine yet (transport buffer + kernel send
    queue where Linux tells it); 0 for a closed transport."""
    if transport is None or transport.is_closing():
        return 0
    queued = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            queued += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return queued


class UploadMeter:
    """The upload side: open streams say what they hand to the transport; a tick counts what left (module
    docstring). All on the relay's loop."""

    def __init__(self) -> None:
        self.meter = RateMeter()
        # id -> [transport, bytes handed over, bytes that left, closed, when its queue last moved]
        self._streams: dict[int, list] = {}
        self._ticker: asyncio.Task | None = None

    def open(self, key: int, transport) -> None:
        self._streams[key] = [transport, 0, 0, False, time.monotonic()]
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    def writing(self, key: int, nbytes: int) -> None:
        """``nbytes`` are about to be written (counted as queued until they leave)."""
        if key in self._streams:
            self._streams[key][1] += nbytes

    def close(self, key: int) -> None:
        """The stream ended; it is counted until what it wrote has left (or its connection closed)."""
        if key in self._streams:
            self._streams[key][3] = True

    def drop(self, key: int) -> None:
        """The stream's connection was cut (a child that left, or one that stopped reading): what it had not
        sent yet never leaves, so it is not counted; what left is counted already."""
        self._streams.pop(key, None)

    def _account(self, now: float) -> tuple[int, bool]:
        """Bytes that left since the last look, and whether a stream still has bytes queued that are moving
        (one whose queue stood still for ``STALL_S`` is a child that stopped reading: idle)."""
        left, moving = 0, False
        for key, entry in list(self._streams.items()):
            transport, written, counted, closed, moved_at = entry
            gone = max(counted, written - queued_bytes(transport))
            if gone > counted:
                entry[4] = moved_at = now
            left += gone - counted
            entry[2] = gone
            if gone < written:
                moving = moving or now - moved_at < STALL_S
            elif closed:
                del self._streams[key]
        return left, moving

    async def _tick(self) -> None:
        last = time.monotonic()
        period, was_moving = [0, 0.0], False
        while self._streams:
            await asyncio.sleep(UPLOAD_TICK_S)
            now = time.monotonic()
            left, moving = self._account(now)
            if left or was_moving:
                period[0] += left
                period[1] += now - last
            if not moving and period[0]:
                self.meter.add(*period)
                period = [0, 0.0]
            was_moving, last = moving, now
        if period[0]:
            self.meter.add(*period)


def min_rate_mbit(*, fraction: float, floor_mbit: float, parent_mbit: float | None,
                  need_mbit: float | None) -> float:
    """The rate below which a parent's chunk is too slow (module docstring)."""
    known = [r for r in (parent_mbit, need_mbit) if r is not None and math.isfinite(r) and r > 0]
    if not known:
        return floor_mbit
    return max(floor_mbit, fraction * min(known))


class RunBudget:
    """What a parent is held to over one streamed run (module docstring), on the child's clock (the loop's
    ``time()``). The fetcher asks ``due`` before each read; a read not done by then leaves the parent."""

    def __init__(self, started: float, *, rate_mbit: float, floor_mbit: float, grace_s: float, slack_s: float,
                 start_s: float, chunks: int, mean_chunk: float):
        """``started``: when the run was asked for; ``rate_mbit``: what the parent is held to (``min_rate_mbit``);
        ``start_s``: how long it may wait for its own copy of the version to start (``pipeline_wait_s``);
        ``chunks``: the version's count, ``mean_chunk`` its mean chunk size in bytes (what a hold's progress
        is counted in)."""
        self.started, self.grace_s, self.slack_s, self.start_s = started, grace_s, slack_s, start_s
        self.rate = rate_mbit * 1e6 / 8  # bytes/s
        self.floor = floor_mbit * 1e6 / 8
        self.chunks, self.mean_chunk = chunks, mean_chunk
        self.done = 0
        """Bytes of the chunks delivered in this run."""
        self.sent = 0
        """Chunks delivered in this run."""
        self.answered: float | None = None
        """When the first answer came (None: not yet)."""
        self.claimed: int | None = None
        """Chunks the parent said it holds in its newest hold notice (None: it sent none)."""
        self.starting = False
        """The run opened with a hold before the parent held any of the version: it may wait ``start_s``."""
        self.waited = 0.0
        """Seconds it waited for its copy to start (at most ``start_s``)."""

    def due(self, pending: int = 0) -> float:
        """When the next read must be done: the first answer within ``grace_s``; then every byte, ``pending``
        (the chunk being read) included, by its time at the held rate from that answer, one ``slack_s``, the
        wait for the parent's copy to start, and its copy's progress at the floor rate."""
        if self.answered is None:
            return self.started + self.grace_s
        waited = self.start_s if self.starting else self.waited
        progress = 0.0 if self.claimed is None else (self.claimed + 1) * self.mean_chunk / self.floor
        return self.answered + self.slack_s + waited + (self.done + pending) / self.rate + progress

    def hold(self, held: int, now: float) -> str | None:
        """A hold notice saying the parent holds ``held`` chunks; why it is junk, or None. Progress never goes
        back, counts at least what this run delivered, and leaves a chunk to wait for."""
        if not self.sent <= held < self.chunks or (self.claimed is not None and held < self.claimed):
            return (f"a hold notice of {held} chunks held (of {self.chunks}; {self.claimed} said before, "
                    f"{self.sent} sent in this run)")
        if self.answered is None:
            self.answered = now
            self.starting = held == 0
        elif self.starting and held > 0:
            self._started(now)
        self.claimed = held
        return None

    def chunk(self, now: float) -> None:
        """A chunk's tag arrived."""
        if self.answered is None:
            self.answered = now
        elif self.starting:
            self._started(now)

    def delivered(self, nbytes: int) -> None:
        self.done += nbytes
        self.sent += 1

    def _started(self, now: float) -> None:
        assert self.answered is not None
        self.waited = min(self.start_s, now - self.answered)
        self.starting = False
