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

The rate a parent is held to (``min_rate_mbit``): ``min_rate_fraction`` of the lesser of what the parent
can give this child (its share of its measured upload as the signed plan carries it: ``up_mbit`` over its
children) and what the child needs (the version's bytes over the time between the learner's versions, as
the receiver observes it), never below ``floor_mbit``, so a stalling parent is left even when nothing is
known. A parent of unknown rate to a child of unknown need is held to the floor alone: a 30 Mbit/s peer
is not "unhealthy" for missing a fixed 200 Mbit/s figure, and a fast peer is held to the rate it
measured. What a parent delivered earlier in the same fetch is not used: in a stream a chunk's bytes may
already wait in the socket when its tag is read, so one chunk's time can show memory speed, not the
link's. The rates are self-reported and untrusted: a parent that claims more than it gives is only held
to more (and left sooner), and the child's need caps what any claim can demand.
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
        self._streams: dict[int, list] = {}  # id -> [transport, bytes handed over, bytes that left, closed]
        self._ticker: asyncio.Task | None = None

    def open(self, key: int, transport) -> None:
        self._streams[key] = [transport, 0, 0, False]
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

    def _account(self) -> tuple[int, bool]:
        """Bytes that left since the last look, and whether anything is still queued."""
        left, queued = 0, False
        for key, entry in list(self._streams.items()):
            transport, written, counted, closed = entry
            gone = max(counted, written - queued_bytes(transport))
            left += gone - counted
            entry[2] = gone
            if gone < written:
                queued = True
            elif closed:
                del self._streams[key]
        return left, queued

    async def _tick(self) -> None:
        last = time.monotonic()
        period, was_queued = [0, 0.0], False
        while self._streams:
            await asyncio.sleep(UPLOAD_TICK_S)
            now = time.monotonic()
            left, queued = self._account()
            if left or was_queued:
                period[0] += left
                period[1] += now - last
            if not queued and period[0]:
                self.meter.add(*period)
                period = [0, 0.0]
            was_queued, last = queued, now
        if period[0]:
            self.meter.add(*period)


def min_rate_mbit(*, fraction: float, floor_mbit: float, parent_mbit: float | None,
                  need_mbit: float | None) -> float:
    """The rate below which a parent's chunk is too slow (module docstring)."""
    known = [r for r in (parent_mbit, need_mbit) if r is not None and math.isfinite(r) and r > 0]
    if not known:
        return floor_mbit
    return max(floor_mbit, fraction * min(known))
