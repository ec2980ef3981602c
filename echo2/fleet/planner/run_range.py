"""A plan as a range: the hours and dollars of a run when its uncertain inputs are drawn, not fixed.

Why: a single answer hides which guesses it stands on. Every uncertain input of a workload (``UNCERTAIN`` in
``workload_file.py``: MFU, the signal share, the completion lengths, decode speed, the changed fraction, the store's
rate, reclaims and their bursts, the relaunch time, spot prices) has a low, a likely and a high value with its
source: the workload's ``ranges:`` entry, else ``DEFAULT_SPREAD`` around the field's value (said as such).

Model. The fleet is bought once, by ``run_plan.plan_run`` at the likely values (with the extra instances its own
reliability rule asks for); a user who buys it then lives with whatever the inputs turn out to be. Each draw takes
every input from a triangular distribution (low, likely, high), independently, from one ``random.Random(seed)``, and
evaluates that fleet (``Evaluator``):

* T from the FLOP model at the drawn MFU and signal share (``step_time.py``);
* each instance's batch time from the decode model at the drawn lengths, single-stream speed and speed factor
  (``actor_speed.py``), slowed by its availability at the drawn reclaim rate and relaunch time;
* D from the drawn changed fraction and store rate over the fleet's regions (``dissemination.py``);
* the step from the capacity model's closed form (``capacity.closed_form_step_seconds``: the larger of the
  learner, the fleet's throughput and freshness; it agrees with the simulation to 0.3% at k = 1 and is cheap
  enough to run a thousand times);
* checkpoints, the start, and a Poisson number of bursts per provider at the drawn rate and share
  (``run_costs.py``);
* dollars: the learner's offer for the hours, the fleet at the drawn spot price factor, the traffic scaled by the
  drawn version bytes and completion tokens, the checkpoints' egress.

The answer: P10, P50 and P90 of hours and dollars (and of each dollar part) over ``draws`` draws; the likely
point (every input at its likely value, bursts at their expected count); a sensitivity table (each input alone at
its low and its high, the rest likely: the swing in dollars and hours, largest first); and a scenario with the
bursts ECHO-2's launch article reported (``ARTICLE_BURSTS``). Same seed, same answer.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from echo2.fleet.planner import actor_speed, dissemination, run_costs, step_time
from echo2.fleet.planner.run_plan import capacity_workload
from echo2.fleet.planner.workload_file import UNCERTAIN, WorkloadFile
from echo2.fleet.prices.catalog import Profile, profile_for
from echo2.fleet.providers import facts
from echo2.fleet.sizing.capacity import closed_form_step_seconds

DRAWS = 400
SEED = 0
DEFAULT_SPREAD: dict[str, tuple[float, float]] = {
    "learner.mfu": (0.6, 1.6), "train.signal_share": (0.7, 1.0), "rollout.completion_tokens_mean": (0.8, 1.25),
    "rollout.at_cap_share": (0.5, 1.5), "rollout.single_stream_tokens_per_second": (0.7, 1.4),
    "rollout.decode_speed_factor": (0.75, 1.2), "network.changed_fraction": (0.5, 6.0),
    "network.store_gbit": (0.25, 2.0), "actors.reclaim_factor": (0.5, 4.0), "actors.burst_per_hour": (0.0, 4.0),
    "actors.burst_share": (0.4, 1.6), "actors.replacement_seconds": (0.5, 3.0),
    "actors.spot_price_factor": (0.85, 1.4)}
"""Low and high as multiples of the likely value, for an input the workload gives no range: an assumption, said as
such in the output. The changed fraction's high end: early RL steps of a public 8B full fine-tune changed ~13% of
the weights, six times the 2.1% measured on SmolLM2; 4x the reclaim rate is the burstiness the article saw."""
UPPER = {"train.signal_share": 1.0, "actors.burst_share": 1.0, "learner.mfu": 1.0, "rollout.at_cap_share": 0.9}
ARTICLE_BURSTS = {"actors.burst_share": 0.4, "actors.burst_per_hour": 0.2}
"""The scenario: bursts taking 40% of a provider's actors (ECHO-2's launch article: "up to 40% bursty reclaim"),
one every 5 hours (the article gives no rate: an assumption)."""


@dataclass(frozen=True)
class Input:
    name: str
    low: float
    likely: float
    high: float
    source: str

    def as_dict(self) -> dict:
        return {"name": self.name, "low": self.low, "likely": self.likely, "high": self.high, "source": self.source}


def _likely(name: str, wf: WorkloadFile, keep: dict, main_provider: str) -> float | None:
    if name == "learner.mfu":
        t = keep["t_info"]
        return t.get("mfu") if t.get("from") == "FLOP model" else None
    if name == "rollout.at_cap_share":
        cap, share = wf.length_cap()
        return share if cap else None
    if name == "network.changed_fraction":
        return keep["changed_fraction"]
    if name == "actors.burst_per_hour" and wf.actors.burst_per_hour is None:
        return facts(main_provider).spot_bursts_per_hour
    if name == "actors.burst_share" and wf.actors.burst_share is None:
        return facts(main_provider).spot_burst_share
    section, field = name.split(".")
    return getattr(getattr(wf, section), field)


def inputs(wf: WorkloadFile, keep: dict) -> list[Input]:
    """Every drawn input with its low, likely, high and source (module docstring)."""
    fleet = keep["found"].fleet
    main = max(fleet, key=lambda cn: cn[1])[0].offer.provider if fleet else "*"
    out = []
    for name in UNCERTAIN:
        likely = _likely(name, wf, keep, main)
        if likely is None:
            continue
        given = wf.ranges.get(name)
        if given is not None and not given.low <= likely <= given.high:
            # a flag or a measurement put the value outside the workload's range: it is what the user asserts
            out.append(Input(name, likely, likely, likely, f"held at {likely:g}: outside the workload's range "
                                                           f"{given.low:g}..{given.high:g} (a flag or a measurement)"))
            continue
        if given is not None:
            out.append(Input(name, given.low, likely, given.high,
                             given.source or wf.sources.get(name, "the workload's range, no source stated")))
            continue
        lo, hi = DEFAULT_SPREAD[name]
        top = UPPER.get(name, math.inf)
        out.append(Input(name, min(likely * lo, top), min(likely, top), min(likely * hi, top),
                         f"default spread x{lo:g}..x{hi:g} around the likely value: an assumption"))
    return out


class Evaluator:
    """Hours and dollars of the planned fleet under a set of input values (module docstring)."""

    def __init__(self, wf: WorkloadFile, keep: dict, point: dict, profiles: dict[str, Profile], offers: list):
        self.wf, self.keep, self.point = wf, keep, point
        found = keep["found"]
        extra = point.get("extra_workers") or 0
        spare = point["reclaims"].get("extra_offer")
        self.rows = []  # (candidate, count, profile)
        for c, n in found.fleet:
            plus = extra if extra and c.offer.name == spare else 0
            self.rows.append((c, n + plus, profile_for(profiles, c.offer.gpu)))
            extra = 0 if plus else extra
        self.learner_usd_per_hour = point["learner"]["usd_per_hour"]
        self.learner = point["learner"]["offer"]
        self.traffic = point["traffic"]
        self.ckpt_usd = point["checkpoints"]["usd_egress"]

    def __call__(self, x: dict[str, float], rng: random.Random | None = None) -> dict:
        wf, keep = self.wf, self.keep
        r = wf.rollout
        mean = x.get("rollout.completion_tokens_mean", r.completion_tokens_mean)
        cap, share = wf.length_cap()
        if cap:
            mean = min(mean, cap)
        signal = x.get("train.signal_share", wf.train.signal_share)
        tokens = wf.train.groups_per_step * r.group_size * (mean + r.prompt_tokens)
        t_info = keep["t_info"]
        if t_info.get("from") == "FLOP model":
            active = keep["active_b"] or keep["total_b"]
            t = step_time.train_seconds(active, tokens, gpu=wf.learner.gpu, gpus=wf.learner.gpus,
                                        mfu=x.get("learner.mfu", t_info["mfu"]),
                                        audit_fraction=wf.trust.spot_check_fraction, signal_share=signal)
        else:
            t = t_info["train_seconds"]
        decode_x = actor_speed.DecodeInputs(mean, x.get("rollout.at_cap_share", share),
                                            x.get("rollout.single_stream_tokens_per_second",
                                                  r.single_stream_tokens_per_second),
                                            x.get("rollout.decode_speed_factor", r.decode_speed_factor))
        replacement = x.get("actors.replacement_seconds", wf.actors.replacement_seconds)
        reclaim_scale = x.get("actors.reclaim_factor", wf.actors.reclaim_factor) / (wf.actors.reclaim_factor or 1.0)
        changed = x.get("network.changed_fraction", keep["changed_fraction"])
        gbit = x.get("network.store_gbit", wf.network.store_gbit)
        vb = dissemination.version_bytes(keep["total_b"] * 1e9, keyframe_every=wf.publish.keyframe_every,
                                         changed_fraction=changed)
        groups = keep["groups"]
        if wf.network.dissemination_seconds is not None:
            d = wf.network.dissemination_seconds
        else:
            actors = max(1, sum(n for _, n, _ in self.rows))
            d = dissemination.dissemination_seconds(vb["mean"], store_gbit=gbit, peer_gbit=wf.network.peer_uplink_gbit,
                                                    actors=actors, fanout=wf.network.fanout,
                                                    roots=1 if wf.network.relay else actors,
                                                    regions=max(1, len(groups)))
        workload = capacity_workload(wf, t, d)
        batch_tokens = r.groups_per_batch * r.group_size * mean
        batches, pools, usd_per_hour = [], {}, 0.0
        speeds: dict[tuple[str, int], float] = {}
        for c, n, profile in self.rows:
            key = (c.offer.gpu, c.offer.gpu_count)
            if key not in speeds:
                speeds[key] = (actor_speed.speed(wf, profile, c.offer.gpu_count, total_b=keep["total_b"],
                                                 active_b=keep["active_b"], shape=keep["shape"], x=decode_x).per_gpu
                               if profile is not None else c.tokens_per_second / c.offer.gpu_count)
            g = batch_tokens / (speeds[key] * c.offer.gpu_count)
            availability = 1.0 / (1.0 + c.reclaim_per_hour * reclaim_scale * replacement / 3600) if c.spot else 1.0
            g_eff = (g + workload.actor_wait) / availability - workload.actor_wait
            batches += [g_eff] * n
            price = c.usd_per_hour * (x.get("actors.spot_price_factor", wf.actors.spot_price_factor)
                                      / wf.actors.spot_price_factor if c.spot else 1.0)
            usd_per_hour += price * n
            if c.spot:
                pool = pools.setdefault(c.offer.provider, [0, 0.0, 0.0])
                pool[0] += n
                pool[1] += n * workload.groups_per_batch / (g_eff + workload.actor_wait)
                pool[2] += n * price
        step = closed_form_step_seconds(workload, batches)
        steps = self.point["steps"]
        keyframe_d = d * vb["keyframe"] / vb["mean"] if vb["mean"] else d
        startup = run_costs.startup_seconds(total_params_b=keep["total_b"], store_gbit=gbit,
                                            actor_boot_seconds=replacement, keyframe_seconds=keyframe_d,
                                            first_batch_seconds=max(batches))
        ckpt = run_costs.checkpoint_count(steps, wf.train.checkpoint_every) * run_costs.checkpoint_seconds(
            keep["total_b"], wf.learner.gpus, gbit)
        base_hours = (steps * step + startup + ckpt) / 3600
        burst_pools = [run_costs.BurstPool(p, n, mu, usd) for p, (n, mu, usd) in sorted(pools.items())]
        fleet_rate = sum(workload.groups_per_batch / (g + workload.actor_wait) for g in batches)
        per_hour = x.get("actors.burst_per_hour", wf.actors.burst_per_hour)
        burst_share = x.get("actors.burst_share", wf.actors.burst_share)
        counts = None
        if rng is not None:
            counts = [_poisson(rng, run_costs.burst_rates(p.provider, per_hour, burst_share)[0] * base_hours)
                      for p in burst_pools]
        bursts = run_costs.expected_bursts(burst_pools, base_hours, fleet_rate,
                                           workload.groups_per_step / workload.train_seconds, per_hour=per_hour,
                                           share=burst_share, seconds=replacement,
                                           backlog_groups=workload.max_pending_batches * workload.groups_per_batch,
                                           counts=counts)
        hours = base_hours + bursts["hours"]
        tr = self.traffic
        point_versions = self.keep["versions"]["mean"] or 1.0
        usd_traffic = ((tr["usd_with_relay" if wf.network.relay else "usd_store_only"] - tr["usd_rollouts"])
                       * vb["mean"] / point_versions + tr["usd_rollouts"] * mean / r.completion_tokens_mean
                       + self.ckpt_usd)
        usd_learner = self.learner_usd_per_hour * hours
        usd_actors = usd_per_hour * hours + bursts["usd_replacements"]
        need = workload.groups_per_step / workload.train_seconds
        return {"hours": hours, "usd": usd_learner + usd_actors + usd_traffic, "usd_learner": usd_learner,
                "usd_actors": usd_actors, "usd_traffic": usd_traffic, "step_seconds": step,
                "fleet_bound": fleet_rate < need * 0.98, "bursts": bursts["bursts"]}


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw by counting exponential gaps (means here are a few: cheap and exact)."""
    n, t = 0, rng.expovariate(1.0) if mean > 0 else math.inf
    while t < mean:
        n += 1
        t += rng.expovariate(1.0)
    return n


def _percentiles(values: list[float]) -> dict:
    xs = sorted(values)

    def at(q: float) -> float:
        i = q * (len(xs) - 1)
        lo, hi = math.floor(i), math.ceil(i)
        return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)

    return {"p10": at(0.1), "p50": at(0.5), "p90": at(0.9)}


def _summary(results: list[dict]) -> dict:
    out = {key: _percentiles([r[key] for r in results])
           for key in ("hours", "usd", "usd_learner", "usd_actors", "usd_traffic")}
    out["fleet_bound_share"] = sum(r["fleet_bound"] for r in results) / len(results)
    return out


def plan_range(wf: WorkloadFile, keep: dict, point: dict, profiles: dict[str, Profile], offers: list, *,
               draws: int = DRAWS, seed: int = SEED) -> dict:
    """The range of a planned run (module docstring): JSON-ready."""
    wf = keep["wf"]
    ins = inputs(wf, keep)
    evaluate = Evaluator(wf, keep, point, profiles, offers)
    likely = {i.name: i.likely for i in ins}
    rng = random.Random(seed)
    results, scenario = [], []
    for _ in range(draws):
        x = {i.name: (rng.triangular(i.low, i.high, i.likely) if i.high > i.low else i.likely) for i in ins}
        results.append(evaluate(x, rng))
        scenario.append(evaluate({**x, **ARTICLE_BURSTS}, rng))
    at_likely = evaluate(likely)
    sensitivity = []
    for i in ins:
        if i.high <= i.low:
            continue
        lo, hi = evaluate({**likely, i.name: i.low}), evaluate({**likely, i.name: i.high})
        sensitivity.append({"name": i.name, "low": i.low, "high": i.high, "usd_at_low": lo["usd"],
                            "usd_at_high": hi["usd"], "hours_at_low": lo["hours"], "hours_at_high": hi["hours"],
                            "usd_swing": abs(hi["usd"] - lo["usd"]), "hours_swing": abs(hi["hours"] - lo["hours"])})
    sensitivity.sort(key=lambda s: (-s["usd_swing"], -s["hours_swing"], s["name"]))
    fleet = [{**row, "count": n, "usd_per_hour": row["usd_per_hour_each"] * n}
             for (_, n, _), row in zip(evaluate.rows, point["fleet"], strict=True)]
    return {"draws": draws, "seed": seed, **_summary(results),
            "likely": {k: at_likely[k] for k in ("hours", "usd", "usd_learner", "usd_actors", "usd_traffic")},
            "fleet": fleet, "fleet_usd_per_hour": point["fleet_usd_per_hour"],
            "extra_workers": point.get("extra_workers") or 0, "inputs": [i.as_dict() for i in ins],
            "sensitivity": sensitivity,
            "scenario": {"name": "ECHO-2 article bursts", **ARTICLE_BURSTS, **_summary(scenario)},
            "method": f"{draws} draws (seed {seed}), triangular (low, likely, high) per input, the fleet bought at "
                      "the likely inputs held fixed (run_range.py)"}

