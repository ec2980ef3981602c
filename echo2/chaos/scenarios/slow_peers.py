"""Chaos scenario ``slow-peers``: two actors holding launched actors' credentials slow the relay down without
ever sending a bad byte, and the versions must still reach every honest actor about as fast as without them.

The attackers, played by the harness:

* ``JustInTimePeer`` claims the largest uplink a peer record may (``topology.MAX_RATE_MBIT``) and answers every
  chunk of a run whole and correct, each just before the deadline a child used to give every chunk anew
  (``pipeline_wait_s`` + ``answer_grace_s`` after the one before); such a peer used to be never left nor
  reported, and by its claim its site's only root, so the whole site moved at one chunk per hold;
* ``NonReader`` asks every honest peer of each version's plan for a run of the whole version and never reads
  it, which used to pin each version in every peer it asked.

The run is in process (the real learner's ``Publisher``, real receivers with their relays over loopback, a
local store), twice side by side: the same honest actors without the attackers, then with them. Each version
is published once every honest actor holds the one before, so the time every honest actor took to get all
versions is the dissemination's alone. The row: ``injected`` the two attackers; ``detected`` each one both
reported (the just-in-time peer in an honest actor's ``failed_parents``; the non-reader named in an honest
relay's log) and left (the first planned at no honest actor's parent by the end; every stream the second
opened cut or refused). ``broken``: the attack did not happen (the first served no run, the second got no
stream), the versions took more than twice the no-attack time to reach every honest actor, or an honest
actor's relay held more than one version's bytes more than without the attackers (the ``VersionBuffer``s
still alive, counted after each version). ``bad_loaded``: versions handed over whose files do not match the
signed manifest. ``quick``: the size ``tests/e2e/test_chaos_slow_peers.py`` runs.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import queue
import socket
import threading
import time
import weakref
from pathlib import Path

from echo2.chaos.rows import result_row

HONEST = ("h0", "h1", "h2", "h3", "h4", "h5", "h6", "h7")
NON_READER = "x-nonreader"
"""Not a peer of any plan (it writes no peer record): a joiner, as far as the relays can tell."""
LOOPBACK = {"pipeline_wait_s": 2.0, "answer_grace_s": 0.5}
"""The relay's waits sized for one machine's loopback, where an honest parent answers within milliseconds (what
``bad-peers`` does for its holds): a peer that never answers then costs its children half a second, not the two
seconds a wide-area round trip needs."""


def liar_name(honest: list[str], version: int) -> str:
    """A name the version's hash order (``topology.order``) puts right under the root: a parent of honest actors
    whatever the rates say of it, so that the attack happens with and without claims counting."""
    from echo2.broadcast.topology import order

    return next(f"a-liar{k}" for k in range(10_000) if order([*honest, f"a-liar{k}"], version)[1] == f"a-liar{k}")


class JustInTimePeer:
    """The first attacker (module docstring), on a loop of its own. ``asked``: runs asked of it; ``sent``: chunks
    it sent."""

    def __init__(self, store, actor_id: str, hold_s: float):
        from echo2.broadcast import topology

        self.store, self.actor_id, self.hold_s = store, actor_id, hold_s
        self.asked = self.sent = 0
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self.url = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        topology.register(store, actor_id, self.url, None, up_mbit=topology.MAX_RATE_MBIT,
                          down_mbit=topology.MAX_RATE_MBIT)

    async def _serve(self) -> str:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/v1/versions/{version}/chunks/{index}", self._chunk)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _chunk(self, request):
        from aiohttp import web

        from echo2.broadcast.protocol import TAG_CHUNK
        from echo2.data import layout
        from echo2.data.manifest import chunk_table

        version, index = int(request.match_info["version"]), int(request.match_info["index"])
        self.asked += 1
        try:
            manifest = self.store.get_json(layout.manifest_key(layout.policy_dir(version)))
        except Exception:  # noqa: BLE001 - collected meanwhile: the honest 404
            return web.Response(status=404)
        chunks = chunk_table(manifest)[index: index + max(1, int(request.query.get("run", "1")))]
        resp = web.StreamResponse()
        try:
            await resp.prepare(request)
            for chunk in chunks:  # each whole and correct, just before the deadline a chunk used to get
                await asyncio.sleep(self.hold_s)
                try:
                    data = self.store.get_range(f"{layout.policy_dir(version)}/{chunk.file}", chunk.offset,
                                                chunk.offset + chunk.size)
                except Exception:  # noqa: BLE001 - the version was collected meanwhile: the run ends
                    break
                await resp.write(TAG_CHUNK)
                await resp.write(data)
                self.sent += 1
            await resp.write_eof()
        except (ConnectionError, OSError):  # the child left it: what the fix is about
            pass
        return resp

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


class NonReader:
    """The second attacker (module docstring), on a thread of its own: for each manifest handed to it (``attack``)
    it opens one run of the whole version at every honest peer of the plan, reads the status line and nothing
    more. ``streams``: the sockets that got a 200; ``refused``: requests answered otherwise."""

    def __init__(self, token: str, skip: set[str]):
        self.token, self.skip = token, skip
        self.streams: list[socket.socket] = []
        self.refused = 0
        self._todo: queue.Queue[dict | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def attack(self, manifest: dict) -> None:
        self._todo.put(manifest)

    def _run(self) -> None:
        while (manifest := self._todo.get()) is not None:
            for peer in manifest.get("relay", {}).get("peers", []):
                if peer["id"] not in self.skip:
                    self._ask(peer["url"], manifest)

    def _ask(self, url: str, manifest: dict) -> None:
        from echo2.data.manifest import chunk_table

        host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(10)
        try:
            sock.connect((host, int(port)))
            sock.sendall(f"GET /v1/versions/{manifest['version']}/chunks/0?run={len(chunk_table(manifest))} "
                         f"HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.token}\r\n\r\n".encode())
            head = b""
            while b"\r\n" not in head and (part := sock.recv(1)):
                head += part
            ok = head.split()[1:2] == [b"200"]
        except OSError:
            ok = False
        if ok:
            self.streams.append(sock)
        else:
            self.refused += 1
            sock.close()

    def finish(self) -> None:
        """Every manifest handed over asked for (a failure bound of a minute)."""
        self._todo.put(None)
        self._thread.join(timeout=60)

    def close(self) -> None:
        self.finish()
        for sock in self.streams:
            sock.close()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _held_bytes(refs: list[weakref.ref]) -> int:
    """Bytes of the chunks held by the buffers of ``refs`` still alive (pruning the dead)."""
    alive = [r for r in refs if r() is not None]
    refs[:] = alive
    return sum(len(d) for r in alive if (b := r()) is not None for d in b.data if d is not None)


def _phase(folder: Path, *, attack: bool, honest: list[str], versions: int, elements: int, bound_s: float) -> dict:
    """One run of ``versions`` versions to ``honest`` receivers (with the attackers where ``attack``): the seconds
    each version took to reach every honest actor, the most bytes each honest relay held, what the attackers
    did and what was seen of it."""
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from echo2.broadcast.receiver import PolicyReceiver
    from echo2.config import BroadcastConfig, PublishConfig, TrainConfig
    from echo2.data.ledger import write_event
    from echo2.data.relay_tokens import mint
    from echo2.data.store import open_store
    from echo2.learner.publisher import Publisher

    store = open_store(str(folder / "store"))
    key, run_id = Ed25519PrivateKey.generate(), folder.name
    broadcast = BroadcastConfig(mode="relay", fanout=1, roots=1, heartbeat_s=0.1, peer_timeout_s=3600,
                                min_chunk_mb=1 / 16, **LOOPBACK)
    liar = liar_name(honest, 1) if attack else None
    for actor in [*honest, *([liar, NON_READER] if attack else [])]:
        write_event(store, "launch", actor)
    receivers = {a: PolicyReceiver(store, a, key.public_key(), mint(key, run_id, a, time.time() + 3600), broadcast,
                                   staleness=2, run_id=run_id) for a in honest}
    broadcast_keep = receivers[honest[0]].node.server.keep_versions
    held: dict[str, list[weakref.ref]] = {a: [] for a in honest}
    for actor, receiver in receivers.items():  # every version a relay takes, followed while it lives
        add = receiver.node.server.add
        receiver.node.server.add = lambda buffer, add=add, refs=held[actor]: (refs.append(weakref.ref(buffer)),
                                                                             add(buffer))[1]
    hold_s = broadcast.pipeline_wait_s + broadcast.answer_grace_s - 0.1  # just before a chunk's old deadline
    jit = JustInTimePeer(store, liar, hold_s) if attack else None
    reader = NonReader(mint(key, run_id, NON_READER, time.time() + 3600), {liar}) if attack else None
    lines, relay_log = _Lines(), logging.getLogger("echo2.relay")
    level = relay_log.level
    relay_log.addHandler(lines)
    relay_log.setLevel(logging.WARNING if relay_log.getEffectiveLevel() > logging.WARNING else level)
    publisher = Publisher(store, train=TrainConfig(), publish=PublishConfig(keep_versions=2), broadcast=broadcast,
                          key=key, extra_files={})
    out = {"seconds": [], "peak": dict.fromkeys(honest, 0), "bad": 0, "version_bytes": elements * 4, "plans": []}
    try:
        for version in range(1, versions + 1):
            manifest, _ = publisher.publish(version, {"w": torch.full((elements,), float(version))},
                                            {"weights": "full"})
            out["plans"].append(manifest["relay"])
            started, waiting = time.monotonic(), set(honest)
            if reader is not None:
                reader.attack(manifest)
            while waiting and time.monotonic() - started < bound_s:  # each receiver polls, as its actor would
                for actor in sorted(waiting):
                    if (buf := receivers[actor].poll()) is not None and buf.version == version:
                        files = buf.files()
                        out["bad"] += any(hashlib.sha256(files.get(e["name"], b"")).hexdigest() != e["sha256"]
                                          for e in manifest["files"])
                        waiting.discard(actor)
                time.sleep(0.01)
            out["seconds"].append(time.monotonic() - started)
            if waiting:
                out["late"] = f"v{version} had not reached {', '.join(sorted(waiting))} after {bound_s:.0f} s"
                break
            most = (broadcast_keep + 1) * out["version_bytes"]  # the relay's versions, and one in flight
            if any(_held_bytes(held[a]) > most for a in honest):
                gc.collect()  # what is then still alive is held by something (a full collection takes a while)
            for actor in honest:
                out["peak"][actor] = max(out["peak"][actor], _held_bytes(held[actor]))
        if attack:
            reader.finish()

            def serving() -> int:  # the non-reader's streams the honest relays still answer
                return sum(r.node.server.streams_of(NON_READER) for r in receivers.values())

            deadline = time.monotonic() + bound_s  # until every one is cut or ended (a failure bound)
            while serving() and time.monotonic() < deadline:
                time.sleep(0.05)
            records = {a: store.get_json(f"peers/{a}.json") for a in honest}
            out.update(liar=liar, asked=jit.asked, sent=jit.sent, streams=len(reader.streams), refused=reader.refused,
                       serving=serving(),
                       liar_reported=sorted(a for a, r in records.items() if liar in r.get("failed_parents", {})),
                       liar_children=[p["id"] for p in out["plans"][-1]["peers"] if p.get("parent") == liar],
                       nonreader_logged=sum(NON_READER in line for line in lines.lines))
    finally:
        relay_log.removeHandler(lines)
        relay_log.setLevel(level)
        if reader is not None:
            reader.close()
        if jit is not None:
            jit.stop()
        for receiver in receivers.values():
            receiver.close()
    return out


def slow_peers(workdir: Path, quick: bool = False) -> dict:
    """The scenario (module docstring): the no-attack run, then the attacked one, judged side by side."""
    honest = list(HONEST[: 4 if quick else 8])
    versions, elements = (20, 2**21) if quick else (60, 2**22)  # 8 MB or 16 MB versions (float32)
    size = dict(honest=honest, versions=versions, elements=elements, bound_s=60.0)
    base = _phase(workdir / "no-attack", attack=False, **size)
    hit = _phase(workdir / "attack", attack=True, **size)
    t_base, t_hit = sum(base["seconds"]), sum(hit["seconds"])
    grown = {a: hit["peak"][a] - base["peak"][a] for a in honest}
    version_bytes = base["version_bytes"]
    broken = [out["late"] for out in (base, hit) if "late" in out]
    finished = not broken
    if finished and t_hit > 2 * t_base:
        broken.append(f"the versions took {t_hit:.1f} s to reach every honest actor, over twice the {t_base:.1f} s "
                      f"without the attackers")
    if any(g > version_bytes for g in grown.values()):
        broken.append(f"an honest relay held more than one version more than without the attackers: {grown} bytes "
                      f"(a version: {version_bytes})")
    if hit.get("asked", 0) == 0:
        broken.append("no honest actor asked the just-in-time peer for a run: its attack did not happen")
    if hit.get("streams", 0) == 0:
        broken.append("no honest relay gave the non-reader a stream: its attack did not happen")
    liar_caught = bool(hit.get("liar_reported")) and not hit.get("liar_children", [None])
    nonreader_caught = hit.get("nonreader_logged", 0) > 0 and hit.get("serving") == 0
    return result_row(
        "slow-peers", injected=2, detected=int(liar_caught) + int(nonreader_caught), finished=finished,
        bad_loaded=base["bad"] + hit["bad"], broken=broken, seconds_no_attack=round(t_base, 2),
        seconds_attack=round(t_hit, 2), held_growth=grown,
        detail=f"{len(honest)} honest actors, {versions} versions of {version_bytes / 2**20:.0f} MB: every honest "
               f"actor had them in {t_hit:.1f} s with the attackers against {t_base:.1f} s without "
               f"({t_hit / max(t_base, 1e-9):.2f}x); the just-in-time peer {hit.get('liar')} was asked for "
               f"{hit.get('asked', 0)} runs and sent {hit.get('sent', 0)} chunks, reported by "
               f"{', '.join(hit.get('liar_reported', [])) or 'nobody'}, parent of "
               f"{', '.join(hit.get('liar_children', [])) or 'nobody'} at the end; the non-reader got "
               f"{hit.get('streams', 0)} streams ({hit.get('serving')} still served at the end) and "
               f"{hit.get('refused', 0)} refusals, named in {hit.get('nonreader_logged', 0)} relay warnings; most "
               f"bytes an honest relay held beyond the no-attack run: {max(grown.values()) / 2**20:.1f} MB")
