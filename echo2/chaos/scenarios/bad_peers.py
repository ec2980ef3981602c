"""Chaos scenario 3 (an attacker): a peer holding a launched actor's credentials serves corrupted chunks and
chunks of another version, and the store holds a truncated shard; nothing bad may be loaded."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, bad_loads, result_row


class HostilePeer:
    """A relay peer in the run that answers every chunk request with bytes of the right length and the wrong
    content: flipped bits of what the store holds, or the chunk of another version. Played by the harness as
    an attacker holding one launched actor's credentials (``actor_id``): it writes that actor's peer record
    (``peers/<actor_id>.json``, which the actor's scoped credentials may write) with its own url, more often
    than the actor's heartbeat does, so the plans that put that actor above another send the other to it.
    A peer under a name the fleet never launched is never planned (``topology.LaunchedActors``)."""

    BEAT_S = 0.2
    """Ten times as often as the actors' heartbeat (broadcast.heartbeat_s, 2 s)."""
    WATCH_S = 0.01
    """How often the attacker looks at the record: the actor also rewrites it after every fetch, and a learner
    planning just then would read the actor's own url, so the attacker puts its own back at once (within this)
    whenever the record is not its own. The record is nearly always the attacker's."""

    def __init__(self, run_dir: Path, actor_id: str):
        import asyncio

        self.run_dir, self.actor_id = run_dir, actor_id
        self.answered = 0
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        threading.Thread(target=self._beat, daemon=True).start()

    async def _serve(self) -> str:
        from aiohttp import web

        async def health(_request):
            return web.json_response({"versions": []})

        app = web.Application()
        app.router.add_get("/v1/health", health)
        app.router.add_get("/v1/versions/{version}/chunks/{index}", self._chunk)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _chunk(self, request):
        from aiohttp import web

        from echo2.data.manifest import chunk_table

        version, index = int(request.match_info["version"]), int(request.match_info["index"])
        self.answered += 1
        try:
            manifest = json.loads((self.run_dir / "policy" / f"v{version:06d}" / "manifest.json").read_text())
            chunk = chunk_table(manifest)[index]
            data = (self.run_dir / "policy" / f"v{version:06d}" / chunk.file).read_bytes()[chunk.offset:
                                                                                       chunk.offset + chunk.size]
        except (OSError, ValueError, IndexError):
            return web.Response(status=404)
        if self.answered % 2:  # flipped bits
            data = bytes(b ^ 0x5A for b in data)
        else:  # the same chunk of an older version, cut or padded to the size asked for
            older = sorted(p for p in (self.run_dir / "policy").glob("v*/shard-*.safetensors")
                           if p.parent.name < f"v{version:06d}")
            source = older[-1].read_bytes() if older else bytes(len(data))
            data = (source[chunk.offset:chunk.offset + chunk.size] + bytes(chunk.size))[: chunk.size]
        if "run" in request.query:  # a streamed run (``broadcast/protocol.py``): the tag, then the bad bytes, so the
            # child's hash check (not the protocol's framing) is what catches it
            from echo2.broadcast.protocol import TAG_CHUNK

            data = TAG_CHUNK + data
        return web.Response(body=data, content_type="application/octet-stream")

    def _beat(self) -> None:
        import os

        peers = self.run_dir / "peers"
        written = 0.0
        while not self._stop.wait(self.WATCH_S):
            try:
                ours = json.loads((peers / f"{self.actor_id}.json").read_text()).get("url") == self.url
            except (OSError, ValueError, AttributeError):
                ours = False
            if ours and time.monotonic() - written < self.BEAT_S:
                continue
            record = {"id": self.actor_id, "url": self.url, "version": None, "heartbeat": time.time()}
            try:
                peers.mkdir(parents=True, exist_ok=True)
                tmp = peers / f".{self.actor_id}.hostile"
                tmp.write_text(json.dumps(record))
                os.replace(tmp, peers / f"{self.actor_id}.json")  # whole, as the store's put_pointer writes it
                written = time.monotonic()
            except OSError:
                pass

    def stop(self) -> None:
        import asyncio

        self._stop.set()
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def _truncated_shard_is_never_loaded(workdir: Path) -> tuple[bool, str]:
    """A version whose shard the store lost the tail of (its manifest intact) is refused chunk by chunk; the
    receiver keeps the version it had and takes the next good one. In process, with the real receiver."""
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from echo2.broadcast.receiver import PolicyReceiver
    from echo2.config import BroadcastConfig, Config
    from echo2.data import layout
    from echo2.data.relay_tokens import mint
    from echo2.data.run_folder import create_run
    from echo2.data.run_key import public_key_of
    from echo2.data.store import open_store
    from echo2.data.weights import publish_version

    key = Ed25519PrivateKey.generate()
    store = open_store(str(workdir / "truncated" / "runs" / "t"))
    create_run(store, "t", Config.model_validate({"run": {"id": "t"}}).model_dump(mode="json"), key=key,
               echo2_version="chaos")
    publish_version(store, 0, {"w": torch.zeros(50_000)}, extra_files={}, shard_mb=1, key=key)
    receiver = PolicyReceiver(store, "a1", public_key_of(store.get_json(layout.RUN_JSON)),
                              mint(key, "t", "a1", time.time() + 600), BroadcastConfig(mode="store"), staleness=2,
                              run_id="t")
    try:
        def until(version, seconds=20):
            deadline = time.time() + seconds
            while time.time() < deadline:
                got = receiver.poll()
                if got is not None and got.version == version:
                    return got
                time.sleep(0.05)
            return None

        if until(0) is None:
            return False, "version 0 never arrived"
        publish_version(store, 1, {"w": torch.ones(50_000)}, extra_files={}, shard_mb=1, key=key)
        shard = next(k for k in store.list(layout.policy_dir(1)) if k.endswith(".safetensors"))
        store.put(shard, store.get(shard)[:-4096], if_absent=False)  # the tail lost after the commit
        time.sleep(3)
        receiver.poll()
        if receiver.current != 0:
            return False, f"the receiver moved to v{receiver.current} from a truncated shard"
        publish_version(store, 2, {"w": torch.full((50_000,), 2.0)}, extra_files={}, shard_mb=1, key=key)
        got = until(2)
        ok = got is not None and receiver.current == 2
        return ok, "truncated v1 refused, v0 kept, then v2 taken" if ok else "v2 never arrived"
    finally:
        receiver.close()


def launched_actors(run_dir: Path) -> list[str]:
    """The actors the fleet launched in a run on a local store, from its ledger's ``launch`` events."""
    out = []
    for path in sorted((run_dir / "ledger" / "events").glob("*.json")):
        try:
            event = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(event, dict) and event.get("kind") == "launch" and event.get("actor_id") not in out:
            out.append(str(event["actor_id"]))
    return out


def most_often_a_parent(actors: list[str], versions: range, *, fanout: int = 1, roots: int = 1) -> str:
    """The actor that the relay's hash order (``topology.order``) makes a parent of another in the most of
    ``versions``: whose credentials the attacker of ``bad_peers`` holds, so that in a short run some actor is
    sent to it (in a chain of two, any one actor is the root of about half the versions, none of them in a
    run of six with probability 1/64: the scenario would pass without its attack)."""
    from echo2.broadcast.topology import order

    def parent_in(actor: str, version: int) -> bool:  # node k's first child is k * fanout + roots (parent_index)
        return order(actors, version).index(actor) * fanout + roots < len(actors)

    return max(actors, key=lambda a: (sum(parent_in(a, v) for v in versions), a))


def bad_peers(workdir: Path, quick: bool = False) -> dict:
    """A peer in the relay serving corrupted chunks and chunks of another version, inside a real run with two
    relaying actors: an attacker holding one launched actor's credentials (``HostilePeer``); and a shard
    truncated in the store after its version was committed. The row is broken if the hostile peer served no
    chunk: then no actor was sent to it, and the attack did not happen."""
    model = h.tiny_model(workdir)
    run_dir = workdir / "runs" / "peers"
    steps, actors = (6 if quick else 12), 2
    hostile: list[HostilePeer] = []

    def inject(_proc):
        if not hostile and len(launched := launched_actors(run_dir)) == actors:
            hostile.append(HostilePeer(run_dir, most_often_a_parent(launched, range(1, steps + 1))))

    code = h.run_cli(["run", h.QUICKSTART, *h.sets(f"model.name={model}", f"store.url={workdir}", "run.id=peers",
                                                  *h.TINY, f"fleet.actors={actors}", f"train.max_steps={steps}",
                                                  "broadcast.chunk_mb=0.01", "broadcast.pipeline_wait_s=2")],
                     workdir, workdir / "peers.log", timeout=900, while_running=inject)
    answered = hostile[0].answered if hostile else 0
    if hostile:
        hostile[0].stop()
    row = audit_row("bad-peers", run_dir, code)
    who = f"{hostile[0].actor_id} at {hostile[0].url}" if hostile else "the hostile peer"
    left = sum(log.read_text(errors="replace").count(f"leaving {who} ") for log in (run_dir / "logs").glob("*.log"))
    truncated, how = _truncated_shard_is_never_loaded(workdir)
    broken = [] if answered else [f"{who} served no chunk: no actor was sent to it, so its attack did not happen"]
    return result_row("bad-peers", injected=answered + 1, detected=(answered if left else 0) + truncated,
                lost=row["lost"], bad_loaded=bad_loads(run_dir), finished=row["finished"],
                leaks=h.leaks(workdir, [run_dir]), broken=broken,
                detail=f"{answered} bad chunks served by {who} (the credentials of a launched actor); the actors "
                       f"left it {left} times (a fetch falls back to the store at the first bad chunk); {how}")
