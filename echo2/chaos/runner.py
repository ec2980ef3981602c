"""``echo2 chaos`` / ``make chaos``: every scenario (``scenarios/``, one per file) against real runs, one table.

A scenario fails (``failed``) when it lost or double-used a rollout file, when an actor loaded a bad
version, when a run did not finish, when it detected fewer faults than it injected, when a secret was
found where it must never be, or when a property it checks beyond those did not hold (``broken``). The
command exits 1 when any scenario failed. ``--quick`` runs the small sizes; the full ones are what the
reliability table in docs/reliability.md shows.

Interrupted (Ctrl-C, or SIGTERM: ``echo2/cli/chaos.py`` makes it the same), the suite stops every process its
scenarios started -- runs in sessions of their own, their actors and Prefect servers, hostile actors --
before it waits for the scenarios' threads: each such process carries the suite's tag in its environment
(``SUITE_TAG_ENV``, inherited from this process), and ``reap_suite`` ends the ones that carry it.

Scenarios run ``jobs`` at a time (each in its own folder, with its own runs, keys and Prefect home): their
runs spend much of their time waiting (on actors' polls, a store outage, a learner's restart), so two at a
time take little more than one on two cores. ``SOLO`` scenarios run alone, after the others: the load
scenario measures how listing time and memory grow, which other runs beside it would distort.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from echo2.chaos import harness
from echo2.chaos.scenarios import SCENARIOS

SOLO = ("load",)
"""Scenarios that run with nothing beside them."""


SUITE_TAG_ENV = "ECHO2_CHAOS_SUITE"
"""Set in this process's environment while a suite runs: every process a scenario starts inherits it."""


def reap_suite(tag: str) -> int:
    """SIGKILL every process (but this one) whose environment holds ``SUITE_TAG_ENV=tag``: what the suite's
    scenarios started, in whatever session. Returns how many were killed."""
    return kill_by_environment(SUITE_TAG_ENV, tag)


def kill_by_environment(name: str, value: str, sig: int = signal.SIGKILL) -> int:
    """SIGKILL (or ``sig``) every process (but this one) whose environment holds ``name=value``, in whatever
    session (a process that started a session of its own is out of reach of a process-group kill). Returns how
    many."""
    marker = f"{name}={value}".encode()
    killed = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), sig)
                killed += 1
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return killed


def failed(row: dict) -> bool:
    return (row["lost"] != 0 or row["bad_loaded"] != 0 or not row["finished"] or row["detected"] < row["injected"]
            or bool(row["leaks"]) or bool(row.get("broken")))


def run_scenarios(names: list[str] | None = None, *, quick: bool = False, keep: Path | None = None,
                  progress=lambda line: None, jobs: int = 2) -> list[dict]:
    """One row per scenario, in the order of ``SCENARIOS`` (or of ``names``)."""
    unknown = sorted(set(names or []) - set(SCENARIOS))
    if unknown:
        raise ValueError(f"unknown scenario {', '.join(unknown)}; choose among {', '.join(SCENARIOS)}")
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: run at least one scenario at a time")
    names = list(names or SCENARIOS)
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="echo2-chaos-"))
    harness.STOP.clear()
    tag = secrets.token_hex(8)
    previous_tag = os.environ.get(SUITE_TAG_ENV)
    os.environ[SUITE_TAG_ENV] = tag

    def one(name: str) -> dict:
        workdir = root / name
        workdir.mkdir(parents=True, exist_ok=True)
        progress(f"chaos: {name} ...")
        started = time.time()
        try:
            row = SCENARIOS[name](workdir, quick=quick)
        except harness.Stopped:
            raise
        except Exception as exc:  # a scenario that broke is a failed row, not a stopped suite
            row = {"scenario": name, "injected": 1, "detected": 0, "lost": 0, "bad_loaded": 0, "finished": False,
                   "leaks": [], "broken": [], "detail": f"{type(exc).__name__}: {exc}"}
        row["seconds"] = round(time.time() - started, 1)
        row.pop("audit", None)
        progress(f"chaos: {name}: {'FAILED' if failed(row) else 'ok'} in {row['seconds']:.0f}s; {row['detail']}")
        return row

    try:
        shared = [name for name in names if name not in SOLO]
        pool = ThreadPoolExecutor(max_workers=jobs)
        try:
            rows = dict(zip(shared, pool.map(one, shared)))
        except BaseException:  # Ctrl-C, SIGTERM: the scenarios in the other threads stop their runs too
            harness.STOP.set()
            reap_suite(tag)  # now, not after the threads: one may be waiting on a process (an audit, a run)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        rows.update((name, one(name)) for name in names if name in SOLO)
    except BaseException:
        harness.STOP.set()
        reap_suite(tag)  # and what a thread started before it saw STOP
        raise
    finally:
        if previous_tag is None:
            os.environ.pop(SUITE_TAG_ENV, None)
        else:
            os.environ[SUITE_TAG_ENV] = previous_tag
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return [rows[name] for name in names]


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="echo2 chaos")
    for col in ("scenario", "injected", "detected", "lost", "bad loaded", "finished", "leaks", "s", "result"):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for r in rows:
        table.add_row(r["scenario"], str(r["injected"]), str(r["detected"]), str(r["lost"]), str(r["bad_loaded"]),
                      "yes" if r["finished"] else "no", str(len(r["leaks"])), f"{r.get('seconds', 0):.0f}",
                      "FAILED" if failed(r) else "ok")
    console = Console(width=160)
    console.print(table)
    for r in rows:
        console.print(f"- {r['scenario']}: {r['detail']}")
        for what in r.get("broken", []):
            console.print(f"  broken: {what}")
        for leak in r["leaks"][:5]:
            console.print(f"  leak: {leak}")


def as_json(rows: list[dict]) -> str:
    return "\n".join(json.dumps(r) for r in rows)
