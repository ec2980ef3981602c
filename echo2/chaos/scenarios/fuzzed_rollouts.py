"""Chaos scenario 5 (an attacker): hostile rollout files (``fuzz.py``) committed into a live run, each
quarantined with its reason, while the learner keeps training."""

from __future__ import annotations

import json
import random
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, result_row


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
                                                  *h.TINY, "train.max_steps=8", "trust.max_rollout_file_mb=1")],
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
    return result_row("fuzzed-rollouts", injected=len(planted), detected=caught, lost=row["lost"],
                      finished=row["finished"],
                leaks=h.leaks(workdir, [run_dir]),
                detail=f"{len(planted)} files of {kinds} kinds: {caught} quarantined with their reason (or dropped as "
                       f"duplicates)" + (f"; not as expected: {missed[:3]}" if missed else "") +
                       f"; the run trained {row['audit'].get('used', 0)} honest files")
