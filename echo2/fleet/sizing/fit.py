"""Fitting the capacity model's inputs from a finished (or running) run folder.

Every input is read from what the run recorded, none is guessed:

    T    mean learner busy time per step: ``seconds - wait_seconds`` in ``reports/metrics.json``
         (loss, backward, optimizer, publish, checkpoint: everything but waiting for rollouts)
    R, b, S, k, Q   the run's own config (``run.json``)
    G_i  each actor's median whole turn per batch, less its commit (``echo2.measured.
         previous_batch_seconds`` - ``put_seconds``: swap, flow control, sampling, scoring,
         encoding); ``generation_seconds`` (sampling alone) where an actor did not record it
    D    median ``echo2.measured.fetch_seconds`` the actors wrote into their files' schema metadata:
         how long one version's transfer took (the model adds the waits around it: a receiver that
         is busy, a batch to finish before the swap). The end-to-end time, from the learner's
         publish (manifest ``created_at``) to generating with it, is reported beside it
         (``echo2.measured.dissemination_seconds``).
    put  median ``echo2.measured.put_seconds``: the commit an actor waits for after each batch
    swap median ``echo2.measured.swap_seconds``: loading a new version into the engine
    U    the commit (``put``): a file is in the store when the actor's put returns; the learner
         then sees it at its next listing, every ``train.poll_seconds`` while it waits, which the
         model simulates. Without recorded puts: the 10th percentile of (ledger entry written -
         file's ``created_at``) over used files (upload plus the poll delay)
    Version 0's arrival figures (dissemination, fetch, swap) are left out: they include the actor starting.

The actors' figures come only from files a step used (``used_files``): the learner validated them and
recorded what each says of its making in the file's ledger entry (``ledger.used_measurements``), so
the fit reads no actor's file, and junk or a claim no honest file makes (a ``created_at`` in the year
146000) never reaches it. A run recorded before the ledger kept these figures is measured from its
used files themselves, each read only up to the run's ``trust.max_rollout_file_mb``.

Measured against predicted: utilization = sum of busy time / wall time between the first and last
measured step (step timestamps in ``metrics.json``), after ``skip_steps`` warm-up steps (version 0
reaching every actor, the backlog filling).

Actors are untrusted: their numbers only feed this estimate, are parsed as finite non-negative
floats or ignored, and never reach training. No actor's numbers weigh more than another's, and none is taken beyond
what the store saw: each figure is a median per actor first, then the median over actors (one actor writing 3e38
moves nothing); a time an actor claims for a file is cut to the time between its previous commit and this one by
the store's own clock (``commit_windows``: an actor generates and commits one batch at a time); and the files of an
actor the run banned or expelled (``banned_actors``) count for nothing.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

import pyarrow as pa

from echo2.config import config_from_run
from echo2.data import layout
from echo2.data.ledger import MEASURED_NAMES, consumed_keys, read_bans, read_events, used_measurements
from echo2.data.rollouts import InvalidRollouts, decode_rollouts
from echo2.data.store import NotFound, ObjectStore, open_store
from echo2.errors import Echo2InputError
from echo2.fleet.sizing.capacity import Workload, min_staleness, predict

MAX_FILES_READ = 400
"""Used rollout files measured for G and D (the newest ones): enough for medians, bounded for long runs."""


@dataclass
class RunFit:
    workload: Workload
    batch_seconds: list[float]
    """One entry per actor of the configured fleet: its median seconds per batch."""
    measured_utilization: float
    measured_step_seconds: float
    measured_lag: dict[int, float]
    """Share of used groups by lag over the measured steps."""
    steps: int
    """Steps measured (after the warm-up)."""
    end_to_end_dissemination_seconds: float | None = None
    """Median time from a version's publish to an actor generating with it (waits included)."""

    def as_dict(self) -> dict:
        w = self.workload
        return {"train_seconds": w.train_seconds, "groups_per_step": w.groups_per_step,
                "groups_per_batch": w.groups_per_batch, "staleness": w.staleness,
                "dissemination_seconds": w.dissemination_seconds, "upload_seconds": w.upload_seconds,
                "publish_every": w.publish_every, "max_pending_batches": w.max_pending_batches,
                "batch_seconds": self.batch_seconds, "measured_utilization": self.measured_utilization,
                "measured_step_seconds": self.measured_step_seconds, "steps": self.steps,
                "put_seconds": w.put_seconds, "swap_seconds": w.swap_seconds,
                "end_to_end_dissemination_seconds": self.end_to_end_dissemination_seconds,
                "measured_lag": {str(k): v for k, v in sorted(self.measured_lag.items())}}


def open_run(run: str) -> ObjectStore:
    """A run folder from its URL or path (``runs/<id>``, ``s3://bucket/echo2/runs/<id>``)."""
    store = open_store(run, {})
    if not store.exists(layout.RUN_JSON):
        raise Echo2InputError(f"{run} is not a run folder (no {layout.RUN_JSON})")
    return store


def run_config(store: ObjectStore):
    """The run's resolved config, as its ``run.json`` records it."""
    return config_from_run(store.get_json(layout.RUN_JSON)["config"], f"{store.url}/{layout.RUN_JSON}")


def _finite(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x >= 0 else None


def fit_run(store: ObjectStore, *, skip_steps: int = 2, history: list[dict] | None = None) -> RunFit:
    """The capacity model's inputs and the measured outcome of the run in ``store``; ``history``
    (the learner's per-step metrics) fits a run still in progress."""
    config = run_config(store)
    if history is None:
        try:
            history = json.loads(store.get(layout.report_key("metrics.json")))
        except NotFound:
            raise Echo2InputError(f"{store.url} has no reports/metrics.json yet: fit a run that has finished") from None
    steps = [m for m in history if _finite(m.get("time")) is not None][skip_steps:]
    if len(steps) < 3:
        raise Echo2InputError(f"{store.url} has {len(steps)} steps after {skip_steps} warm-up steps; need 3 or more")
    busy = [max(0.0, m["seconds"] - m.get("wait_seconds", 0.0)) for m in steps]
    wall = steps[-1]["time"] - steps[0]["time"]
    measured = steps[1:]  # the wall time between the first and last timestamps covers these steps
    step_seconds = wall / len(measured)
    utilization = min(1.0, sum(busy[1:]) / wall) if wall > 0 else 1.0
    first_measured_step = skip_steps + 2  # history[i] is step i + 1; the first kept step only starts the clock

    entries = _ledger_entries(store)
    events = read_events(store)
    banned = banned_actors(store, events)
    used = [f for f in used_files(store, entries, max_file_bytes=int(config.trust.max_rollout_file_mb * 2**20))
            if f.actor not in banned]
    generation, measured_by_actors, created = _actor_figures(bounded(store, used, actor_starts(events)))
    used_at, lag = _read_ledger(entries, first_measured_step)
    uploads = sorted(used_at[k] - created[k] for k in used_at if k in created and used_at[k] >= created[k])
    upload = uploads[len(uploads) // 10] if uploads else 0.0

    r, t = config.rollout, config.train
    per_actor = [statistics.median(v) for v in generation.values() if v]
    if not per_actor:
        raise Echo2InputError(f"{store.url} has no used rollout files with their timings to measure generation time")
    n = config.fleet.actors if isinstance(config.fleet.actors, int) else len(per_actor)
    if len(per_actor) != n:  # replaced (or, with auto, added) actors have new ids: n workers of the typical speed
        per_actor = [statistics.median(per_actor)] * n
    median = {name: statistics.median([statistics.median(v) for v in by_actor.values()])
              for name, by_actor in measured_by_actors.items() if by_actor}
    workload = Workload(train_seconds=max(statistics.mean(busy), 1e-3), groups_per_step=t.groups_per_step,
                        groups_per_batch=r.groups_per_batch, staleness=t.staleness,
                        dissemination_seconds=median.get("fetch_seconds", median.get("dissemination_seconds", 0.0)),
                        upload_seconds=median.get("put_seconds", upload), publish_every=config.publish.every,
                        learner_poll_seconds=t.poll_seconds,
                        max_pending_batches=r.max_pending_batches, put_seconds=median.get("put_seconds"),
                        swap_seconds=median.get("swap_seconds", 0.0))
    total = sum(lag.values()) or 1
    return RunFit(workload, per_actor, utilization, step_seconds, {k: v / total for k, v in lag.items()},
                  len(measured), median.get("dissemination_seconds"))


def fit_summary(run: str) -> tuple[dict, Workload]:
    """Predicted against measured for a finished run (``fit_run``), and the fitted workload: what
    ``echo2 plan --from-run`` prints."""
    fit = fit_run(open_run(run))
    p = predict(fit.workload, fit.batch_seconds)
    return {"run": run, "steps": fit.steps, "batch_seconds": fit.batch_seconds,
            "measured_utilization": fit.measured_utilization, "predicted_utilization": p.utilization,
            "measured_step_seconds": fit.measured_step_seconds, "predicted_step_seconds": p.step_seconds,
            "measured_lag": {str(k): v for k, v in sorted(fit.measured_lag.items())},
            "predicted_lag": {str(k): v for k, v in sorted(p.lag.items())}, "bound": p.bound,
            "min_staleness": min_staleness(fit.workload, fit.batch_seconds),
            "workload": asdict(fit.workload)}, fit.workload


MEASURED = MEASURED_NAMES


@dataclass(frozen=True)
class UsedFile:
    """A rollout file a step used, with what it says of its making (``ledger.used_measurements``)."""

    key: str
    actor: str
    version: int
    measured: dict[str, float]


def _ledger_entries(store: ObjectStore) -> list[tuple[int, dict]]:
    """(step, entry) of every step's ledger entry (amendments included), oldest first."""
    out = []
    for key in consumed_keys(store):
        step = layout.step_of_consumed_key(key)
        if step is not None:
            out.append((step, store.get_json(key)))
    return sorted(out, key=lambda se: se[0])


def used_files(store: ObjectStore, entries: list[tuple[int, dict]] | None = None, *,
               max_file_bytes: int) -> list[UsedFile]:
    """The newest ``MAX_FILES_READ`` files the run's steps used, oldest first, with their figures: from
    their ledger entries, or (an entry written before the ledger kept them) from the file itself if it is
    at most ``max_file_bytes`` and decodes. A file no step used is never read."""
    files: dict[str, UsedFile] = {}
    for _, record in entries if entries is not None else _ledger_entries(store):
        for item in record.get("used", []):
            parsed = layout.parse_rollout_key(str(item.get("key", "")))
            if parsed is not None:
                measured = item.get("measured")
                files[item["key"]] = UsedFile(item["key"], parsed[1], parsed[0],
                                              measured if isinstance(measured, dict) else None)
    chosen = sorted(files.values(), key=lambda f: (f.version, f.key))[-MAX_FILES_READ:]
    out = []
    for f in chosen:
        measured = f.measured if f.measured is not None else _measured_from_file(store, f.key, max_file_bytes)
        if measured is not None:
            out.append(UsedFile(f.key, f.actor, f.version,
                                {k: _finite(v) for k, v in measured.items() if _finite(v) is not None}))
    return out


def _measured_from_file(store: ObjectStore, key: str, max_file_bytes: int) -> dict[str, float] | None:
    """The figures of a used file its ledger entry does not hold (a run recorded before it did): None when
    the file is gone, too large or does not read as a rollout file."""
    try:
        if store.size(key) > max_file_bytes:
            return None
        return used_measurements(decode_rollouts(store.get(key)))
    except (InvalidRollouts, NotFound, KeyError, IndexError, TypeError, ValueError, pa.ArrowException):
        return None  # not a rollout file (any more): no figures


def file_limit(store: ObjectStore) -> int:
    """The run's own limit on a rollout file's size in bytes (``trust.max_rollout_file_mb``)."""
    config = run_config(store)
    return int(config.trust.max_rollout_file_mb * 2**20)


BANNED_KINDS = ("expelled", "banned")
"""Ledger events that mark an actor the run caught lying: none of its files is measured."""
CLAIMED_TIMES = ("generation_seconds", "previous_batch_seconds", "put_seconds", "swap_seconds", "fetch_seconds")
"""The times an actor claims for one turn of its loop: each within the time between two of its commits."""


def banned_actors(store: ObjectStore, events: list[dict]) -> set[str]:
    """The actors the ledger says were banned (its ban records) or expelled, whenever: their earlier files count
    for nothing."""
    return set(read_bans(store)) | {str(e.get("actor_id")) for e in events if e.get("kind") in BANNED_KINDS}


def actor_starts(events: list[dict]) -> dict[str, float]:
    """Per actor, when the fleet first asked for it (the learner's clock): before it, none of its work began."""
    starts: dict[str, float] = {}
    for e in events:
        ts, actor = _finite(e.get("ts")), e.get("actor_id")
        if e.get("kind") in ("requested", "launch") and ts is not None and isinstance(actor, str):
            starts[actor] = min(ts, starts.get(actor, ts))
    return starts


def commit_windows(store: ObjectStore, files: list[UsedFile], starts: dict[str, float]) -> dict[str, float | None]:
    """Per file key: the seconds between its actor's previous commit (or its start) and this one, by the store's
    clock (``ObjectStore.modified``); None where that cannot be told (the file is gone, no earlier mark). An actor
    generates and commits one batch at a time, so no time it claims for a file can exceed its window. A store
    that keeps no times bounds nothing (every window infinite)."""
    out: dict[str, float | None] = {}
    by_actor: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for f in files:
        try:
            by_actor[f.actor].append((store.modified(f.key), f.key))
        except NotImplementedError:
            return {f.key: math.inf for f in files}
        except NotFound:
            out[f.key] = None
    for actor, commits in by_actor.items():
        previous = starts.get(actor)
        for when, key in sorted(commits):
            out[key] = when - previous if previous is not None and when >= previous else None
            previous = when
    return out


def bounded(store: ObjectStore, files: list[UsedFile], starts: dict[str, float]) -> list[UsedFile]:
    """``files`` with each claimed time cut to its commit window (``commit_windows``); a file whose window cannot
    be told keeps no claimed time."""
    windows = commit_windows(store, files, starts)
    out = []
    for f in files:
        window = windows.get(f.key)
        measured = {k: v for k, v in f.measured.items() if k not in CLAIMED_TIMES}
        if window is not None:
            measured.update({k: min(v, window) for k, v in f.measured.items() if k in CLAIMED_TIMES})
        out.append(UsedFile(f.key, f.actor, f.version, measured))
    return out


def _actor_figures(used: list[UsedFile]) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]],
                                                  dict[str, float]]:
    """Per actor: batch generation seconds; per name in MEASURED, per actor: its values; per file: created_at."""
    generation: dict[str, list[float]] = defaultdict(list)
    measured: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    created: dict[str, float] = {}
    for f in used:
        values = {name: f.measured.get(name) for name in MEASURED}
        if f.version == 0:  # version 0's arrival includes the actor starting up
            values.update(dissemination_seconds=None, fetch_seconds=None, swap_seconds=None)
        for name, value in values.items():
            if value is not None:
                measured[name][f.actor].append(value)
        turn, put = values["previous_batch_seconds"], values["put_seconds"]
        whole_turn = turn is not None and put is not None and turn >= put
        seconds = turn - put if whole_turn else f.measured.get("generation_seconds")
        if seconds is not None:
            generation[f.actor].append(seconds)
        if "created_at" in f.measured:
            created[f.key] = f.measured["created_at"]
    return generation, measured, created


def _read_ledger(entries: list[tuple[int, dict]], first_step: int) -> tuple[dict[str, float], Counter]:
    """When each used file was chosen, and the lag histogram (groups) of steps >= ``first_step``."""
    used_at: dict[str, float] = {}
    lag: Counter = Counter()
    for step, record in entries:
        for item in record.get("used", []):
            used_at[item["key"]] = record.get("written_at", 0.0)
            if step >= first_step:
                lag[int(item.get("lag", 0))] += int(item.get("groups", 1))
    return used_at, lag
