"""Shared by the tests: moved out of test_relay_wan.py (which imports them back) so other test modules import
them from here, not from a test module."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

from relay_helpers import KEY, TOKEN, auth, slow_store_reader

from echo2.broadcast.protocol import FetchPolicy
from echo2.broadcast.relay_node import RelayNode
from echo2.data.manifest import chunk_hashes, sign

BLOCK = 64 * 1024


class DelayingForwarder:
    """A delaying, rate-shaping TCP forwarder on 127.0.0.1 in front of ``target_port`` (module docstring)."""

    def __init__(self, target_port: int, delay_s: float, rate_mbit: float | None = None,
                 buffer_bytes: int = 256 * 1024):
        self.target_port, self.delay_s = target_port, delay_s
        self.rate_mbit, self.buffer_bytes = rate_mbit, buffer_bytes
        self._free_at = 0.0  # when the shaped uplink (server -> client) is free again
        self._conns: list[asyncio.StreamWriter] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.close()  # refused behind us: the client sees its connection end
            return
        sock = server_w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BLOCK)  # the sender feels the bottleneck
        self._conns += [client_w, server_w]
        await asyncio.gather(self._pump(client_r, server_w, shaped=False),
                             self._pump(server_r, client_w, shaped=True), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, shaped: bool) -> None:
        """Bytes from ``reader`` to ``writer``, each block released ``delay_s`` after it arrived (the delay line
        holds what is in flight, as a long path does); shaped, also no sooner than the uplink has sent it,
        and reading stops while the uplink's backlog exceeds ``buffer_bytes`` (the sender feels it)."""
        queue: asyncio.Queue[tuple[bytes, float]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def send() -> None:
            while True:
                data, at = await queue.get()
                if (wait := at - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                if shaped and self.rate_mbit:
                    backlog_s = self._free_at - loop.time() - self.buffer_bytes * 8 / (self.rate_mbit * 1e6)
                    if backlog_s > 0:
                        await asyncio.sleep(backlog_s)
                data = await reader.read(BLOCK)
                now = loop.time()
                release = now + self.delay_s
                if shaped and self.rate_mbit and data:
                    self._free_at = max(now, self._free_at) + len(data) * 8 / (self.rate_mbit * 1e6)
                    release = self._free_at + self.delay_s
                queue.put_nowait((data, release))
                if not data:
                    break
            await sender
        except (OSError, asyncio.CancelledError):
            sender.cancel()
            writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for w in self._conns:
                w.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:  # the pumps end here, not in a garbage-collected loop
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def big_chunked_version(store, size: int, chunk: int):
    """A signed version 1 of one shard of ``size`` bytes in chunks of ``chunk`` bytes."""
    data = os.urandom(size)
    store.put("policy/v000001/shard-0000.safetensors", data)
    entry = {"name": "shard-0000.safetensors", "kind": "shard", "size": size, "chunks": chunk_hashes(data, chunk)}
    return sign({"version": 1, "chunk_size": chunk, "files": [entry]}, KEY), {entry["name"]: data}


def seeded(store, manifest, files):
    node = RelayNode(TOKEN, auth(), slow_store_reader(store, 0), policy=FetchPolicy(pipeline_wait_s=10))
    node.seed(manifest, files)
    return node
