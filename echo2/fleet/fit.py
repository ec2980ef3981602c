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

Measured against predicted: utilization = sum of busy time / wall time between the first and last
measured step (step timestamps in ``metrics.json``), after ``skip_steps`` warm-up steps (version 0
reaching every actor, the backlog filling).

Actors are untrusted: their numbers only feed this estimate, are parsed as finite non-negative
floats or ignored, and never reach training.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.ledger import consumed_keys
from echo2.data.rollouts import MEASURED_PREFIX, InvalidRollouts, decode_rollouts
from echo2.data.store import NotFound, ObjectStore, open_store
from echo2.errors import Echo2InputError
from echo2.fleet.capacity import Workload

MAX_FILES_READ = 400
"""Rollout files read for G and D (the newest ones): enough for medians, bounded for long runs."""


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
                "measured_step_seconds": self.measured_step_seconds, "steps": self.steps, "put_seconds": w.put_seconds, "swap_seconds": w.swap_seconds,
                "end_to_end_dissemination_seconds": self.end_to_end_dissemination_seconds,
                "measured_lag": {str(k): v for k, v in sorted(self.measured_lag.items())}}


def open_run(run: str) -> ObjectStore:
    """A run folder from its URL or path (``runs/<id>``, ``s3://bucket/echo2/runs/<id>``)."""
    store = open_store(run, {})
    if not store.exists(layout.RUN_JSON):
        raise Echo2InputError(f"{run} is not a run folder (no {layout.RUN_JSON})")
    return store


def _finite(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x >= 0 else None


def fit_run(store: ObjectStore, *, skip_steps: int = 2, history: list[dict] | None = None) -> RunFit:
    """The capacity model's inputs and the measured outcome of the run in ``store``; ``history``
    (the learner's per-step metrics) fits a run still in progress."""
    config = config_from_dict(store.get_json(layout.RUN_JSON)["config"], f"{store.url}/{layout.RUN_JSON}")
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

    generation, measured_by_actors, created = _read_rollouts(store)
    used_at, lag = _read_ledger(store, first_measured_step)
    uploads = sorted(used_at[k] - created[k] for k in used_at if k in created and used_at[k] >= created[k])
    upload = uploads[len(uploads) // 10] if uploads else 0.0

    r, t = config.rollout, config.train
    per_actor = [statistics.median(v) for v in generation.values() if v]
    if not per_actor:
        raise Echo2InputError(f"{store.url} has no readable rollout files to measure generation time")
    n = config.fleet.actors if isinstance(config.fleet.actors, int) else len(per_actor)
    if len(per_actor) != n:  # replaced (or, with auto, added) actors have new ids: n workers of the typical speed
        per_actor = [statistics.median(per_actor)] * n
    median = {name: statistics.median(values) for name, values in measured_by_actors.items() if values}
    workload = Workload(train_seconds=max(statistics.mean(busy), 1e-3), groups_per_step=t.groups_per_step,
                        groups_per_batch=r.groups_per_batch, staleness=t.staleness,
                        dissemination_seconds=median.get("fetch_seconds", median.get("dissemination_seconds", 0.0)),
                        upload_seconds=median.get("put_seconds", upload), publish_every=t.publish_every,
                        learner_poll_seconds=t.poll_seconds,
                        max_pending_batches=r.max_pending_batches, put_seconds=median.get("put_seconds"),
                        swap_seconds=median.get("swap_seconds", 0.0))
    total = sum(lag.values()) or 1
    return RunFit(workload, per_actor, utilization, step_seconds, {k: v / total for k, v in lag.items()},
                  len(measured), median.get("dissemination_seconds"))


MEASURED = ("dissemination_seconds", "fetch_seconds", "put_seconds", "swap_seconds", "previous_batch_seconds")


def _read_rollouts(store: ObjectStore) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    """Per actor: batch generation seconds; per name in MEASURED: the actors' values; per file: created_at."""
    generation: dict[str, list[float]] = defaultdict(list)
    measured: dict[str, list[float]] = defaultdict(list)
    created: dict[str, float] = {}
    keys = sorted(store.list(layout.ROLLOUTS), key=lambda k: (layout.version_of_rollout_key(k) or -1, k))
    for key in keys[-MAX_FILES_READ:]:
        try:
            table = decode_rollouts(store.get(key))
        except (InvalidRollouts, NotFound):
            continue
        if table.num_rows == 0 or "generation_seconds" not in table.schema.names:
            continue
        actor = key.rsplit("/", 1)[-1].rsplit("-", 1)[0]
        meta = table.schema.metadata or {}
        values = {name: _finite(meta.get(f"{MEASURED_PREFIX}{name}".encode(), b"").decode(errors="replace") or None)
                  for name in MEASURED}
        if layout.version_of_rollout_key(key) == 0:  # version 0's arrival includes the actor starting up
            values.update(dissemination_seconds=None, fetch_seconds=None, swap_seconds=None)
        for name, value in values.items():
            if value is not None:
                measured[name].append(value)
        turn, put = values["previous_batch_seconds"], values["put_seconds"]
        seconds = turn - put if turn is not None and put is not None and turn >= put else \
            _finite(table.column("generation_seconds")[0].as_py())
        if seconds is not None:
            generation[actor].append(seconds)
        if "created_at" in table.schema.names:
            stamp = table.column("created_at")[0].as_py()
            if stamp is not None and hasattr(stamp, "timestamp"):
                created[key] = stamp.timestamp()
    return generation, measured, created


def _read_ledger(store: ObjectStore, first_step: int) -> tuple[dict[str, float], Counter]:
    """When each used file was chosen, and the lag histogram (groups) of steps >= ``first_step``."""
    used_at: dict[str, float] = {}
    lag: Counter = Counter()
    for key in consumed_keys(store):
        step = layout.step_of_consumed_key(key)
        if step is None:
            continue
        record = store.get_json(key)
        for item in record.get("used", []):
            used_at[item["key"]] = record.get("written_at", 0.0)
            if step >= first_step:
                lag[int(item.get("lag", 0))] += int(item.get("groups", 1))
    return used_at, lag
