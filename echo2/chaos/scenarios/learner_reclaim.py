"""Chaos scenario ``learner-reclaim``: the learner itself on a spot machine, reclaimed twice.

    1. a ``learner.market: spot`` run starts (real ``echo2 run``, tiny model, local actors in sessions of their own)
    2. with a notice: SIGTERM to the learner (the spot notice), SIGKILL of its whole process group (the learner,
       Prefect's server: the machine) ``NOTICE_S`` later; without one: the SIGKILL alone
    3. the learner is relaunched on "a new machine": a fresh empty working folder as its cwd, its own Prefect home
       and an empty secrets folder, the run key only in ``ECHO2_RUN_KEY``, ``--resume`` and the run id; it adopts
       the running actors and goes on; after the last reclaim it finishes

Checks (``broken`` when one fails): steps lost per reclaim (the newest step in the ledger when it died minus the
step it resumed from) <= 1 with a notice and <= ``train.checkpoint_every`` without; no actor launched after the
first start, and every actor adopted at each resume and never revoked while it runs; LATEST (watched all along)
never moves back except to the step a resume names; the audit shows every rollout file exactly once; the cost report
bills a spot learner in sessions with one gap per reclaim.

Measured (in ``detail`` and the row): notice -> committed checkpoint seconds (the ``learner_left`` event's
``notice_to_checkpoint_s``), and kill -> the first new step after the relaunch (the new ledger entry's time). Every
wait is on an event in the store (a file appearing), bounded; never a fixed sleep but the notice's ``NOTICE_S``.
Actors outlive learners by design here, so the scenario stops whatever of the run is left (every launched pid) when
it ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row, bad_loads, result_row

NOTICE_S = 2.0
"""Seconds between the notice (SIGTERM) and the SIGKILL of the learner's process group."""
WAIT_S = 300.0
"""The longest wait for any one event of a run (a step, a resume) before the scenario gives up."""
RUN_ID = "reclaim"


class _Gave(Exception):
    """A wait ran out, or the learner exited when it should not have."""


def _steps(run_dir: Path) -> dict[int, float]:
    """Ledger steps -> when their entry was written (amendments left out)."""
    out = {}
    for p in (run_dir / "ledger" / "consumed").glob("step-*.json"):
        if p.name.count(".") == 1:
            try:
                out[int(p.name[5:11])] = p.stat().st_mtime
            except (OSError, ValueError):
                continue
    return out


def _events(run_dir: Path) -> list[dict]:
    out = []
    for p in (run_dir / "ledger" / "events").glob("*.json"):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda e: e.get("ts", 0))


def _wait(predicate, what: str, proc: subprocess.Popen | None = None, timeout: float = WAIT_S):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if h.STOP.is_set():
            raise h.Stopped("interrupted")
        got = predicate()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise _Gave(f"the learner exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.1)
    raise _Gave(f"timed out after {timeout:.0f}s waiting for {what}")


class _LatestWatch(threading.Thread):
    """Every value LATEST takes, with when (polled every 50 ms)."""

    def __init__(self, run_dir: Path):
        super().__init__(name="echo2-chaos-latest", daemon=True)
        self.path = run_dir / "policy" / "LATEST"
        self.seen: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            try:
                version = json.loads(self.path.read_text())["version"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not self.seen or self.seen[-1][1] != version:
                self.seen.append((time.time(), version))


def _start(args: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """``python -m echo2.cli ARGS`` in a session of its own (the learner's "machine"), from ``cwd``."""
    if h.STOP.is_set():
        raise h.Stopped("interrupted")
    cwd.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "echo2.cli", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def learner_reclaim(workdir: Path, quick: bool = False, notices: tuple[bool, ...] = (True, False)) -> dict:
    """Reclaims of a spot learner (``notices``: with a notice or not, in order), each relaunched on a fresh
    folder; see the module docstring."""
    model = h.tiny_model(workdir)
    actors = 2 if quick else 3
    every = 2
    max_steps = 3 * len(notices) + 3 if quick else 6 * len(notices) + 6
    run_dir = workdir / "runs" / RUN_ID
    sets = h.sets(f"model.name={model}", f"store.url={workdir}", f"run.id={RUN_ID}", *h.TINY, f"fleet.actors={actors}",
                  f"train.max_steps={max_steps}", f"train.checkpoint_every={every}", "learner.market=spot",
                  f"learner.sigterm_notice_s={NOTICE_S:g}")
    resume = ["run", h.QUICKSTART, *h.sets(f"store.url={workdir}", f"run.id={RUN_ID}"), "--resume"]
    watch = _LatestWatch(run_dir)
    broken: list[str] = []
    reclaims: list[dict] = []
    proc = _start(["run", h.QUICKSTART, *sets], workdir, h.environment(workdir), workdir / "learner-0.log")
    watch.start()
    code = None
    machines = [workdir]
    try:
        for i, notice in enumerate(notices):
            # strike on a step the previous learner reached beyond its start (after a relaunch: its first new one)
            floor = max(_steps(run_dir), default=0)
            target = floor + (2 if i == 0 else 1) * (1 if quick else 2)
            target += 0 if notice else target % 2  # no notice: an even step in flight, LATEST past the checkpoint
            _wait(lambda: max(_steps(run_dir), default=0) >= target, f"step {target}", proc)
            r = {"notice": notice}
            if notice:
                r["notice_at"] = time.time()
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=NOTICE_S)
                except subprocess.TimeoutExpired:
                    pass
            r["step_at_kill"] = max(_steps(run_dir), default=0)
            r["killed_at"] = time.time()
            _kill_group(proc)
            left = [e for e in _events(run_dir) if e.get("kind") == "learner_left" and e["ts"] >= r.get("notice_at", 0)]
            if notice:
                r["notice_to_checkpoint_s"] = left[-1].get("notice_to_checkpoint_s") if left else None
            machine = workdir / f"machine-{i + 1}"  # a new machine: nothing of the old one but the store and the key
            machines.append(machine)
            env = h.environment(machine, ECHO2_RUN_KEY=(workdir / "secrets" / f"{RUN_ID}.key").read_text().strip())
            (machine / "secrets").mkdir(parents=True, exist_ok=True)
            resumes_before = sum(e.get("kind") == "resume" for e in _events(run_dir))
            proc = _start(resume, machine, env, workdir / f"learner-{i + 1}.log")
            resumed = _wait(lambda: [e for e in _events(run_dir) if e.get("kind") == "resume"][resumes_before:],
                            "the relaunched learner's resume", proc)[0]
            r["resumed_from"] = resumed.get("step")
            new = _wait(lambda: {s: t for s, t in _steps(run_dir).items()
                                 if s > r["resumed_from"] and t >= resumed["ts"]}, "its first new step", proc)
            r["kill_to_first_step_s"] = round(min(new.values()) - r["killed_at"], 1)
            r["steps_lost"] = r["step_at_kill"] - r["resumed_from"]
            reclaims.append(r)
        code = _wait(lambda: proc.poll() is not None, "the run to finish", timeout=WAIT_S * 2) and proc.returncode
    except _Gave as exc:
        broken.append(str(exc))
    finally:
        watch.done.set()
        _kill_group(proc)
        _stop_actors(run_dir)
    events = _events(run_dir)
    row = audit_row("learner-reclaim", run_dir, code if code is not None else -1)
    broken += _judge(events, reclaims, watch.seen, every=every, actors=actors, run_dir=run_dir)
    measured = "; ".join(
        f"{'notice' if r['notice'] else 'no notice'}: lost {r['steps_lost']} step(s) (died at {r['step_at_kill']}, "
        f"resumed from {r['resumed_from']})"
        + (f", notice -> committed checkpoint {r['notice_to_checkpoint_s']}s" if r["notice"] else "")
        + f", kill -> first new step {r['kill_to_first_step_s']}s" for r in reclaims)
    leaks = h.grep([run_dir, *(m / "prefect-home" for m in machines), *workdir.glob("*.log")],
                   [*h.run_secrets(workdir), *h.TOKEN_MARKS])
    adopted = sum(e.get("kind") == "adopt" for e in events)
    return result_row("learner-reclaim", injected=len(notices), detected=sum(
        r.get("resumed_from") is not None and r["steps_lost"] <= (1 if r["notice"] else every) for r in reclaims),
        lost=row["lost"], finished=row["finished"], bad_loaded=bad_loads(run_dir), leaks=leaks, broken=broken,
        reclaims=reclaims, detail=f"{len(reclaims)} learner reclaims, {adopted} adoptions; {measured}")


def _judge(events: list[dict], reclaims: list[dict], latest: list[tuple[float, int]], *, every: int, actors: int,
           run_dir: Path) -> list[str]:
    broken = []
    for r in reclaims:
        bound = 1 if r["notice"] else every
        if r["steps_lost"] > bound:
            broken.append(f"a reclaim ({'with' if r['notice'] else 'without'} notice) lost {r['steps_lost']} steps > "
                          f"{bound}")
        if r["notice"] and r.get("notice_to_checkpoint_s") is None:
            broken.append("no learner_left event with notice_to_checkpoint_s after the notice")
    launches = [e for e in events if e.get("kind") == "launch"]
    first_kill = min((r["killed_at"] for r in reclaims), default=float("inf"))
    late = [e["actor_id"] for e in launches if e["ts"] >= first_kill]
    if late or len(launches) != actors:
        broken.append(f"actors launched after the first start: {late} ({len(launches)} launches for {actors} actors)")
    resumes = [e for e in events if e.get("kind") == "resume"]
    for i, resume in enumerate(resumes):
        nxt = resumes[i + 1]["ts"] if i + 1 < len(resumes) else float("inf")
        adopted = [e for e in events if e.get("kind") == "adopt" and resume["ts"] <= e["ts"] < nxt]
        if len(adopted) != actors:
            broken.append(f"resume from step {resume.get('step')} adopted {len(adopted)} of {actors} actors")
    back = [(a, b) for (_, a), (_, b) in zip(latest, latest[1:]) if b < a]
    allowed = {e.get("step") for e in resumes}
    wrong = [(a, b) for a, b in back if b not in allowed]
    if wrong:
        broken.append(f"LATEST moved back outside the resume rule: {wrong}")
    broken += _revoked_adopted(events, run_dir)
    broken += _cost_checks(run_dir, len(reclaims), sum(r["notice"] for r in reclaims))
    return broken


def _revoked_adopted(events: list[dict], run_dir: Path) -> list[str]:
    """Adopted actors whose relay tokens a version published after their adoption revoked (none may be, unless
    the ledger saw them end first)."""
    adopted = {e["actor_id"]: e["ts"] for e in events if e.get("kind") == "adopt"}
    ended = {e["actor_id"]: e["ts"] for e in events if e.get("kind") in ("terminated", "exited", "crashed",
                                                                           "reclaimed", "expelled")}
    wrong = set()
    for path in (run_dir / "policy").glob("v*/manifest.json"):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        published = manifest.get("created_at") or 0
        for actor in manifest.get("revoked") or []:
            if actor in adopted and adopted[actor] <= published < ended.get(actor, float("inf")):
                wrong.add(actor)
    return [f"adopted actors revoked by a later version: {sorted(wrong)}"] if wrong else []


def _cost_checks(run_dir: Path, reclaims: int, notices: int) -> list[str]:
    """The cost report bills a spot learner in sessions, with one gap per reclaim (``fleet/bill/learner.py``)."""
    try:
        learner = json.loads((run_dir / "reports" / "cost.json").read_text())["learner"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"no learner object in reports/cost.json ({type(exc).__name__})"]
    out = []
    if learner.get("market") != "spot" or learner.get("sessions") != reclaims + 1 or not learner.get("hours"):
        out.append(f"cost report: learner {learner.get('market')}, {learner.get('sessions')} sessions, "
                   f"{learner.get('hours')} h; wanted spot, {reclaims + 1} sessions, > 0 h")
    if learner.get("reclaims") != reclaims or not learner.get("gap_hours") or learner.get("with_notice") != notices:
        out.append(f"cost report: {learner.get('reclaims')} reclaims ({learner.get('with_notice')} with notice), gap "
                   f"{learner.get('gap_hours')} h; wanted {reclaims} ({notices}) and a gap > 0")
    return out


def _stop_actors(run_dir: Path) -> None:
    """SIGKILL every actor the run launched that is still this run's process (they outlive learners here)."""
    for e in _events(run_dir):
        pid = e.get("pid") if e.get("kind") == "launch" else None
        if not isinstance(pid, int):
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(e["actor_id"]).encode() in argv:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
