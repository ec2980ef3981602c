"""Chaos scenarios of an attacker: forged versions and requests, hostile rollout files, dishonest actors, and
the relay's TLS against an intruder whose credentials were revoked (hostile peers: ``bad_peers.py``)."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, bad_loads, result_row


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
