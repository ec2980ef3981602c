"""Overlap benchmark: the capacity model (``fleet/sizing/capacity.py``) against the real system.

Each grid point is a fresh run with the REAL learner loop (``LearnerRun``: collect, update,
publish, checkpoint; driven directly, as ``echo2/flows/train.py`` does through Prefect), REAL actor
processes (the ``Actor`` loop with its flow control, started by the fleet manager), the real object
store (local files) and real dissemination (store mode, signed manifests, chunk hashes). Only the
compute is replaced, by the *timing workload* (``timing_learner.py``, ``overlap_actor.py``):

    learner  the real step on a tiny model, padded with a sleep to T_train seconds; every version
             carries a ballast tensor so that it is ``ballast_mb`` big
    actors   generation is a sleep of G seconds per batch with valid random completions; reads
             under policy/ are throttled so that a version takes about D seconds to arrive

What it measures, per point (staleness S, actors n, dissemination D): the learner's utilization
(busy time over wall time across the measured steps, after a warm-up) and steps per minute, the
lag histogram of the groups used, and, side by side, the synchronous baseline (S = 0 with the same
n and D). What it predicts: ``capacity.predict`` on the inputs fitted from that same run folder by
``fleet/sizing/fit.py`` (``fit_run``: what ``echo2 plan --from-run`` uses), so predicted and measured
differ only by what the model leaves out. A last point is the fleet the planner provisions: n and
S picked with ``min_staleness``/``predict`` from a measured run so that the predicted utilization
is at least 0.95; its measured utilization is the check (target >= 0.95).

Never used by ``echo2 run``: the timing workload exists only here.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.store import open_store
from echo2.data.weights import read_manifest
from echo2.fleet.make import make_fleet
from echo2.fleet.sizing.capacity import Workload, min_staleness, predict
from echo2.fleet.sizing.fit import fit_run

TOLERANCE = 0.10
"""Largest |predicted - measured| utilization the benchmark calls agreement."""
TARGET_UTILIZATION = 0.95
"""What the planned fleet is provisioned for."""


@dataclass(frozen=True)
class Settings:
    """The timing workload and the run shape shared by every point."""

    train_seconds: float = 1.0
    """T_train: what one learner step is padded to (publishing comes on top)."""
    batch_seconds: float = 0.4
    """G: one actor batch (0.4 T: one actor makes 5/8 of what the learner eats, two have headroom)."""
    ballast_mb: float = 4.0
    """Size one published version adds, so that dissemination moves real bytes."""
    groups_per_step: int = 8
    groups_per_batch: int = 2
    group_size: int = 2
    max_new_tokens: int = 6
    poll_seconds: float = 0.05
    warmup_steps: int = 2
    """Steps not measured: actors start and version 0 reaches them, the backlog fills."""
    measured_steps: int = 6
    """Steps measured after the warm-up. Where D >= T the learner's waits alternate from step to
    step: over 4 steps the same point measured 0.41-0.50 in repeated runs, over 6-10 steps within 0.05."""
    max_actors: int = 4
    """The planner never provisions more (actors share this machine's cores)."""

    @property
    def total_steps(self) -> int:
        # fit_run starts the clock at the first step after the warm-up, so one more is run
        return self.warmup_steps + self.measured_steps + 1

    @property
    def backlog(self) -> int:
        return -(-self.groups_per_step // self.groups_per_batch)  # one step's worth of batches


FULL = Settings()
QUICK = Settings(train_seconds=0.5, batch_seconds=0.2, ballast_mb=2.0, measured_steps=4)


@dataclass(frozen=True)
class Point:
    staleness: int
    actors: int
    d_label: str
    """"small" (unthrottled), "T" (D about T_train), "2T"."""
    scenario: str = "grid"

    def dissemination_target(self, s: Settings) -> float:
        return {"small": 0.0, "T": s.train_seconds, "2T": 2 * s.train_seconds}[self.d_label]


def _config(s: Settings, p: Point, store_url: str, model_dir: Path):
    return config_from_dict({
        "run": {"name": f"overlap-s{p.staleness}-n{p.actors}-d{p.d_label}"},
        "store": {"url": store_url},
        "model": {"name": str(model_dir)},
        "task": {"digits": 1, "eval_size": 10},
        "rollout": {"group_size": s.group_size, "groups_per_batch": s.groups_per_batch,
                    "max_new_tokens": s.max_new_tokens, "poll_seconds": s.poll_seconds, "num_threads": 1,
                    "max_pending_batches": s.backlog},
        # the loop stops itself after total_steps: a max_steps that large never triggers the final
        # checkpoint, and checkpoint_every that large none at all (T is the step and the publish)
        "train": {"staleness": p.staleness, "groups_per_step": s.groups_per_step,
                  "checkpoint_every": 10**6, "max_steps": 10**6, "rollout_timeout_s": 120.0},
        "publish": {"every": 1},
        # the timing engine's logprobs are made up (its tokens come from no model): the
        # spot check would rightly ban every actor
        "trust": {"spot_check_fraction": 0.0},
        "learner": {"num_threads": 1},
        "eval": {"before": False, "after": False},
        "fleet": {"actors": p.actors, "max_restarts": 0},  # a broken actor fails the point at once
        "broadcast": {"mode": "store", "chunk_mb": 1.0},
    })


def run_point(s: Settings, p: Point, workdir: Path, model_dir: Path) -> dict:
    """One fresh run at point ``p``: measured outcome, fitted inputs and the model's prediction."""
    from echo2.bench.timing_learner import TimingLearner
    from echo2.learner.distributed import learner_options
    from echo2.learner.run import LearnerRun

    config = _config(s, p, str(workdir / "store"), model_dir)
    learner = TimingLearner(model_dir, config.train, temperature=config.rollout.temperature,
                            train_seconds=s.train_seconds, ballast_mb=s.ballast_mb, **learner_options(config))
    started = time.time()
    run = LearnerRun(config, open_store(config.store.url).child(layout.RUNS), resume=False, learner=learner)
    version_bytes = sum(f["size"] for f in read_manifest(run.store, layout.policy_dir(0))["files"])
    target = p.dissemination_target(s)
    read_mbps = version_bytes / 2**20 / target if target > 0 else 0.0
    command = [sys.executable, "-m", "echo2.bench.overlap_actor", "--batch-seconds", str(s.batch_seconds),
               "--read-mbps", f"{read_mbps:.6f}"]
    fleet = make_fleet(config.fleet, run.store, store_options={}, log_dir=run.log_dir, run_key=run.key,
                       actor_command=command)
    fleet.start()
    try:
        while run.step < s.total_steps:
            run.update(run.collect(should_abort=fleet.reconcile))
    except BaseException:
        run.interrupted()
        raise
    finally:
        fleet.stop()
    summary = run.finish()  # reports/metrics.json: what fit_run reads, as `echo2 plan --from-run` would
    fit = fit_run(run.store, skip_steps=s.warmup_steps)
    predicted = predict(fit.workload, fit.batch_seconds)
    w = fit.workload
    return {
        "scenario": p.scenario, "staleness": p.staleness, "actors": p.actors, "d_label": p.d_label,
        "dissemination_target_s": target, "dissemination_s": w.dissemination_seconds,
        "train_seconds": w.train_seconds, "batch_seconds": fit.batch_seconds, "upload_seconds": w.upload_seconds,
        "version_mb": version_bytes / 2**20, "read_mbps": read_mbps,
        "measured_utilization": fit.measured_utilization, "predicted_utilization": predicted.utilization,
        "abs_diff": abs(predicted.utilization - fit.measured_utilization),
        "steps_per_minute": 60.0 / fit.measured_step_seconds, "predicted_steps_per_minute": predicted.steps_per_minute,
        "measured_step_seconds": fit.measured_step_seconds, "predicted_step_seconds": predicted.step_seconds,
        "bound": predicted.bound, "lag_histogram": {str(k): v for k, v in sorted(fit.measured_lag.items())},
        "predicted_lag": {str(k): v for k, v in sorted(predicted.lag.items())},
        "steps": fit.steps, "run_seconds": time.time() - started, "run_id": run.run_id,
        # a timing engine whose files the learner refused, or actors overshooting S, would show here
        "rollouts_quarantined": summary["rollouts_quarantined"],
        "rollouts_dropped_stale": summary["rollouts_dropped_stale"],
    }


def plan_fleet(calibration: dict, s: Settings) -> tuple[int, int, float]:
    """(actors, staleness, predicted utilization) the planner provisions for the inputs fitted in
    ``calibration``: the smallest fleet, then the smallest S, predicted to reach the target; the best
    prediction when none does."""
    w = Workload(train_seconds=calibration["train_seconds"], groups_per_step=s.groups_per_step,
                 groups_per_batch=s.groups_per_batch, staleness=0,
                 dissemination_seconds=calibration["dissemination_s"],
                 upload_seconds=calibration["upload_seconds"], max_pending_batches=s.backlog)
    g = sorted(calibration["batch_seconds"])[len(calibration["batch_seconds"]) // 2]  # the typical actor
    best = (s.max_actors, 0, 0.0)
    for n in range(1, s.max_actors + 1):
        s_min = min_staleness(w, [g] * n)
        if s_min is None:
            continue  # too slow for the learner at any staleness
        for staleness in range(s_min + 3):  # the closed form is a bound: predict may reach it below s_min
            u = predict(replace(w, staleness=staleness), [g] * n).utilization
            if u >= TARGET_UTILIZATION:
                return n, staleness, u
            if u > best[2]:
                best = (n, staleness, u)
    return best


def grid(quick: bool) -> list[Point]:
    if quick:
        return [Point(0, 3, "T")]  # the calibration run; the planned point follows (often with 3 actors too)
    return [Point(st, n, d) for d in ("small", "T", "2T") for n in (1, 2, 4) for st in (0, 1, 2, 4)]


@contextmanager
def _own_secrets(workdir: Path):
    """Run keys of the benchmark's runs live and die in its workdir, not in the user's key folder."""
    previous = os.environ.get("ECHO2_SECRETS")
    os.environ["ECHO2_SECRETS"] = str(workdir / "secrets")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("ECHO2_SECRETS", None)
        else:
            os.environ["ECHO2_SECRETS"] = previous


def run_overlap_bench(*, quick: bool = False, settings: Settings | None = None, points: list[Point] | None = None,
                      plan: bool = True, keep: Path | None = None,
                      progress: Callable[[str], None] = lambda line: None) -> list[dict]:
    """The grid (or ``points``), then the planned fleet; each result has its synchronous baseline."""
    from echo2.bench.tiny_model import make_tiny_model

    s = settings or (QUICK if quick else FULL)
    workdir = keep or Path(tempfile.mkdtemp(prefix="echo2-overlap-"))
    results: list[dict] = []
    try:
        with _own_secrets(workdir):
            model_dir = make_tiny_model(workdir / "tiny-model")

            def run(p: Point) -> dict:
                r = run_point(s, p, workdir, model_dir)
                results.append(r)
                progress(f"{p.scenario} S={p.staleness} actors={p.actors} D={p.d_label}: utilization measured "
                         f"{r['measured_utilization']:.3f}, predicted {r['predicted_utilization']:.3f} "
                         f"({r['run_seconds']:.0f}s)")
                return r

            for p in points if points is not None else grid(quick):
                run(p)
            if plan:
                # calibrate on the synchronous run with D = T_train and the largest fleet measured
                calib = max((r for r in results if r["d_label"] == "T" and r["staleness"] == 0),
                            key=lambda r: r["actors"], default=results[-1])
                n, staleness, predicted = plan_fleet(calib, s)
                progress(f"planner (from {calib['run_id']}): {n} actors, S={staleness}, predicted {predicted:.3f}")
                planned = run(Point(staleness, n, calib["d_label"], "planned"))
                planned["planned_from"] = calib["run_id"]
                if _sync(results, planned) is None:
                    run(Point(0, n, calib["d_label"], "sync"))
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    for r in results:
        base = _sync(results, r)
        r["sync_steps_per_minute"] = base["steps_per_minute"] if base else None
        r["ratio"] = r["steps_per_minute"] / base["steps_per_minute"] if base else None
        r["settings"] = asdict(s)
    return results


def _sync(results: list[dict], r: dict) -> dict | None:
    """The synchronous (S = 0) measurement with the same fleet and dissemination."""
    return next((b for b in results if b["staleness"] == 0 and b["actors"] == r["actors"]
                 and b["d_label"] == r["d_label"] and b["scenario"] != "planned"), None)


def summary_line(results: list[dict]) -> str:
    worst = max(r["abs_diff"] for r in results)
    ok = all(r["abs_diff"] <= TOLERANCE for r in results)
    line = (f"max |predicted - measured| utilization: {worst:.3f}; every point within {TOLERANCE:.2f}: "
            f"{'yes' if ok else 'no'}")
    planned = [r for r in results if r["scenario"] == "planned"]
    if planned:
        p = planned[-1]
        line += (f"; planned fleet ({p['actors']} actors, S={p['staleness']}): measured utilization "
                 f"{p['measured_utilization']:.3f} (target >= {TARGET_UTILIZATION:.2f}: "
                 f"{'met' if p['measured_utilization'] >= TARGET_UTILIZATION else 'missed'})")
    return line


def _lags(shares: dict[str, float]) -> str:
    return " ".join(f"{k}:{v:.2f}" for k, v in shares.items())


def print_table(results: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped into a file: rich would cut the table to 80 columns
            console = Console(width=170)
    s = results[0]["settings"]
    table = Table(title=f"overlap, timing workload: T_train {s['train_seconds']:g}s, G {s['batch_seconds']:g}s, "
                        f"R {s['groups_per_step']}, b {s['groups_per_batch']}, {s['measured_steps']} measured steps "
                        f"(D s, T s, U s: fitted from each run)")
    for col in ("scenario", "S", "actors", "D", "D s", "T s", "U s", "util meas", "util pred", "|diff|", "bound",
                "steps/min", "sync steps/min", "ratio", "lag: share of groups"):
        table.add_column(col, justify="left" if col in ("scenario", "D", "bound", "lag: share of groups") else "right")
    for r in results:
        sync = r["sync_steps_per_minute"]
        table.add_row(r["scenario"], str(r["staleness"]), str(r["actors"]), r["d_label"], f"{r['dissemination_s']:.2f}",
                      f"{r['train_seconds']:.2f}", f"{r['upload_seconds']:.2f}", f"{r['measured_utilization']:.3f}",
                      f"{r['predicted_utilization']:.3f}", f"{r['abs_diff']:.3f}", r["bound"],
                      f"{r['steps_per_minute']:.1f}", f"{sync:.1f}" if sync else "-",
                      f"{r['ratio']:.2f}" if r["ratio"] else "-", _lags(r["lag_histogram"]))
    console.print(table)
