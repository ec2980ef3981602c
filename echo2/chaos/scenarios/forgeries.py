"""Chaos scenario 4 (an attacker): forged, re-signed, replayed and unsigned versions planted in a live run,
and hostile relay requests; all refused, none loaded."""

from __future__ import annotations

import json
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, bad_loads, result_row


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
             base + 2: ("the learner's manifest re-signed",
                        lambda v: sign({**body, "version": v, "revoked": []}, attacker)),
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
