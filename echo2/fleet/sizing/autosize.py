"""``fleet.actors: auto``: size the fleet from the capacity model, fitted to the run as it goes, and buy
what the one chooser (``choose.choose_fleet``) buys.

How many. The fleet starts with ``fleet.min_actors`` (or, given a workload to plan from, with the chooser's
fleet for it: what ``echo2 plan`` prints for the same inputs). Once a few steps are in, the learner's busy
time per step, the actors' batch time and the dissemination and upload times are measured from the run
itself (``fit.py``: from the files steps used, as the ledger records them), and the fleet becomes the
smallest one the model predicts keeps the learner busy ``fleet.target_utilization`` of the time
(``capacity.workers_needed``), never more than ``fleet.max_actors``. It is measured again every
``RESIZE_EVERY`` steps, since a model's speed and the learner's step time change as completions grow or
shrink during training. Sizing is an optimization: when it fails, for whatever reason, the fleet stays as it
is and the run goes on (``auto_fleet_size`` logs why).

Which offers. Where the fleet's offers are catalog offers (SkyPilot's, or a local fleet priced as catalog
offers with ``fleet.price_as``), the fleet is not a count of one offer but a mix: ``FleetChooser`` hands the
fitted workload (T, D, U, R, b, S, k, Q) and the tokens per batch (the median over the files steps used) to
``choose_fleet`` with the offers' catalog rows, the worker profiles with the run's own measured speeds in
place (``measured.with_measurements``; a local process priced as an offer is never measured as that GPU),
the budget, and two overrides the manager keeps:

* caps: an offer that had no capacity is capped at what the fleet holds of it until
  ``unavailable_retry_s`` has passed, so the chooser plans around it;
* reclaim rates measured by the run's own ledger (``measured_reclaim_rates``): reclaims per instance-hour of
  each offer, counted from its launch events to its end events (reclaimed, or any other end, or now). The
  measured rate replaces the assumed one (``activation.reclaim_rate``) once the two differ beyond chance:
  a two-sided Poisson test of the reclaims seen against the assumed rate times the instance-hours,
  rejected at ``RECLAIM_ALPHA`` (few reclaims over few hours say nothing; many in a short time do).

The chosen mix is bounded by ``fleet.max_actors`` (the dearest instances per expected throughput go first)
and topped up to ``fleet.min_actors`` on the mix's first offer.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

from echo2.config import Config
from echo2.data.store import ObjectStore
from echo2.errors import Echo2InputError
from echo2.fleet.sizing.activation import Activation, reclaim_rate
from echo2.fleet.sizing.capacity import Workload, workers_needed
from echo2.fleet.sizing.choose import choose_fleet
from echo2.fleet.sizing.fit import file_limit, fit_run, used_files

log = logging.getLogger("echo2.fleet")

FIRST_RESIZE_STEP = 4
"""Steps measured before the first sizing: the first one includes the actors' start-up."""
RESIZE_EVERY = 10
RECLAIM_ALPHA = 0.01
"""Significance of the test that a measured reclaim rate differs from the assumed one."""
STARTS = ("launch",)
ENDS = ("exited", "terminated", "reclaimed", "crashed", "unavailable")


def due(step: int, sized_at: int | None) -> bool:
    """Whether to size the fleet at ``step``, the last sizing having been at ``sized_at`` (None:
    never; a step where the fit could not tell yet does not count, so it is tried again next step)."""
    if step < FIRST_RESIZE_STEP:
        return False
    return sized_at is None or step - sized_at >= RESIZE_EVERY


@dataclass
class FleetSize:
    """What the capacity model asks of the fleet now: a number of actors (for a fleet of one offer) and, for the
    chooser, the workload and tokens per batch it was fitted to. Unpacks as ``(actors, reason)``."""

    actors: int
    reason: str
    workload: Workload | None = None
    batch_tokens: float | None = None

    def __iter__(self):
        return iter((self.actors, self.reason))


def auto_fleet_size(config: Config, store: ObjectStore, history: list[dict]) -> FleetSize | None:
    """The number of actors the model asks for now, with the reason (and the fitted workload); None when it
    cannot tell yet, or when sizing fails: the fleet is an optimization, and a failure of its estimate must never
    end a run (logged with its traceback, then the fleet stays as it is)."""
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


def _fleet_size(config: Config, store: ObjectStore, history: list[dict]) -> FleetSize:
    fleet = config.fleet
    fit = fit_run(store, skip_steps=1, history=history)
    per_batch = statistics.median(fit.batch_seconds)
    n = workers_needed(fit.workload, per_batch, fleet.target_utilization, fleet.max_actors)
    n = max(fleet.min_actors, n)
    w = fit.workload
    tokens = [f.measured["tokens"] for f in used_files(store, max_file_bytes=file_limit(store))
              if (f.measured.get("tokens") or 0) > 0]
    reason = (f"capacity model: T_train {w.train_seconds:.2f}s, {per_batch:.2f}s per batch, "
              f"D {w.dissemination_seconds:.2f}s, "
              f"S={w.staleness}: {n} actors for {fleet.target_utilization:.0%} utilization (max {fleet.max_actors})")
    return FleetSize(n, reason, w, statistics.median(tokens) if tokens else None)


# -- reclaim rates from the run's own ledger ---------------------------------------------------------------------
def _offer_key(e: dict) -> str | None:
    """``provider/instance_type@region:market`` of a fleet event (``ActorOffer.name``, activation's override key)."""
    fields = [e.get(k) for k in ("provider", "instance_type", "region")]
    if not all(isinstance(f, str) and f for f in fields) or not isinstance(e.get("spot"), bool):
        return None
    return f"{fields[0]}/{fields[1]}@{fields[2]}:{'spot' if e['spot'] else 'on-demand'}"


def measured_reclaim_rates(events: list[dict], now: float) -> dict[str, tuple[int, float]]:
    """Per offer (``ActorOffer.name``): (reclaims, instance-hours) from the ledger's fleet events: each actor from
    its launch to its end event (or ``now``), billed to the offer its newest event names (a SkyPilot launch may
    land on an alternative, which its "running" event names)."""
    lives: dict[str, dict] = {}
    for e in sorted((e for e in events if isinstance(e, dict) and isinstance(e.get("ts"), (int, float))),
                    key=lambda e: e["ts"]):
        actor, kind = str(e.get("actor_id", "")), e.get("kind")
        life = lives.get(actor)
        if kind in STARTS and life is None:
            life = lives[actor] = {"start": float(e["ts"]), "end": None, "reclaimed": False, "offer": None}
        if life is None or life["end"] is not None:
            continue
        life["offer"] = _offer_key(e) or life["offer"]
        if kind in ENDS:
            life["end"], life["reclaimed"] = float(e["ts"]), kind == "reclaimed"
    out: dict[str, tuple[int, float]] = {}
    for life in lives.values():
        if life["offer"] is None:
            continue
        hours = max(0.0, (life["end"] if life["end"] is not None else now) - life["start"]) / 3600
        k, h = out.get(life["offer"], (0, 0.0))
        out[life["offer"]] = (k + life["reclaimed"], h + hours)
    return out


def _poisson_cdf(k: int, mean: float) -> float:
    """P(X <= k) for X ~ Poisson(mean)."""
    if mean <= 0:
        return 1.0
    term = total = math.exp(-mean) if mean < 700 else 0.0
    if term == 0.0:  # a huge mean: the normal approximation
        return 0.5 * math.erfc(-(k + 0.5 - mean) / math.sqrt(2 * mean))
    for i in range(1, k + 1):
        term *= mean / i
        total += term
    return min(1.0, total)


def rate_differs(reclaims: int, hours: float, assumed_per_hour: float, alpha: float = RECLAIM_ALPHA) -> bool:
    """Whether ``reclaims`` over ``hours`` instance-hours are unlikely under ``assumed_per_hour`` (two-sided
    Poisson test at ``alpha``)."""
    if hours <= 0:
        return False
    mean = assumed_per_hour * hours
    if mean <= 0:
        return reclaims > 0
    upper = 1.0 - _poisson_cdf(reclaims - 1, mean) if reclaims > 0 else 1.0  # P(X >= k)
    lower = _poisson_cdf(reclaims, mean)  # P(X <= k)
    return min(upper, lower) < alpha / 2


# -- the chooser of the live fleet -------------------------------------------------------------------------------
@dataclass
class Mix:
    """A fleet to buy: (offer, count) in the chooser's order, and why."""

    counts: list[tuple[object, int]]
    """``(ActorOffer, count)``: the backend's offers."""
    reason: str
    activation: Activation | None = None

    @property
    def actors(self) -> int:
        return sum(n for _, n in self.counts)


@dataclass
class FleetChooser:
    """``choose_fleet`` over a fleet's offers (``ActorOffer``s that keep their catalog row), for the manager."""

    offers: list
    """The backend's offers (``ActorOffer``), each with ``catalog`` set."""
    model_params_b: float
    active_params_b: float | None = None
    profiles: dict = field(default_factory=dict)
    """Worker profiles (``prices.catalog.load_profiles``), the run's measurements in place where it has any."""
    target_utilization: float = 0.95
    min_actors: int = 1
    max_actors: int | None = None
    budget_usd_per_hour: float | None = None
    reclaim: dict[str, float] = field(default_factory=dict)
    """Reclaim-rate overrides the workload file gives (``actors.reclaim_per_hour``); the ledger's measured ones
    (the manager's) go over them."""
    caps: dict[str, int] = field(default_factory=dict)
    """Caps the workload file gives (``actors.caps``); the manager's for offers found full go over them."""

    @classmethod
    def for_offers(cls, offers: list | None, config, model_params_b: float | None,
                   active_params_b: float | None = None) -> "FleetChooser | None":
        """A chooser where the fleet is ``auto`` and every offer is a catalog offer of a known model size; else None
        (a local fleet on this machine, unpriced, is sized by count alone)."""
        if config.actors != "auto" or not offers or model_params_b is None or any(o.catalog is None for o in offers):
            return None
        from echo2.fleet.prices.catalog import DEFAULT_PROFILES, load_profiles

        return cls(list(offers), model_params_b, active_params_b, load_profiles(DEFAULT_PROFILES),
                   config.target_utilization, config.min_actors, config.max_actors, config.max_usd_per_hour)

    def measured(self, store: ObjectStore) -> None:
        """Put the run's measured speeds into the profiles (``measured.measure_run``; simulated prices ignored)."""
        from echo2.fleet.sizing.measured import measure_run, with_measurements

        self.profiles = with_measurements(self.profiles, measure_run(store, self.model_params_b))

    def assumed_reclaim_rate(self, offer) -> float:
        return reclaim_rate(offer.catalog, offer.spot, self.reclaim)

    def measured_reclaims(self, events: list[dict], now: float) -> dict[str, float]:
        """Per offer of the fleet whose ledger reclaims differ beyond chance from the assumed rate
        (``rate_differs``): the measured reclaims per instance-hour, as a ``reclaim`` override."""
        out = {}
        rates = measured_reclaim_rates(events, now)
        for offer in self.offers:
            k, hours = rates.get(offer.name, (0, 0.0))
            assumed = self.assumed_reclaim_rate(offer)
            if hours > 0 and rate_differs(k, hours, assumed):
                out[offer.name] = k / hours
                log.warning("fleet: %s was reclaimed %d times in %.3g instance-hours (%.3g/h; %.3g/h assumed): "
                            "planning with the measured rate", offer.name, k, hours, k / hours, assumed)
        return out

    def first_plan(self, workload: str, catalog: list) -> tuple[Mix, FleetSize]:
        """The fleet ``echo2 plan --workload WORKLOAD`` prints over ``catalog`` (``run_plan.plan_run``: the same
        call), as a mix of this fleet's offers, and the capacity workload and tokens per batch it was planned
        for (what the chooser is asked again with until the run has measured its own). A planned offer the fleet
        cannot launch (not among its offers) is left out, said in the reason. Its reclaim rate and caps stay the
        chooser's; the first plan is at the workload's ``actors.target_utilization``, later ones at the fleet's."""
        from echo2.fleet.planner.run_plan import plan_run
        from echo2.fleet.planner.workload_file import load_workload

        wf = load_workload(workload)
        if wf.actors.reclaim_per_hour is not None:
            self.reclaim = {"spot": wf.actors.reclaim_per_hour}
        self.caps = dict(wf.actors.caps or {})  # the market's assumptions; the run's target stays fleet.target_...
        out = plan_run(wf, catalog, self.profiles, neighbours=())
        if not out.get("fleet"):
            raise Echo2InputError(f"fleet.workload {workload}: {out.get('reason') or 'no fleet'}")
        by_name = {o.name: o for o in self.offers}
        counts, missing = [], []
        for row in out["fleet"]:
            key = f"{row['offer']['name']}:{row['market']}"
            if key in by_name:
                counts.append((by_name[key], int(row["count"])))
            else:
                missing.append(f"{row['count']} x {key}")
        if not counts:
            raise Echo2InputError(f"fleet.workload {workload}: the plan buys {', '.join(missing)}, none of which "
                                  "this fleet's offers hold (fleet.price_as / fleet.gpus / fleet.providers)")
        reason = (f"echo2 plan --workload {workload}: ${out['usd_per_hour']:.2f}/h, predicted utilization "
                  f"{out['utilization']:.0%}" + (f"; left out (not among the fleet's offers): {', '.join(missing)}"
                                                 if missing else ""))
        batch_tokens = wf.rollout.groups_per_batch * wf.rollout.group_size * wf.rollout.completion_tokens_mean
        inputs = FleetSize(sum(n for _, n in counts), reason, Workload(**out["workload"]), batch_tokens)
        return Mix(counts, reason), inputs

    def choose(self, workload: Workload, batch_tokens: float, *, reclaim: dict[str, float] | None = None,
               caps: dict[str, int] | None = None) -> Mix | None:
        """The chooser's mix of ``self.offers`` for ``workload`` (None when no fleet within the caps and the
        budget can be had at all; a fleet short of the target is bought as the best there is, said in the
        reason)."""
        markets = tuple(sorted({"spot" if o.spot else "on-demand" for o in self.offers}))
        by_name = {o.name: o for o in self.offers}
        chosen = choose_fleet(workload, [o.catalog for o in self.offers], self.profiles,
                              model_params_b=self.model_params_b, active_params_b=self.active_params_b,
                              batch_tokens=batch_tokens, target_utilization=self.target_utilization,
                              markets=markets, reclaim={**self.reclaim, **(reclaim or {})},
                              caps={**self.caps, **(caps or {})},
                              budget_usd_per_hour=self.budget_usd_per_hour, best_effort=True)
        if chosen is None:
            return None
        counts = [(by_name[c.name], n) for c, n in chosen.fleet if c.name in by_name]
        notes = []
        if self.max_actors is not None and sum(n for _, n in counts) > self.max_actors:
            counts = _trim(counts, chosen, self.max_actors)
            notes.append(f"capped at fleet.max_actors={self.max_actors}")
        if counts and sum(n for _, n in counts) < self.min_actors:
            counts[0] = (counts[0][0], counts[0][1] + self.min_actors - sum(n for _, n in counts))
            notes.append(f"topped up to fleet.min_actors={self.min_actors}")
        p = chosen.prediction
        met = p is not None and p.utilization >= self.target_utilization - 1e-9
        reason = (f"chooser: {chosen.expected_throughput:.3g} groups/s expected for a target of "
                  f"{chosen.target:.3g}, ${chosen.usd_per_hour:.2f}/h, predicted utilization "
                  f"{p.utilization if p else float('nan'):.0%}" + ("" if met else " (short of the target: the best "
                                                                   "fleet within the caps and budget)")
                  + (f"; {', '.join(notes)}" if notes else ""))
        return Mix(counts, reason, chosen)


def _trim(counts: list[tuple[object, int]], chosen: Activation, limit: int) -> list[tuple[object, int]]:
    """At most ``limit`` instances: the dearest per expected throughput go first."""
    value = {c.name: c.usd_per_hour / c.expected_throughput if c.expected_throughput else math.inf
             for c, _ in chosen.fleet}
    order = sorted(range(len(counts)), key=lambda i: value.get(counts[i][0].name, math.inf))
    out, left = {}, limit
    for i in order:
        take = min(counts[i][1], left)
        out[i], left = take, left - take
    return [(counts[i][0], out[i]) for i in range(len(counts)) if out.get(i)]
