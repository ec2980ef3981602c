"""Wide-area links for the broadcast benchmark: a delaying TCP forwarder, uplink mixes, and a lower bound.

Propagation delay. This kernel has no ``netem``, so every node that serves (the origin playing the store,
and every receiver's relay) listens behind a ``DelayForwarder`` in its own network namespace: the
forwarder accepts a child's connection, opens one to the real server on loopback, and releases the
bytes of each direction ``rtt/2`` after they arrived (in order). A request and its answer thus pay one
round trip, as over a path of that RTT; the answer's bytes then leave through the node's ``tc tbf``
uplink as before (delay then shaping of one FIFO equals shaping then delay). A new connection's first
bytes are also held one round trip more (the TCP handshake). What it does not model: the two TCP
connections each side of the forwarder see a sub-millisecond RTT, so TCP's own window, slow start and
loss recovery over a long path are not paid (a real long path needs its window to cover bandwidth x
delay; here only the application's own round trips show); no loss, no jitter, no reordering; the
forwarder buffers at most ``MAX_BUFFERED`` bytes per direction (then stops reading: back-pressure,
as a full window would); and the delay sits on the serving side only, so it is the same for every
pair of nodes (one RTT for all paths, not a geography).

Uplinks: a list of rates in Mbit/s cycled over the receivers (``uplinks``), or a named mix
(``MIXES``). Downlinks are not shaped (the veth carries what the CPUs can): the lower bound takes them
as unbounded unless given.

Lower bound (``lower_bound_s``): a payload of ``M`` bits, a source (the store) with uplink ``u_0``, and
N receivers with uplinks ``u_i`` and downlinks ``d_i``. No schedule, however the payload is cut and
routed (fluid: infinitely small pieces, no protocol overhead), finishes before

    T* = rtt + max(M / u_0, max_i M / d_i, N M / (u_0 + sum_i u_i))

- every bit must leave the source once, at most ``u_0`` bits/s;
- receiver i must take in all ``M`` bits, at most ``d_i`` bits/s;
- the N M bits the receivers take in are all sent by some uplink, at most ``u_0 + sum u_i`` bits/s
  together (the P2P file-distribution bound of Kumar and Ross, 2006, which a fluid schedule reaches);
- plus one round trip: in this harness a node sends only what was asked of it, and every receiver is
  told to start at the same instant, so no uplink carries anything before a request has travelled
  ``rtt/2``, and a bit sent later than ``rtt/2`` before the end arrives too late.

Real TCP/IP headers (~3-5 % of a tbf-shaped link) and chunking are not counted, so a measured tail
can come near the bound but not reach it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from echo2.errors import Echo2InputError

MIXES: dict[str, list[float]] = {
    "wan": [25.0, 100.0, 200.0, 1000.0],  # the mixed fleet: home, small cloud, cloud, big cloud
    "home": [20.0, 25.0, 50.0, 100.0],  # consumer GPUs at home
    "cloud": [200.0, 1000.0, 2000.0, 10000.0],  # cloud VMs (10 Gbit/s is beyond what Python relays here carry)
}
MAX_MBIT = 100_000.0
MAX_BUFFERED = 8 * 2**20
"""Bytes a forwarder holds per direction of a connection before it stops reading from the sender."""
READ_BYTES = 256 * 2**10


def parse_uplinks(text: str | None) -> list[float] | None:
    """``"25,100,200,1000"`` or a mix name (``MIXES``) -> rates in Mbit/s; None/"" -> None (uniform links)."""
    if text is None or not text.strip():
        return None
    if text.strip() in MIXES:
        return list(MIXES[text.strip()])
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise Echo2InputError(f"--uplinks {text!r}: {part.strip()!r} is neither a rate in Mbit/s nor a mix "
                                  f"({', '.join(MIXES)})") from None
        if not 0 < rate <= MAX_MBIT:  # also refuses nan and inf
            raise Echo2InputError(f"--uplinks {text!r}: {rate:g} Mbit/s is not in (0, {MAX_MBIT:g}]")
        rates.append(rate)
    return rates


def cycle(rates: list[float], n: int) -> list[float]:
    """``rates`` repeated over ``n`` nodes."""
    return [rates[i % len(rates)] for i in range(n)]


def lower_bound_s(size_bytes: int, source_mbit: float, uplinks_mbit: list[float],
                  downlinks_mbit: list[float | None] | None = None, rtt_ms: float = 0.0) -> float:
    """The time no schedule can beat (module docstring): ``size_bytes`` from a source of ``source_mbit`` to
    one receiver per entry of ``uplinks_mbit``; a downlink of None is unbounded."""
    bits = size_bytes * 8
    n = len(uplinks_mbit)
    if n == 0:
        return 0.0
    terms = [bits / (source_mbit * 1e6), n * bits / ((source_mbit + sum(uplinks_mbit)) * 1e6)]
    terms += [bits / (d * 1e6) for d in downlinks_mbit or [] if d is not None]
    return rtt_ms / 1000 + max(terms)


class DelayForwarder:
    """Listens on (host, port) and forwards every connection to (target_host, target_port), releasing each
    direction's bytes ``delay_s`` after they arrived, and a connection's first request bytes no earlier than
    one round trip after it was accepted (the handshake). Runs its own event loop in a daemon thread, so it
    sits beside a server in the same process and dies with it."""

    def __init__(self, host: str, port: int, target_host: str, target_port: int, delay_s: float):
        if not 0 <= delay_s <= 10:
            raise Echo2InputError(f"one-way delay {delay_s!r} s is not in [0, 10]")
        self.host, self.port = host, port
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="echo2-delay", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> int:
        """Start listening; returns the port (useful with port 0)."""
        self._thread.start()

        async def listen() -> int:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
            return self._server.sockets[0].getsockname()[1]

        self.port = asyncio.run_coroutine_threadsafe(listen(), self.loop).result(10)
        return self.port

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        accepted = self.loop.time()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:  # the server behind is gone: the child sees its connection closed, as a dead node's
            writer.transport.abort()
            return
        pipes = [asyncio.ensure_future(self._pipe(reader, up_writer, not_before=accepted + 2 * self.delay_s)),
                 asyncio.ensure_future(self._pipe(up_reader, writer))]
        try:
            done, _ = await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
            if any(p.exception() for p in done if not p.cancelled()):  # a reset one side: reset the other
                writer.transport.abort()
                up_writer.transport.abort()
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            for p in pipes:
                p.cancel()
            writer.close()
            up_writer.close()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, not_before: float = 0.0) -> None:
        """Copy ``src`` to ``dst``, each block released ``delay_s`` after it arrived (not before
        ``not_before`` + ``delay_s``); end of stream is passed on the same way."""
        queue: deque[tuple[float, bytes]] = deque()
        ready = asyncio.Event()
        room = asyncio.Event()
        held = 0

        async def release() -> None:
            nonlocal held
            while True:
                while not queue:
                    ready.clear()
                    await ready.wait()
                at, data = queue.popleft()
                if (wait := at - self.loop.time()) > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    await dst.drain()
                    return
                dst.write(data)
                await dst.drain()
                held -= len(data)
                room.set()

        sender = asyncio.ensure_future(release())
        try:
            while True:
                data = await src.read(READ_BYTES)
                queue.append((max(self.loop.time(), not_before) + self.delay_s, data))
                held += len(data)
                ready.set()
                if not data:
                    break
                while held > MAX_BUFFERED:
                    room.clear()
                    await room.wait()
            await sender
        finally:
            sender.cancel()

