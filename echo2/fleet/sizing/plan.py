"""The cost-aware fleet planner: the cheapest set of catalog offers whose rollouts keep the learner
busy, on top of the capacity model (``capacity.py``).

Worker types. A catalog offer (``prices.catalog.Offer``) with a profiled GPU becomes a ``WorkerType``: its
price and its seconds per batch, ``b * G * L / (tokens/s per GPU * gpu_count)`` (b groups of G
completions of L tokens; one actor per instance, its batch split over the instance's GPUs). Offers
with the same GPU and GPU count are the same worker to the model, so only the cheapest is kept.

Problem. Choose counts n_j >= 0 (at most ``max_per_type``) minimizing sum n_j * price_j such that
the fleet reaches utilization u (``target_utilization``): ``meets``, i.e. ``capacity.predict``'s
utilization >= u and, when a version is published every step (k = 1), the closed form's
(``closed_form_step_seconds``) too. The two agree to 0.3% at k = 1 (checked on random workloads);
requiring both costs at most that and spares the search from simulating the many fleets that
miss by a hair. predict is an event simulation, so the search works on two necessary conditions
that are cheap to test, both covering knapsacks:

1. Throughput. A steady learner cannot take groups faster than the fleet makes them, so
   utilization u needs  sum n_j mu_j >= u * R / T  (mu_j = b / (G_j + U) groups/s), applied
   with a 2% tolerance (``TOLERANCE``: predict's warm-up can leave a small backlog).
2. Freshness (k = 1). The closed form's freshness term (T + D + F_R) / (1 + S) must be at most
   T / u, i.e. the fill time F_R <= F_max = (1 + S) T / u - T - D: the fleet must commit
   ceil(R / b) batches within F_max, and worker j commits floor(F_max / (G_j + U)) of them.

Algorithm: depth-first branch and bound over the worker types, sorted by price per unit of
throughput. A node fixes the counts of the first j types; it is pruned when its cost plus the
larger of the two fractional (LP) bounds -- covering the remaining throughput, or the remaining
batches, with the remaining types -- is no cheaper than the best fleet found. Whenever a node's
fleet meets both covers it is checked with ``meets`` (memoized): a pass becomes the new best
(adding workers would only cost more); a miss -- flow control, batch granularity, the backlog --
lets the search go on adding workers, which is the "verify, then add workers" step done
exhaustively. Counts are tried from the greedy cover downwards first, so the first fleet found is
the greedy one and prunes most of the tree. The result is optimal over the counts allowed unless
the search hits ``max_evaluations`` predict calls or ``MAX_NODES`` nodes; then
``Mix.proven_optimal`` is False. Brute force over all counts agrees on small instances
(tests/test_plan.py), also against predict's criterion alone. The search itself is
``cover_search`` (covers, caps, budget and an ``accept`` check as parameters), which cost-aware
activation (``activation.py``) reuses with one cover and convex per-type costs.

Reclaims: ``simulate_reclaims`` (its docstring has the model) tells how many extra workers hold
the planned throughput when spot workers are reclaimed. Nothing here prints.

Who uses what: ``echo2 plan`` chooses its fleet with ``choose.choose_fleet`` (``run_plan.py``), the one
chooser the live fleet also buys with, and runs ``simulate_reclaims`` on that fleet; ``cheapest_mix`` and
``plan`` remain the exact planner over (GPU, GPU count) worker types, checked against brute force in
tests/test_plan.py.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace

from echo2.errors import Echo2InputError
from echo2.fleet.prices.catalog import Offer, Profile, fits, gpu_key, profile_for
from echo2.fleet.sizing.capacity import (
    Prediction,
    Workload,
    closed_form_step_seconds,
    min_staleness,
    predict,
    required_throughput,
    throughput,
)
from echo2.fleet.sizing.cover import cover_search

TOLERANCE = 0.02
MAX_COUNT = 512


@dataclass(frozen=True)
class WorkerType:
    """An offer as the capacity model sees it: its price and its seconds per batch."""

    offer: Offer
    usd_per_hour: float
    batch_seconds: float
    tokens_per_second: float
    """Per instance (all its GPUs)."""
    source: str
    """Where the speed figure comes from (the profile's ``source``)."""

    def groups_per_second(self, w: Workload) -> float:
        """mu: groups per second this worker adds to the fleet."""
        return w.groups_per_batch / (self.batch_seconds + w.upload_seconds)


def tokens_per_batch(groups_per_batch: int, group_size: int, completion_tokens: float) -> float:
    """Output tokens one actor generates per batch (rollout file)."""
    return groups_per_batch * group_size * completion_tokens


def worker_types(offers: list[Offer], profiles: dict[str, Profile], *, model_params_b: float, batch_tokens: float,
                 spot: bool = True, gpus: list[str] | None = None,
                 profile_size: float | None = None) -> list[WorkerType]:
    """The cheapest offer of each (GPU, GPU count) that has a profile and fits the model.

    ``gpus`` filters by GPU name (spelling-insensitive); ``profile_size`` uses that listed profile
    size exactly instead of interpolating at ``model_params_b``."""
    wanted = {gpu_key(g) for g in gpus or []}
    known = {gpu_key(o.gpu) for o in offers} | set(profiles)
    unknown = sorted(g for g in gpus or [] if gpu_key(g) not in known)
    if unknown:
        raise Echo2InputError(f"unknown GPU {', '.join(unknown)}; the catalog has "
                              f"{', '.join(sorted({o.gpu for o in offers}))}")
    best: dict[tuple[str, int], WorkerType] = {}
    for offer in offers:
        profile = profile_for(profiles, offer.gpu)
        if profile is None or (wanted and gpu_key(offer.gpu) not in wanted and
                               not wanted & {gpu_key(n) for n in (profile.name, *profile.aliases)}):
            continue
        if not fits(model_params_b, offer.gpu_memory_gib):
            continue
        if profile_size is not None:
            if profile_size not in profile.tokens_per_second:
                raise Echo2InputError(f"profile {profile.name} has no size {profile_size:g}B; it lists "
                                      f"{', '.join(f'{s:g}' for s in sorted(profile.tokens_per_second))}")
            speed = profile.tokens_per_second[profile_size] * offer.gpu_count
        else:
            speed = profile.speed(model_params_b) * offer.gpu_count
        price = offer.price(spot)
        worker = WorkerType(offer, price, batch_tokens / speed, speed, profile.source)
        key = (profile.name, offer.gpu_count)
        if key not in best or (price, offer.name) < (best[key].usd_per_hour, best[key].offer.name):
            best[key] = worker
    if not best:
        raise Echo2InputError(f"no {'spot' if spot else 'on-demand'} offer fits a {model_params_b:g}B model"
                              + (f" on {', '.join(gpus)}" if gpus else "") + " (bf16 weights, one replica per GPU)"
                              + ("; try --on-demand" if spot else ""))
    return sorted(best.values(), key=lambda t: (t.usd_per_hour / t.tokens_per_second, t.offer.name))


@dataclass
class Mix:
    """A fleet: how many workers of each type, and what the capacity model predicts for it."""

    workers: list[tuple[WorkerType, int]]
    prediction: Prediction
    proven_optimal: bool = True

    @property
    def usd_per_hour(self) -> float:
        """Price of the whole fleet per hour."""
        return sum(t.usd_per_hour * n for t, n in self.workers)

    @property
    def batch_seconds(self) -> list[float]:
        """One entry per worker, as ``capacity`` takes it."""
        return [t.batch_seconds for t, n in self.workers for _ in range(n)]


def meets(w: Workload, batch_seconds: list[float], target_utilization: float, stats: dict | None = None
          ) -> Prediction | None:
    """The prediction for a fleet if it reaches the target, else None. The criterion is predict's
    utilization >= target and, when a version is published every step, the closed form's too: the
    two agree to 0.3% there, and requiring both lets the search skip simulating near misses."""
    if w.publish_every == 1 and w.train_seconds / closed_form_step_seconds(w, batch_seconds) < target_utilization:
        return None
    if stats is not None:
        stats["evaluations"] = stats.get("evaluations", 0) + 1
    p = predict(w, batch_seconds)
    return p if p.utilization >= target_utilization else None


def cheapest_mix(workload: Workload, worker_types: list[WorkerType], target_utilization: float = 0.95,
                 max_per_type: int | None = None, budget_usd_per_hour: float | None = None,
                 max_evaluations: int = 400) -> Mix | None:
    """The cheapest fleet whose predicted utilization is at least ``target_utilization`` (branch and
    bound, see the module docstring), or None when no fleet within ``max_per_type`` workers of each
    type (default: enough for each type alone, plus one batch's worth for the fill time) and
    ``budget_usd_per_hour`` reaches it."""
    w, u = workload, target_utilization
    # some S is out of reach for any fleet (a version that takes longer to reach an actor than S
    # steps allow): ask the model once with workers as fast as can be, before searching
    if predict(w, [1e-6] * math.ceil(w.groups_per_step / w.groups_per_batch)).utilization < u - 1e-9:
        return None
    types = sorted(worker_types, key=lambda t: (t.usd_per_hour / t.groups_per_second(w), t.offer.name))
    if not types or w.staleness < w.publish_every - 1:  # the version it needs is never published
        return None
    mus = [t.groups_per_second(w) for t in types]
    prices = [t.usd_per_hour for t in types]
    need = u * required_throughput(w) * (1 - TOLERANCE)
    fill = math.ceil(w.groups_per_step / w.groups_per_batch)
    caps = [max_per_type if max_per_type is not None else min(MAX_COUNT, math.ceil(need / mu) + fill) for mu in mus]
    # condition 2 as a second cover: the fleet must commit `fill` batches within f_max seconds
    f_max = math.inf if w.publish_every > 1 else (
        (1 + w.staleness) * w.train_seconds / u - w.train_seconds - w.dissemination_seconds)
    bats = [0.0 if f_max == math.inf else max(0, math.floor(f_max / (t.batch_seconds + w.upload_seconds) + 1e-9))
            for t in types]
    need_bats = 0 if f_max == math.inf else fill
    evaluations = {"n": 0, "cut": False}
    memo: dict[tuple[int, ...], Prediction | None] = {}

    def passes(counts: list[int]) -> Prediction | None:
        key = tuple(counts)
        if key not in memo:
            if evaluations["n"] >= max_evaluations:
                evaluations["cut"] = True
                return None
            batch = [types[i].batch_seconds for i, c in enumerate(counts) for _ in range(c)]
            stats: dict = {}
            memo[key] = meets(w, batch, u, stats)
            evaluations["n"] += stats.get("evaluations", 0)
        return memo[key]

    found = cover_search(prices, [(mus, need), (bats, need_bats)], caps, budget=budget_usd_per_hour, accept=passes)
    if found is None:
        return None
    best, _, prediction, cut = found
    return Mix([(types[i], c) for i, c in enumerate(best) if c], prediction,
               proven_optimal=not (cut or evaluations["cut"]))


def _fleet_rows(mix: Mix, w: Workload) -> list[dict]:
    return [{"offer": t.offer.as_dict(), "count": c, "usd_per_hour": t.usd_per_hour * c,
             "usd_per_hour_each": t.usd_per_hour, "batch_seconds": t.batch_seconds,
             "tokens_per_second": t.tokens_per_second, "groups_per_second": t.groups_per_second(w) * c,
             "speed_source": t.source} for t, c in mix.workers]


def summarize(w: Workload, mix: Mix | None, reason: str = "") -> dict:
    """One plan row: the fleet, its price and the capacity model's view of it (JSON-ready)."""
    row = {"staleness": w.staleness, "feasible": mix is not None, "required_throughput": required_throughput(w)}
    if mix is None:
        return {**row, "fleet": [], "workers": 0, "usd_per_hour": None, "predicted_utilization": None,
                "step_seconds": None, "min_staleness": None, "reason": reason}
    p = mix.prediction
    return {**row, "fleet": _fleet_rows(mix, w), "workers": len(mix.batch_seconds), "usd_per_hour": mix.usd_per_hour,
            "fleet_throughput": throughput(w, mix.batch_seconds), "predicted_utilization": p.utilization,
            "step_seconds": p.step_seconds, "usd_per_step": mix.usd_per_hour * p.step_seconds / 3600,
            "bound": p.bound, "lag": {str(k): v for k, v in sorted(p.lag.items())},
            "min_staleness": min_staleness(w, mix.batch_seconds), "proven_optimal": mix.proven_optimal}


def plan(workload: Workload, worker_types: list[WorkerType], *, target_utilization: float = 0.95,
         budget_usd_per_hour: float | None = None, max_per_type: int | None = None,
         neighbours: tuple[int, ...] = (-1, 1, 2), reclaim_hours: float | None = None,
         reclaim_rate_per_hour: float = 0.1, replacement_seconds: float = 300.0, seed: int = 0) -> dict:
    """The cheapest fleet for ``workload`` at its staleness S, and the same for S + each of
    ``neighbours`` (those below max(0, k - 1) are left out): a JSON-ready dict with ``fleet``,
    ``feasible``, ``required_throughput`` (groups/s), ``min_staleness`` (of the chosen fleet),
    ``predicted_utilization``, ``usd_per_hour``, ``step_seconds``, ``neighbours``, ``workload``,
    and, with ``reclaim_hours``, ``reclaims`` (``simulate_reclaims`` of the chosen fleet)."""
    w = workload
    if not 0 < target_utilization <= 1:
        raise Echo2InputError(f"target utilization {target_utilization} must be in (0, 1]")

    def one(wl: Workload) -> tuple[dict, Mix | None]:
        mix = cheapest_mix(wl, worker_types, target_utilization, max_per_type, budget_usd_per_hour)
        reason = ""
        if mix is None:
            reason = f"no fleet reaches {target_utilization:.0%} utilization at S={wl.staleness}"
            if budget_usd_per_hour is not None:
                unbounded = cheapest_mix(wl, worker_types, target_utilization, max_per_type)
                reason += (f" under ${budget_usd_per_hour:g}/h (the cheapest costs ${unbounded.usd_per_hour:.2f}/h)"
                           if unbounded else "")
        return summarize(wl, mix, reason), mix

    result, mix = one(w)
    floor = max(0, w.publish_every - 1)
    result["neighbours"] = [one(replace(w, staleness=w.staleness + d))[0] for d in neighbours
                            if d and w.staleness + d >= floor]
    result.update({"workload": asdict(w), "target_utilization": target_utilization,
                   "budget_usd_per_hour": budget_usd_per_hour})
    if reclaim_hours is not None and mix is not None:
        result["reclaims"] = simulate_reclaims(mix, reclaim_hours, reclaim_rate_per_hour, replacement_seconds, seed,
                                               workload=w)
    return result


def _down_intervals(rng: random.Random, horizon: float, rate: float, replacement: float, cycle: float) -> list:
    out, t = [], 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= horizon:
            break
        end = t + rng.uniform(0.0, cycle) + replacement  # the batch in flight is lost, then a new one boots
        out.append((t, min(end, horizon)))
        t = end
    return out


def _share_at(slots: list[tuple[float, list]], horizon: float, target: float) -> tuple[float, float]:
    """(share of time with throughput >= target, mean throughput) of slots (mu, down intervals)."""
    full = sum(mu for mu, _ in slots)
    events = sorted((t, d) for mu, downs in slots for a, b in downs for t, d in ((a, -mu), (b, mu)))
    lost = sum(mu * (b - a) for mu, downs in slots for a, b in downs)
    at, level, last = 0.0, full, 0.0
    for t, d in events:
        if level >= target * (1 - 1e-9):
            at += t - last
        level, last = level + d, t
    if level >= target * (1 - 1e-9):
        at += horizon - last
    return at / horizon, full - lost / horizon


def simulate_reclaims(mix: Mix | list[tuple[WorkerType, int]], hours: float, reclaim_rate_per_hour: float,
                      replacement_seconds: float, seed: int = 0, *, workload: Workload, hold: float = 0.95,
                      trials: int = 200, max_extra: int | None = None) -> dict:
    """Monte Carlo of a fleet whose workers are reclaimed, and the extra workers that hold it.

    Model: each worker slot is reclaimed at the times of a Poisson process of rate
    ``reclaim_rate_per_hour``; the batch it was generating is lost (a uniform share of its cycle)
    and a replacement is launched at once and produces after ``replacement_seconds`` (boot, model
    load, first weights). The fleet's throughput at any time is that of its live slots; the
    target is the planned fleet's full throughput, the one ``predict`` verified the target
    utilization with. Cost: every slot bills for the whole horizon (a replacement bills from its
    launch, boot included). Over-provisioning: the fewest extra workers of the mix's cheapest type
    per unit of throughput such that the share of time at or above the target, averaged over
    ``trials``, is at least ``hold``. Each slot draws from its own generator seeded by
    (seed, trial, slot), so the result is deterministic and adding a slot leaves the others'
    histories unchanged (the share can only grow with the extras). ``extra_workers`` is None
    when even ``max_extra`` (default: as many again as the fleet, plus 4) do not hold it."""
    pairs = mix.workers if isinstance(mix, Mix) else list(mix)
    if hours <= 0 or reclaim_rate_per_hour < 0 or replacement_seconds < 0 or not pairs:
        raise Echo2InputError("reclaim simulation needs hours > 0, a rate >= 0, replacement seconds >= 0 and a fleet")
    w, horizon, rate = workload, hours * 3600.0, reclaim_rate_per_hour / 3600.0
    base = [t for t, c in pairs for _ in range(c)]
    spare = min((t for t, _ in pairs), key=lambda t: t.usd_per_hour / t.groups_per_second(w))
    max_extra = len(base) + 4 if max_extra is None else max_extra
    target = sum(t.groups_per_second(w) for t in base)
    slots_of = base + [spare] * max_extra
    histories = []  # per trial, per slot: (mu, down intervals)
    reclaims = 0
    for trial in range(trials):
        row = []
        for i, t in enumerate(slots_of):
            rng = random.Random(f"{seed}-{trial}-{i}")
            downs = _down_intervals(rng, horizon, rate, replacement_seconds, t.batch_seconds + w.upload_seconds)
            reclaims += len(downs) if i < len(base) else 0
            row.append((t.groups_per_second(w), downs))
        histories.append(row)

    def stats(k: int) -> tuple[float, float]:
        runs = [_share_at(h[:len(base) + k], horizon, target) for h in histories]
        return sum(s for s, _ in runs) / trials, sum(m for _, m in runs) / trials

    share, mean = stats(0)
    extra, share_extra, mean_extra = None, share, mean
    for k in range(max_extra + 1):
        s, m = (share, mean) if k == 0 else stats(k)
        if s >= hold:
            extra, share_extra, mean_extra = k, s, m
            break
    usd_per_hour = sum(t.usd_per_hour for t in base)
    result = {"hours": hours, "reclaim_rate_per_hour": reclaim_rate_per_hour,
              "replacement_seconds": replacement_seconds,
              "seed": seed, "trials": trials, "hold": hold, "workers": len(base), "target_throughput": target,
              "expected_reclaims": reclaims / trials, "expected_usd": usd_per_hour * hours, "mean_throughput": mean,
              "share_of_time_at_target": share, "extra_workers": extra, "extra_offer": spare.offer.name}
    if extra is not None:
        with_extra = usd_per_hour + extra * spare.usd_per_hour
        result.update({"usd_per_hour_with_extra": with_extra, "expected_usd_with_extra": with_extra * hours,
                       "share_with_extra": share_extra, "mean_throughput_with_extra": mean_extra})
    return result


def fit_summary(run: str) -> tuple[dict, Workload]:
    """Predicted against measured for a finished run (``fit.fit_run``), and the fitted workload."""
    from echo2.fleet.sizing.fit import fit_run, open_run  # reads run folders: only --from-run needs it

    fit = fit_run(open_run(run))
    p = predict(fit.workload, fit.batch_seconds)
    return {"run": run, "steps": fit.steps, "batch_seconds": fit.batch_seconds,
            "measured_utilization": fit.measured_utilization, "predicted_utilization": p.utilization,
            "measured_step_seconds": fit.measured_step_seconds, "predicted_step_seconds": p.step_seconds,
            "measured_lag": {str(k): v for k, v in sorted(fit.measured_lag.items())},
            "predicted_lag": {str(k): v for k, v in sorted(p.lag.items())}, "bound": p.bound,
            "min_staleness": min_staleness(fit.workload, fit.batch_seconds),
            "workload": asdict(fit.workload)}, fit.workload
