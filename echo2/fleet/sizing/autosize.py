"""``fleet.actors: auto``: size the fleet from the capacity model, fitted to the run as it goes.

The fleet starts with ``fleet.min_actors``. Once a few steps are in, the learner's busy time per
step, the actors' batch time and the dissemination and upload times are measured from the run
itself (``fit.py``: from the files steps used, as the ledger records them), and the fleet becomes
the smallest one the model predicts keeps the learner busy ``fleet.target_utilization`` of the time
(``capacity.workers_needed``), never more than ``fleet.max_actors``. It is measured again every
``RESIZE_EVERY`` steps, since a model's speed and the learner's step time change as completions
grow or shrink during training. Sizing is an optimization: when it fails, for whatever reason, the
fleet stays as it is and the run goes on (``auto_fleet_size`` logs why).
"""

from __future__ import annotations

import logging
import statistics

from echo2.config import Config
from echo2.data.store import ObjectStore
from echo2.errors import Echo2InputError
from echo2.fleet.sizing.capacity import workers_needed
from echo2.fleet.sizing.fit import fit_run

log = logging.getLogger("echo2.fleet")

FIRST_RESIZE_STEP = 4
"""Steps measured before the first sizing: the first one includes the actors' start-up."""
RESIZE_EVERY = 10


def due(step: int, sized_at: int | None) -> bool:
    """Whether to size the fleet at ``step``, the last sizing having been at ``sized_at`` (None:
    never; a step where the fit could not tell yet does not count, so it is tried again next step)."""
    if step < FIRST_RESIZE_STEP:
        return False
    return sized_at is None or step - sized_at >= RESIZE_EVERY


def auto_fleet_size(config: Config, store: ObjectStore, history: list[dict]) -> tuple[int, str] | None:
    """The number of actors the model asks for now, with the reason; None when it cannot tell yet, or
    when sizing fails: the fleet is an optimization, and a failure of its estimate must never end a run
    (logged with its traceback, then the fleet stays as it is)."""
    try:
        return _fleet_size(config, store, history)
    except Echo2InputError as exc:  # too few steps or files yet: keep the fleet as it is
        log.info("fleet sizing: %s", exc)
    except Exception as exc:
        if store.url in _FAILED:  # tried again at every step: the traceback once, then one line each
            log.warning("fleet sizing failed again (%s: %s); the fleet stays as it is", type(exc).__name__, exc)
        else:
            _FAILED.add(store.url)
            log.exception("fleet sizing failed; the fleet stays as it is")
    return None


_FAILED: set[str] = set()
"""Runs (store URLs) whose fleet sizing has failed and logged its traceback."""


def _fleet_size(config: Config, store: ObjectStore, history: list[dict]) -> tuple[int, str]:
    fleet = config.fleet
    fit = fit_run(store, skip_steps=1, history=history)
    per_batch = statistics.median(fit.batch_seconds)
    n = workers_needed(fit.workload, per_batch, fleet.target_utilization, fleet.max_actors)
    n = max(fleet.min_actors, n)
    w = fit.workload
    reason = (f"capacity model: T_train {w.train_seconds:.2f}s, {per_batch:.2f}s per batch, "
              f"D {w.dissemination_seconds:.2f}s, "
              f"S={w.staleness}: {n} actors for {fleet.target_utilization:.0%} utilization (max {fleet.max_actors})")
    return n, reason
