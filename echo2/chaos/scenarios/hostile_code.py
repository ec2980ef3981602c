"""Chaos scenario ``hostile-code`` (an attacker): a short real run of the code task in which one actor's policy
writes the hostile programs (``hostile_programs.py``), and the sandbox must hold every one of them, on the actor
that runs them to score its replies and on the learner that runs them again.

The run is the real CLI on ``configs/code-smollm2.yaml`` with the tiny model (one honest actor launched by the
fleet) and a hostile actor started by the harness (``hostile_actor.py``: the real actor loop whose engine answers
every prompt with the next hostile program, with honest rewards and log-probabilities; the honest actor is held
with SIGSTOP until the hostile one has committed its first file, so the run never ends before the hostile programs
ran and were judged, however slowly the hostile actor starts). Its programs aim at what an
actor machine holds: the run's key file (``secrets/``), a secret in the actor's environment, a file of the
scenario's folder, and a socket the scenario listens on; each carries a mark in its argv, so a process it leaves
anywhere is found.

The row: ``injected`` the hostile programs (10); ``detected`` those the sandbox was seen to hold on the actor,
every time one ran: it ended as its limit says (a timeout for the fork bomb, the busy loop, the setsid sleeper and
the parent killer, the output limit for the gigabyte, its own end for the others) within ``wall_s`` plus the
teardown, reporting nothing it got (no file written outside its tmpfs, nothing read from the key folder, no
secret in its output, no connection, no 10 GB). ``broken``: a process with the mark still alive after the run, a
file of the mark on this machine, a connection the socket accepted, a program that never ran, the hostile
actor's files never used (the learner's re-runs must agree with the actor's) or its actor banned. The detail
gives the sandbox's overhead per program, measured after the run: a trivial program through ``Sandbox.run`` (bwrap,
the run's limits) against the same interpreter started bare, median of several.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.hostile_programs import NAMES, leftovers
from echo2.chaos.rows import audit_row, result_row

ACTOR = "hostile-coder"
WALL_S, CPU_S = 1.5, 1
MARGIN_S = 3.0
"""Seconds past ``WALL_S`` a program may take: the kill of its process tree and the cgroup's sweep."""
ENDS = {"fork-bomb": {"timeout"}, "spin": {"timeout"}, "setsid-sleep": {"timeout"}, "kill-parent": {"timeout"},
        "print-gigabyte": {"output-limit"}, "allocate": {"ok", "error", "killed"}}
"""How each program ends inside the task's harness (the sandbox's status); the others load, get nowhere, and the
harness ends them ("ok": no entry point to test)."""


class _Listener:
    """A socket on 127.0.0.1 that records every connection (the ``connect`` program's target)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted.append(conn.recv(100) or b"(connected)")
            conn.close()

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def _settled(mark: str) -> list[int]:
    """Processes still carrying ``mark`` a moment after the run (a SIGKILLed one may take a tick to be reaped)."""
    left = leftovers(mark)
    for _ in range(30):
        if not left:
            return []
        time.sleep(0.1)
        left = leftovers(mark)
    return left


def honest_actors(run_dir: Path) -> list[int]:
    """The fleet's own actor processes of the run (``echo2.cli actor --run RUN``), not the hostile one."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"echo2.cli" in argv and b"actor" in argv and any(str(run_dir).encode() in a for a in argv):
            found.append(int(entry.name))
    return found


def _hold(pids: list[int]) -> list[int]:
    held = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
            held.append(pid)
        except ProcessLookupError:
            continue
    return held


def _release(pids: set[int]) -> None:
    for pid in list(pids):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        pids.discard(pid)


def sandbox_overhead(runs: int) -> tuple[float, float]:
    """(median seconds of a trivial program through ``Sandbox.run`` under bwrap with the scenario's limits, median
    seconds of the same interpreter started bare on the same program)."""
    from echo2.tasks.sandbox import Limits, Sandbox

    box = Sandbox(Limits(cpu_s=CPU_S, wall_s=WALL_S, memory_mb=512, processes=16), mode="bwrap",
                  parallelism=1).verify_runs_here()
    try:
        boxed = statistics.median(box.run("pass").seconds for _ in range(runs))
        bare = []
        for _ in range(runs):
            started = time.monotonic()
            subprocess.run([box.python, "-s", "-S", "-B", "-c", "pass"], check=True, env={"PATH": "/usr/bin:/bin"})
            bare.append(time.monotonic() - started)
    finally:
        box.close()
    return boxed, statistics.median(bare)


def _held(entry: dict, escaped: set[str]) -> bool:
    """Whether one run of a hostile program on the actor ended as its limit says and got nowhere."""
    ends = ENDS.get(entry["name"], {"ok"})
    wrote = [p for p in entry["wrote"] if not p.startswith("/tmp/")]
    escaped.update(wrote)
    return (entry["status"] in ends and entry["seconds"] < WALL_S + MARGIN_S and not wrote and not entry["read"]
            and not entry["reached"] and not entry["allocated"] and not entry["secret_seen"])


def _judged(run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The hostile actor's files a step used, and those set aside with their reasons."""
    used, set_aside = [], {}
    for path in (run_dir / "ledger" / "consumed").glob("*.json"):
        used += [u["key"] for u in json.loads(path.read_text()).get("used", []) if f"/{ACTOR}-" in u["key"]]
    for path in (run_dir / "quarantine").rglob("*.json"):
        record = json.loads(path.read_text())
        if f"/{ACTOR}-" in record.get("key", ""):
            set_aside[record["key"]] = record.get("reason", "")
    return used, set_aside


def hostile_code(workdir: Path, quick: bool = False) -> dict:
    """The module docstring's run: every hostile program held on the actor and on the learner, nothing left."""
    from echo2.chaos.scenarios.dishonest_actors import _intruder_env

    model = h.tiny_model(workdir)
    run_id = "code"
    run_dir = workdir / "runs" / run_id
    mark = f"echo2-hostile-{uuid.uuid4().hex[:12]}"
    env_secret = f"echo2-chaos-env-{uuid.uuid4().hex}"
    outside = workdir / "escaped"
    report = workdir / "hostile-code-outcomes.jsonl"
    listener = _Listener()
    started: list[subprocess.Popen] = []
    key_file = workdir / "secrets" / f"{run_id}.key"  # the run key the learner keeps here: read-keys aims at it

    paused: set[int] = set()

    def inject(_proc):
        # until the hostile actor's first file is committed, the fleet's honest actor is held (SIGSTOP): the run
        # cannot end on honest files alone before the hostile programs ran, however slowly the hostile actor starts
        if started and not any(run_dir.glob(f"rollouts/*/{ACTOR}-*.arrow")):
            paused.update(_hold(honest_actors(run_dir)))
        elif paused:
            _release(paused)
        # as soon as the run exists: started beside the fleet's own actor
        if started or not ((run_dir / "run.json").exists() and key_file.exists()):
            return
        env, token, _ = _intruder_env(workdir, run_dir, ACTOR, tls=False)
        env["ECHO2_CHAOS_ACTOR_SECRET"] = env_secret  # what read-env would find in an actor's environment
        targets = workdir / "hostile-code-targets.json"
        targets.write_text(json.dumps({"mark": mark, "outside": str(outside), "key_file": str(key_file),
                                       "port": listener.port,
                                       "secrets": [key_file.read_text().strip(), env_secret, token]}))
        out = open(workdir / "hostile-code-actor.log", "w")
        started.append(subprocess.Popen(
            [sys.executable, "-m", "echo2.chaos.hostile_actor", "--run", str(run_dir), "--actor-id", ACTOR,
             "--targets", str(targets), "--report", str(report)],
            cwd=h.REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        code = h.run_cli(["run", str(h.REPO / "configs" / "code-smollm2.yaml"), *h.sets(
            f"model.name={model}", f"store.url={workdir}", f"run.id={run_id}", "fleet.actors=1",
            "rollout.group_size=4", "rollout.groups_per_batch=3", "train.groups_per_step=3",
            # a hostile reply is up to ~520 tokens of the tiny model's byte-level vocabulary, and fits whole
            "rollout.max_new_tokens=600", "rollout.temperature=1.0", "train.micro_batch_tokens=2048",
            "eval.before=false", "eval.after=false", "task.eval_size=4", "train.lr=1e-3",
            f"train.max_steps={4 if quick else 6}", "train.checkpoint_every=2", "train.keep_checkpoints=2",
            f"task.limits.wall_s={WALL_S}", f"task.limits.cpu_s={CPU_S}", "task.grade_file_budget_s=30",
            "task.rescore_fraction=1")], workdir, workdir / "hostile-code.log", timeout=900, while_running=inject)
    finally:
        _release(paused)
        for proc in started:
            h.reap(proc)
            proc.wait()
        listener.close()
    row = audit_row("hostile-code", run_dir, code)
    entries = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    escaped: set[str] = set()
    held = {name: bool(runs) and all(_held(e, escaped) for e in runs)
            for name, runs in ((n, [e for e in entries if e["name"] == n]) for n in NAMES)}
    used, set_aside = _judged(run_dir)
    summary = json.loads((run_dir / "reports" / "summary.json").read_text()) if row["finished"] else {}
    banned = summary.get("spot_check", {}).get("banned", {})
    left = _settled(mark)
    home = os.path.expanduser("~")
    written = [p for p in (outside, Path(f"/etc/{mark}"), Path(f"/{mark}"), Path(f"/root/{mark}"),
                           Path(f"/tmp/{mark}"), Path(home) / mark, Path(sys.base_prefix) / mark,
                           Path(sys.prefix) / mark) if p.exists()]
    broken = []
    if left:
        broken.append(f"{len(left)} process(es) of the hostile programs still alive after the run")
    if written or escaped:
        broken.append(f"written outside the sandbox: {sorted({*map(str, written), *escaped})[:5]}")
    if listener.accepted:
        broken.append(f"the loopback socket accepted {len(listener.accepted)} connection(s)")
    never = [n for n in NAMES if not any(e["name"] == n for e in entries)]
    if never:
        broken.append(f"never ran on the actor: {never}")
    if not used:
        broken.append(f"no file of the hostile actor was used (set aside: {list(set_aside.values())[:2]})")
    if ACTOR in banned:
        broken.append(f"the hostile actor was banned: {str(banned[ACTOR])[:200]}")
    boxed, bare = sandbox_overhead(5 if quick else 20)
    ended = [e["seconds"] for e in entries if e["status"] == "ok"]
    not_held = [n for n, ok in held.items() if not ok]
    detail = (f"{len(entries)} hostile programs run on the actor, {sum(held.values())} of {len(NAMES)} kinds held "
              f"every time" + (f" (not: {', '.join(not_held)})" if not_held else "") +
              f"; {len(used)} of its files used after the learner ran each of their programs again, "
              f"{len(set_aside)} set aside; sandbox overhead {1000 * (boxed - bare):.0f} ms a program (a trivial "
              f"program {1000 * boxed:.0f} ms in bwrap, {1000 * bare:.0f} ms bare, median)"
              + (f"; programs that ended on their own: median {statistics.median(ended):.2f} s" if ended else ""))
    return result_row("hostile-code", injected=len(NAMES), detected=sum(held.values()), lost=row["lost"],
                      finished=row["finished"], broken=broken, overhead_ms=round(1000 * (boxed - bare), 1),
                      leaks=h.leaks(workdir, [run_dir], extra=[env_secret]), detail=detail)
