"""The learner killed with SIGKILL in the middle of a checkpoint write, a publish and a step, again and
again, always resumes and finishes, and the ledger accounts for every committed rollout file once.

The kills come from failpoints (``echo2/data/failpoints.py``): the learner SIGKILLs itself the n-th
time it passes a point of the chosen kind, n drawn at random, so every moment of each operation is
reachable (between any two files of a version or a checkpoint, before LATEST moves, after a step's
files are chosen, after its optimizer step). ``make test`` runs 3 kills (one of each kind);
``make chaos`` runs ``ECHO2_CHAOS_KILLS=21``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

from conftest import REPO
from echo2.data.store import open_store
from helpers import ledger_audit, reap_session

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
SETTINGS = ["rollout.group_size=4", "rollout.groups_per_batch=2", "train.groups_per_step=2",
            "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "task.eval_size=10", "train.lr=1e-3",
            "eval.before=false", "eval.after=false", "train.checkpoint_every=2", "train.keep_checkpoints=2"]
# hits of each failpoint in about six steps (three checkpoints) of work; the tiny model's folders hold
# ~8 files. The quickstart publishes sparse deltas: a keyframe first after each resume (~8 files and
# LATEST), then one delta shard and LATEST per version. n is drawn in that range, so kills land at
# every stage (in keyframes and in deltas) and the run progresses between them
HITS_PER_SIX_STEPS = {"step": 12, "publish": 19, "checkpoint": 27}


def _attempt(args: list[str], failpoint: str | None, timeout: float, log_path) -> int:
    env = dict(os.environ)
    env.pop("ECHO2_FAILPOINTS", None)
    if failpoint:
        env["ECHO2_FAILPOINTS"] = failpoint
    # its own session: what SIGKILL leaves behind (Prefect's ephemeral server) is reaped with the group.
    # Output goes to a file: a pipe would stay open in that orphan after the learner died
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "echo2.cli", *args], cwd=REPO, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            reap_session(proc)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"attempt with {failpoint} exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
    return proc.returncode


def run_chaos(store_dir, model, *, kills: int, max_steps: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    kinds = ["checkpoint", "publish", "step"]
    base = ["run", QUICKSTART, "--set", f"model.name={model}", "--set", f"store.url={store_dir}",
            "--set", "run.id=chaos", *[a for s in SETTINGS for a in ("--set", s)],
            "--set", f"train.max_steps={max_steps}"]
    killed: dict[str, int] = {k: 0 for k in kinds}
    attempts = 0
    started = time.time()
    finished = False
    while sum(killed.values()) < kills:
        kind = kinds[sum(killed.values()) % len(kinds)]
        point = f"{kind}:{rng.randint(1, HITS_PER_SIX_STEPS[kind])}"
        code = _attempt(base + (["--resume"] if attempts else []), point, 600, store_dir / f"attempt-{attempts}.log")
        attempts += 1
        if code == 0:  # the run finished before the failpoint was reached: start over on a new run
            finished = True
            break
        killed[kind] += 1
    if not finished:
        assert _attempt(base + ["--resume"], None, 600, store_dir / f"attempt-{attempts}.log") == 0
        attempts += 1
    return {"kills": killed, "attempts": attempts, "seconds": round(time.time() - started, 1)}


def test_sigkill_during_checkpoints_publishes_and_steps_always_resumes(tiny_model, tmp_path):
    kills = int(os.environ.get("ECHO2_CHAOS_KILLS", "3"))
    max_steps = 6 * kills + 4  # more than the kills can reach: each attempt dies within ~6 steps
    result = run_chaos(tmp_path, tiny_model, kills=kills, max_steps=max_steps)
    print("chaos:", json.dumps(result))
    assert sum(result["kills"].values()) == kills, result
    run = open_store(str(tmp_path / "runs" / "chaos"))
    summary = run.get_json("reports/summary.json")
    assert summary["steps"] == max_steps and run.get_json("policy/LATEST") == {"version": max_steps}
    assert run.exists(f"checkpoints/step-{max_steps:06d}/manifest.json")
    problems, counts = ledger_audit(run)
    print("ledger:", json.dumps(counts))
    assert not problems, problems
    assert counts["used"] >= max_steps  # at least one file per step
    assert 0 <= summary["max_lag_used"] <= 2
    # every step's ledger entry is there once, none from a lost timeline
    steps = sorted(k for k in run.list("ledger/consumed/") if k.endswith(".json") and "step-" in k and k.count(".") == 1)
    assert steps == [f"ledger/consumed/step-{i:06d}.json" for i in range(1, max_steps + 1)]
