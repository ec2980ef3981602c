"""Chaos scenarios of an attacker: hostile peers, forged versions and requests, hostile rollout files,
dishonest actors, and the relay's TLS against an intruder whose credentials were revoked."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, bad_loads, result_row


# -- 3. hostile peers and a truncated shard ------------------------------------------------------------
class HostilePeer:
    """A relay peer in the run that answers every chunk request with bytes of the right length and the wrong
    content: flipped bits of what the store holds, or the chunk of another version. Played by the harness as
    an attacker holding one launched actor's credentials (``actor_id``): it writes that actor's peer record
    (``peers/<actor_id>.json``, which the actor's scoped credentials may write) with its own url, more often
    than the actor's heartbeat does, so the plans that put that actor above another send the other to it.
    A peer under a name the fleet never launched is never planned (``topology.LaunchedActors``)."""

    BEAT_S = 0.2
    """Ten times as often as the actors' heartbeat (broadcast.heartbeat_s, 2 s): the record is nearly always the attacker's."""

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
            older = sorted(p for p in (self.run_dir / "policy").glob("v*/shard-*.safetensors") if p.parent.name < f"v{version:06d}")
            source = older[-1].read_bytes() if older else bytes(len(data))
            data = (source[chunk.offset:chunk.offset + chunk.size] + bytes(chunk.size))[: chunk.size]
        return web.Response(body=data, content_type="application/octet-stream")

    def _beat(self) -> None:
        import os

        while not self._stop.wait(self.BEAT_S):
            record = {"id": self.actor_id, "url": self.url, "version": None, "heartbeat": time.time()}
            peers = self.run_dir / "peers"
            try:
                peers.mkdir(parents=True, exist_ok=True)
                tmp = peers / f".{self.actor_id}.hostile"
                tmp.write_text(json.dumps(record))
                os.replace(tmp, peers / f"{self.actor_id}.json")  # whole, as the store's put_pointer writes it
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

    from echo2.broadcast.receiver import PolicyReceiver
    from echo2.config import BroadcastConfig, Config
    from echo2.data import layout
    from echo2.data.relay_tokens import mint
    from echo2.data.run_folder import create_run
    from echo2.data.run_key import public_key_of
    from echo2.data.store import open_store
    from echo2.data.weights import publish_version
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

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


# -- 4. forged manifests and hostile relay requests ---------------------------------------------------
def _forgeries(run_dir: Path, base: int) -> dict[int, str]:
    """What an attacker with write access to the store plants as versions base+1..: an attacker's own
    signature, the learner's manifest re-signed with another key, a genuine manifest replayed under another
    version, an unsigned one. Returns {version: what}; ``_point_latest`` then moves LATEST to them."""
    import shutil

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from echo2.data.manifest import sign

    attacker = Ed25519PrivateKey.generate()
    genuine_dir = max((p for p in (run_dir / "policy").glob("v*") if (p / "manifest.json").exists()),
                      key=lambda p: p.name)
    genuine = json.loads((genuine_dir / "manifest.json").read_text())
    body = {k: v for k, v in genuine.items() if k != "signature"}
    plans = {base + 1: ("signed by another key", lambda v: sign({**body, "version": v}, attacker)),
             base + 2: ("the learner's manifest re-signed", lambda v: sign({**body, "version": v, "revoked": []}, attacker)),
             base + 3: ("a genuine manifest replayed", lambda v: genuine),
             base + 4: ("unsigned", lambda v: {**body, "version": v})}
    for version, (_, make) in plans.items():
        folder = run_dir / "policy" / f"v{version:06d}"
        shutil.copytree(genuine_dir, folder, dirs_exist_ok=True)
        (folder / "manifest.json").write_text(json.dumps(make(version)))
    return {v: what for v, (what, _) in plans.items()}


def _rejected(run_dir: Path, versions) -> set[int]:
    """The planted versions some actor's log says it rejected."""
    logs = [p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")]
    return {v for v in versions for text in logs
            if f"manifest of version {v} " in text or (f"policy/v{v:06d} " in text and "rejected" in text)}


def _hostile_requests(run_dir: Path) -> tuple[int, int, list[str]]:
    """Relay requests an outsider can make to every live actor: no token, a garbage token, a token of
    another run, a path outside the run. Returns (made, refused, tokens used)."""
    import asyncio

    import aiohttp
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from echo2.data.relay_tokens import mint

    foreign = mint(Ed25519PrivateKey.generate(), "another-run", "actor0-aaaaaa", time.time() + 600)
    headers = [{}, {"Authorization": "Bearer e2rt1.garbage.token"}, {"Authorization": f"Bearer {foreign}"}]
    paths = ["/v1/versions/0/chunks/0", "/v1/health", "/v1/versions/0/chunks/../../../run.json",
             "/../../run.json", "/v1/versions/0/chunks/%2e%2e%2f%2e%2e%2frun.json"]
    urls = []
    for record in (run_dir / "peers").glob("*.json"):
        try:
            urls.append(json.loads(record.read_text())["url"])
        except (OSError, ValueError, KeyError):
            pass

    async def ask():
        made = refused = 0
        async with aiohttp.ClientSession() as session:
            for url in urls:
                for header in headers:
                    for path in paths:
                        made += 1
                        try:
                            async with session.get(url + path, headers=header) as reply:
                                refused += reply.status in (401, 403, 404)
                        except aiohttp.ClientError:
                            refused += 1
        return made, refused

    made, refused = asyncio.run(ask())
    return made, refused, [foreign, "e2rt1.garbage.token"]


def forgeries(workdir: Path, quick: bool = False) -> dict:
    """Forged, re-signed, replayed and unsigned versions planted in a live run, and relay requests with no
    token, a wrong one or another run's, and for paths outside the run: all refused, none loaded."""
    model = h.tiny_model(workdir)
    run_dir = workdir / "runs" / "forged"
    planted: dict[int, str] = {}
    asked: list = []

    def inject(_proc):
        # the relay requests first, while both actors surely listen; then LATEST is pointed at each planted
        # version in turn, every half second, until some actor has rejected every one (the learner's own
        # publishes move LATEST back in between, as they would in a real attack)
        if not planted:
            consumed = run_dir / "ledger" / "consumed" / "step-000002.json"
            if consumed.exists() and len(list((run_dir / "peers").glob("*.json"))) >= 2:
                asked.append(_hostile_requests(run_dir))
                planted.update(_forgeries(run_dir, 100_000))
            return
        waiting = sorted(set(planted) - _rejected(run_dir, planted))
        if waiting:
            (run_dir / "policy" / "LATEST").write_text(json.dumps({"version": waiting[0]}))

    code = h.run_cli(["run", h.QUICKSTART, *h.sets(f"model.name={model}", f"store.url={workdir}", "run.id=forged",
                                                  *h.TINY, "fleet.actors=2", f"train.max_steps={40 if quick else 60}")],
                     workdir, workdir / "forged.log", timeout=900, while_running=inject)
    row = audit_row("forgeries", run_dir, code)
    rejected = _rejected(run_dir, planted)
    made, refused, tokens = asked[0] if asked else (0, 0, [])
    secret_in_logs = h.grep(list((run_dir / "logs").glob("*.log")), tokens)
    return result_row("forgeries", injected=len(planted) + made, detected=len(rejected) + refused, lost=row["lost"],
                bad_loaded=bad_loads(run_dir, set(planted)), finished=row["finished"],
                leaks=h.leaks(workdir, [run_dir]) + secret_in_logs,
                detail=f"{len(rejected)}/{len(planted)} planted versions rejected by the actors "
                       f"({', '.join(planted.values())}); {refused}/{made} hostile relay requests refused")


# -- 5. fuzzed rollout files ---------------------------------------------------------------------------
def fuzzed_rollouts(workdir: Path, quick: bool = False, n: int | None = None) -> dict:
    """At least 200 hostile rollout files committed into a live run (``fuzz.py``): each is quarantined with
    its reason (or dropped as a duplicate), and the learner keeps training."""
    from transformers import AutoTokenizer

    from echo2.chaos import fuzz
    from echo2.config import load_config
    from echo2.tasks import make_task

    n = n or (60 if quick else 240)
    model = h.tiny_model(workdir)
    run_dir = workdir / "runs" / "fuzz"
    planted: list[fuzz.Case] = []
    tok = AutoTokenizer.from_pretrained(model)
    task = make_task(load_config(None, ["task.eval_size=10"]).task)

    def inject(_proc):
        first = run_dir / "ledger" / "consumed" / "step-000001.json"
        if planted or not first.exists():
            return
        used = json.loads(first.read_text())["used"]
        latest = json.loads((run_dir / "policy" / "LATEST").read_text())["version"]
        rows = fuzz.honest(task.sample_train(random.Random(1), 2), tok, group_size=4, salt=0)
        planted.extend(fuzz.cases(n, 0, fuzz.LOCAL_KINDS, rows=rows, run_id="fuzz", version=latest, vocab=len(tok),
                                  max_file_bytes=1 << 20, used_data=(run_dir / used[0]["key"]).read_bytes()))
        for c in planted:  # a local store: no GLACIER here (hostile-store has it on S3); huge_sparse is sparse
            fuzz.plant_local(c, run_dir / "rollouts" / f"v{c.version:06d}" / f"{c.actor}-000000.arrow")

    code = h.run_cli(["run", h.QUICKSTART, *h.sets(f"model.name={model}", f"store.url={workdir}", "run.id=fuzz",
                                                  *h.TINY, "train.max_steps=8", "train.max_rollout_file_mb=1")],
                     workdir, workdir / "fuzz.log", timeout=900, while_running=inject)
    row = audit_row("fuzzed-rollouts", run_dir, code)
    reasons = {}
    for path in (run_dir / "quarantine").rglob("*.json"):
        record = json.loads(path.read_text())
        reasons[record.get("key", "")] = record.get("reason", "")
    dropped = {}
    for path in (run_dir / "ledger" / "consumed").glob("*.json"):
        for d in json.loads(path.read_text()).get("dropped", []):
            dropped[d["key"]] = d.get("reason", "")
    caught, missed = 0, []
    for c in planted:
        key = f"rollouts/v{c.version:06d}/{c.actor}-000000.arrow"
        why = reasons.get(key) or dropped.get(key, "")
        # content already used is dropped, never trained on again: as a duplicate, or as stale when its
        # version left the window before the collector reached it (both are a drop, neither a use)
        if (why.startswith(("duplicate", "stale")) if c.expect == "duplicate"
                else key in reasons and c.expect.lower() in why.lower()):
            caught += 1
        else:
            missed.append(f"{c.kind}: {why or 'not judged'}")
    kinds = len({c.kind for c in planted})
    return result_row("fuzzed-rollouts", injected=len(planted), detected=caught, lost=row["lost"], finished=row["finished"],
                leaks=h.leaks(workdir, [run_dir]),
                detail=f"{len(planted)} files of {kinds} kinds: {caught} quarantined with their reason (or dropped as "
                       f"duplicates)" + (f"; not as expected: {missed[:3]}" if missed else "") +
                       f"; the run trained {row['audit'].get('used', 0)} honest files")


# -- 8. dishonest actors (and 9. the relay's TLS, the same run) -------------------------------------
def _intruder_env(workdir: Path, run_dir: Path, actor: str, *, tls: bool) -> tuple[dict, str, str | None]:
    """An attacker holding one actor's credentials: a token (and TLS bundle) the learner's key signed, as
    the fleet would have handed a compromised actor. The harness plays the fleet here."""
    from echo2.data.relay_certs import RELAY_TLS_ENV, RelayCA
    from echo2.data.relay_tokens import RELAY_TOKEN_ENV, mint
    from echo2.data.run_key import read_key

    run_id = run_dir.name
    key = read_key(workdir / "secrets" / f"{run_id}.key")  # where the learner of this scenario keeps its key
    expires = time.time() + 3600
    token = mint(key, run_id, actor, expires)
    bundle = RelayCA(key, run_id).issue(actor, expires) if tls else None
    env = h.environment(workdir, **{RELAY_TOKEN_ENV: token}, **({RELAY_TLS_ENV: bundle} if bundle else {}))
    return env, token, bundle


def dishonest_actors(workdir: Path, quick: bool = False, tls: bool = False) -> dict:
    """Two intruders holding actors' credentials commit lies: behavior logprobs their policy did not give,
    and rewards their completions did not earn. The learner bans both (the audit, the re-scoring), expels
    them and revokes their tokens; the honest actor, sampling in bf16 (another engine than the learner's
    fp32), is never banned. With ``tls``: the relay runs over TLS, and after the ban the intruder's own
    token and certificate are refused by the honest actor's relay."""
    import subprocess
    import sys

    model = h.tiny_model(workdir)
    name = "tls" if tls else "liars"
    run_dir = workdir / "runs" / name
    liars: list = []

    refused: list[str] = []
    revoked_in: list[int] = []  # the first published version whose signed manifest revokes the intruder

    def relays_hold(version: int) -> bool:
        """Whether every honest actor has received ``version`` or a newer one (its revoked list is in force)."""
        logs = [p.read_text(errors="replace") for p in (run_dir / "logs").glob("actor*.log")]
        return bool(logs) and all(any(int(v) >= version for v in re.findall(r"v(\d+) received and verified", text))
                                  for text in logs)

    def inject(_proc):
        if liars and tls and not refused:  # once the honest relays hold a version that revokes it, try its keys
            if not revoked_in:
                for manifest in sorted((run_dir / "policy").glob("v*/manifest.json")):
                    try:
                        if liars[0][0] in json.loads(manifest.read_text()).get("revoked", []):
                            revoked_in.append(int(manifest.parent.name[1:]))
                            break
                    except (OSError, ValueError):
                        continue
            if revoked_in and relays_hold(revoked_in[0]):
                refused.extend(_revoked_intruder_is_refused(workdir, run_dir, liars[0][1], liars[0][2]) or ["no peer"])
        if liars or not (run_dir / "policy" / "v000000" / "manifest.json").exists():
            return
        for actor, lie in (("liar-logprobs", "logprobs"), ("liar-rewards", "rewards")):
            env, token, bundle = _intruder_env(workdir, run_dir, actor, tls=tls)
            out = open(workdir / f"{name}-{actor}.log", "w")
            liars.append((actor, token, bundle, subprocess.Popen(
                [sys.executable, "-m", "echo2.chaos.liar", "--run", str(run_dir), "--actor-id", actor, "--lie", lie],
                cwd=h.REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)))

    extra = ["broadcast.tls=on", "fleet.actors=2"] if tls else ["fleet.actors=1"]
    code = h.run_cli(["run", h.QUICKSTART, *h.sets(f"model.name={model}", f"store.url={workdir}", f"run.id={name}",
                                                  *h.TINY, *extra, f"train.max_steps={8 if quick else 14}",
                                                  "train.audit_fraction=0.5", "rollout.engine.dtype=bfloat16")],
                     workdir, workdir / f"{name}.log", timeout=900, while_running=inject)
    for _, _, _, proc in liars:
        h.reap(proc)
        proc.wait()
    row = audit_row(name, run_dir, code)
    summary = json.loads((run_dir / "reports" / "summary.json").read_text()) if row["finished"] else {}
    audit = summary.get("audit", {})
    banned = set(audit.get("banned", {}))
    events = [json.loads(p.read_text()) for p in (run_dir / "ledger" / "events").glob("*.json")]
    expelled = {e["actor_id"] for e in events if e.get("kind") == "expelled"}
    liar_ids = {a for a, *_ in liars}
    honest_banned = banned - liar_ids
    over_tls = sum(text.count("at https://") for text in
                   (p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")))
    detail = (f"liars banned and expelled: {sorted(banned & expelled & liar_ids)}; honest bf16 actors banned: "
              f"{len(honest_banned)} (false positives); {audit.get('files_audited', 0)} of "
              f"{audit.get('files_seen', 0)} files audited (fraction {audit.get('fraction')}, threshold "
              f"{audit.get('max_gap')}), largest honest gap {audit.get('largest_passing_gap')}")
    injected, detected = len(liars), len(banned & expelled & liar_ids)
    if tls:
        detail += f"; chunks relayed over TLS: {over_tls}; the banned intruder's token + certificate: {refused}"
        injected += 1
        detected += bool(refused) and all(r == "refused" for r in refused) and over_tls > 0
    return result_row("relay-tls" if tls else "dishonest-actors", injected=injected, detected=detected - len(honest_banned),
                lost=row["lost"], bad_loaded=bad_loads(run_dir), finished=row["finished"],
                leaks=h.leaks(workdir, [run_dir], extra=[t for _, t, _, _ in liars] + [b for *_, b, _ in liars if b]),
                detail=detail)


def _revoked_intruder_is_refused(workdir: Path, run_dir: Path, token: str, bundle: str) -> list[str]:
    """The intruder's chunk requests to every live honest relay, after its ban: each must be refused."""
    import asyncio

    import aiohttp

    from echo2.broadcast.relay_tls import RelayTLS
    from echo2.data.relay_certs import ActorCertificate, ca_of_run, identity_name

    run = json.loads((run_dir / "run.json").read_text())
    tls = RelayTLS(ActorCertificate(bundle), ca_of_run(run))
    out = []

    async def ask(url: str, peer: str) -> str:
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/v1/versions/0/chunks/0", headers={"Authorization": f"Bearer {token}"},
                                 ssl=tls.client_context, server_hostname=identity_name(peer)) as r:
                    return "refused" if r.status == 401 else f"status {r.status}"
        except aiohttp.ClientError as exc:
            return f"refused ({type(exc).__name__})"

    for record in (run_dir / "peers").glob("*.json"):
        peer = record.stem
        if peer.startswith("liar"):
            continue
        try:
            url = json.loads(record.read_text())["url"]
        except (OSError, ValueError, KeyError):
            continue
        out.append(asyncio.run(ask(url, peer)).split(" (")[0])
    return out
