"""Chaos scenarios 8 and 9 (an attacker): intruders holding actors' credentials commit lies and are banned,
expelled and revoked (``dishonest-actors``); the same run over the relay's TLS, where the banned intruder's own
token and certificate are then refused (``relay-tls``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, bad_loads, result_row


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
    and rewards their completions did not earn. The learner bans both (the spot check, the re-scoring), expels
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
                                                  "trust.spot_check_fraction=0.5", "rollout.engine.dtype=bfloat16")],
                     workdir, workdir / f"{name}.log", timeout=900, while_running=inject)
    for _, _, _, proc in liars:
        h.reap(proc)
        proc.wait()
    row = audit_row(name, run_dir, code)
    summary = json.loads((run_dir / "reports" / "summary.json").read_text()) if row["finished"] else {}
    checks = summary.get("spot_check", {})
    banned = set(checks.get("banned", {}))
    events = [json.loads(p.read_text()) for p in (run_dir / "ledger" / "events").glob("*.json")]
    expelled = {e["actor_id"] for e in events if e.get("kind") == "expelled"}
    liar_ids = {a for a, *_ in liars}
    honest_banned = banned - liar_ids
    over_tls = sum(text.count("at https://") for text in
                   (p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")))
    detail = (f"liars banned and expelled: {sorted(banned & expelled & liar_ids)}; honest bf16 actors banned: "
              f"{len(honest_banned)} (false positives); {checks.get('files_checked', 0)} of "
              f"{checks.get('files_seen', 0)} files spot-checked (fraction {checks.get('fraction')}, threshold "
              f"{checks.get('max_gap')}), largest honest gap {checks.get('largest_passing_gap')}")
    injected, detected = len(liars), len(banned & expelled & liar_ids)
    if tls:
        detail += f"; chunks relayed over TLS: {over_tls}; the banned intruder's token + certificate: {refused}"
        injected += 1
        detected += bool(refused) and all(r == "refused" for r in refused) and over_tls > 0
    return result_row("relay-tls" if tls else "dishonest-actors", injected=injected,
                      detected=detected - len(honest_banned),
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


def relay_tls(workdir: Path, quick: bool = False) -> dict:
    """``dishonest_actors`` over the relay's TLS: after the ban, the intruder's token and certificate are refused."""
    return dishonest_actors(workdir, quick, tls=True)
