"""A whole run, planned: from a workload file (``workload_file.py``) to hours and dollars to the end.

Pipeline (``plan_run``), each step a model documented in its own module:

1. Parameters: total and active (``WorkloadFile.params_b``). Tokens per step: R x G x (prompt + mean
   completion).
2. T, the learner's busy seconds per step: ``train.train_seconds`` if given, else the FLOP model
   (``step_time.py``) at the learner's GPUs, bf16 peak and MFU (``--mfu-from`` > ``learner.mfu`` > default).
3. D, a version's way to every actor: ``network.dissemination_seconds`` if given, else the bytes of the
   MEAN published version (``dissemination.version_bytes``: a keyframe every K versions, sparse deltas at the
   changed fraction between) through the relay forest at the slowest link (``dissemination.dissemination_seconds``,
   one tree per provider and region of the fleet). D depends on the fleet's size and spread, which depends on D:
   the fleet is chosen again with the new D until the fleet stops changing (at most ``FIXED_POINT_ROUNDS``).
4. The fleet: ``choose.choose_fleet``, the one chooser the live fleet also uses (capacity model + cost-aware
   activation, every instance at its expected throughput under its provider's reclaim rate).
5. Actor speed (``actor_speed.py``): with the model's config and a profiled bandwidth, the decode model
   (``decode.py``: bytes per decode step at the batch size, experts touched, KV at the contexts; the batch drains
   as its completions finish, or stays full with ``rollout.refill``); else the profile's figure, capped so that a
   batch lasts at least its p95 completion decoded alone (``completion_tokens_p95``). The chooser is given each
   offer at that speed: each offer is handed to it under a GPU name of its own (``GPU/count``, restored in the
   result), since the chooser's speeds are per GPU name. Neither a config nor a p95: the plain chooser, exactly
   what the live fleet calls.
6. Totals: hours = steps x predicted step seconds + the start-up + the checkpoints + the expected reclaim bursts
   (``run_costs.py``); $ learner = the cheapest catalog instance of the learner's GPU with at least its GPU count
   in its market whose GPUs and host RAM hold the learner's ranks (``learner_memory.py``; billed whole) x hours;
   $ actors = the fleet's $/h, with the extra instances ``reclaim_simulation.simulate_reclaims`` says hold the planned
   throughput 95% of the time, x hours, plus the bursts' replacements; $ traffic = the versions' bytes to the
   actors (``traffic.traffic_per_run``, with the relay or without, both reported) plus the learner's upload of each
   version to the store, the actors' rollout files to the store and the checkpoints' egress, each priced by
   ``providers.transfer_usd_per_gb``. The learner at spot against on demand (``spot_learner.py``: expected learner
   reclaims x (relaunch + resume + lost work) at the run's burn rate, against the on-demand premium):
   ``spot_learner`` in the result; with ``learner.market: spot`` the plan's own hours and dollars include those
   reclaims (``usd_learner_reclaims``).
7. Budget and deadline: the hours and steps a budget buys at the plan's $/h; whether a deadline is met, and the
   cheapest way if it is (the plan's own cost).

Assumptions beyond the modules': rollout files weigh ``ROLLOUT_BYTES_PER_TOKEN`` bytes per completion token (token
id and behavior logprob, 4 bytes each, before compression); the learner runs in the store's place unless it is
pinned elsewhere; the learner bills for the whole run including its waits. Every assumption the answer used is in
the result's ``assumptions`` list with its source. ``run_range.py`` draws the uncertain inputs around this plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, replace

from echo2.errors import Echo2InputError
from echo2.fleet.planner import (
    actor_speed,
    dissemination,
    learner_memory,
    plan_notes,
    run_costs,
    spot_learner,
    step_time,
    traffic,
)
from echo2.fleet.planner.plan_notes import LEARNER_BYTES_PER_PARAM, ROLLOUT_BYTES_PER_TOKEN
from echo2.fleet.planner.reclaim_simulation import WorkerType, simulate_reclaims
from echo2.fleet.planner.workload_file import WorkloadFile
from echo2.fleet.prices import gpu_matcher
from echo2.fleet.prices.catalog import Offer, Profile, gpu_key, profile_for
from echo2.fleet.providers import facts, transfer_usd_per_gb
from echo2.fleet.sizing.activation import reclaim_rate
from echo2.fleet.sizing.capacity import Workload, min_staleness
from echo2.fleet.sizing.choose import batch_seconds_of, choose_fleet

FIXED_POINT_ROUNDS = 4
RECLAIM_TRIALS = 40
NEIGHBOURS = (-1, 1, 2)


def _check_gpus(wf: WorkloadFile, offers: list[Offer], profiles: dict[str, Profile]) -> None:
    known = {gpu_key(o.gpu) for o in offers} | set(profiles)
    unknown = sorted(g for g in wf.actors.gpus or [] if gpu_key(g) not in known)
    if unknown:
        raise Echo2InputError(f"unknown GPU {', '.join(unknown)}; the catalog has "
                              f"{', '.join(sorted({o.gpu for o in offers}))}")


def _learner_gpus(wf: WorkloadFile, offers: list[Offer]) -> int:
    """The fewest of 1, 2, 4, 8 GPUs of the learner's kind and market that hold the training state; 8 if none."""
    for n in (1, 2, 4, 8):
        try:
            learner_offer(wf.model_copy(update={"learner": wf.learner.model_copy(update={"gpus": n})}), offers)
            return n
        except Echo2InputError:
            continue
    return 8


def learner_needs_of(wf: WorkloadFile) -> learner_memory.LearnerNeeds:
    """What the learner's ranks hold (``learner_memory.py``) for this workload."""
    return learner_memory.learner_needs(wf.params_b()[0], wf.learner.gpus or 1, staleness=wf.train.staleness,
                                        spot_check=wf.trust.spot_check_fraction > 0,
                                        publish_delta=wf.publish.keyframe_every > 1)


def learner_refusals(wf: WorkloadFile, offers: list[Offer]) -> list[tuple[Offer, str | None]]:
    """Every offer of the learner's GPU, count, market and place, cheapest first, each with the number that refuses
    it (``learner_memory.check``) or None where it holds the learner."""
    spot = wf.learner.market == "spot"
    needs = learner_needs_of(wf)
    near = [o for o in offers if gpu_key(o.gpu) == gpu_key(wf.learner.gpu) and o.gpu_count >= wf.learner.gpus
            and o.price(spot) is not None and (wf.learner.provider is None or o.provider == wf.learner.provider)
            and (wf.learner.region is None or o.region == wf.learner.region)]
    return [(o, learner_memory.check(needs, o.gpu_memory_gib, o.host_memory_gib))
            for o in sorted(near, key=lambda o: (o.price(spot), o.name))]


def learner_offer(wf: WorkloadFile, offers: list[Offer]) -> Offer:
    """The cheapest instance for the learner (module docstring, step 6) whose GPUs and host RAM hold what the
    learner's ranks need at load, step, publish and checkpoint (``learner_memory.py``; an unknown memory size is
    given the benefit of the doubt). Refused: one line naming the number that refused the cheapest."""
    ranked = learner_refusals(wf, offers)
    fitting = [o for o, why in ranked if why is None]
    if not fitting:
        where = f" at {wf.learner.provider}" if wf.learner.provider else ""
        if not ranked:
            raise Echo2InputError(f"no {wf.learner.market} offer of {wf.learner.gpus}x {wf.learner.gpu} for the "
                                  f"learner{where} in the catalog")
        raise Echo2InputError(f"no {wf.learner.market} offer of {wf.learner.gpus}x {wf.learner.gpu}{where} holds "
                              f"echo2's learner: the cheapest, {ranked[0][0].name}, has {ranked[0][1]}")
    return fitting[0]


def _train_seconds(wf: WorkloadFile, active_b: float, mfu: tuple[float, str] | None) -> tuple[float, dict]:
    if wf.train.train_seconds is not None:
        return wf.train.train_seconds, {"train_seconds": wf.train.train_seconds, "from": "given"}
    if mfu is None:
        moe = active_b < (wf.params_b()[0] - 1e-9)
        mfu = ((wf.learner.mfu, wf.sources.get("learner.mfu", "given in the workload")) if wf.learner.mfu
               else (step_time.MOE_MFU, step_time.MOE_MFU_SOURCE) if moe
               else (step_time.DEFAULT_MFU, step_time.DEFAULT_MFU_SOURCE))
    tokens = wf.tokens_per_step()
    signal = wf.train.signal_share
    t = step_time.train_seconds(active_b, tokens, gpu=wf.learner.gpu, gpus=wf.learner.gpus, mfu=mfu[0],
                                audit_fraction=wf.trust.spot_check_fraction, signal_share=signal)
    return t, {"train_seconds": t, "from": "FLOP model", "tokens_per_step": tokens, "mfu": mfu[0],
               "mfu_source": mfu[1], "peak_tflops": step_time.peak_tflops(wf.learner.gpu), "signal_share": signal,
               "flops_per_step": step_time.flops_per_step(active_b, tokens, wf.trust.spot_check_fraction, signal)}


def _groups(activation) -> list[tuple[str, str, int]]:
    out: dict[tuple[str, str], int] = {}
    for c, n in activation.fleet:
        out[(c.offer.provider, c.offer.region)] = out.get((c.offer.provider, c.offer.region), 0) + n
    return [(p, r, n) for (p, r), n in sorted(out.items())]


def _dissemination(wf: WorkloadFile, vbytes: float, groups: list[tuple[str, str, int]]) -> float:
    if wf.network.dissemination_seconds is not None:
        return wf.network.dissemination_seconds
    actors = max(1, sum(n for _, _, n in groups))
    regions = max(1, len(groups))
    roots = actors if not wf.network.relay else 1
    return dissemination.dissemination_seconds(vbytes, store_gbit=wf.network.store_gbit,
                                               peer_gbit=wf.network.peer_uplink_gbit, actors=actors,
                                               fanout=wf.network.fanout, roots=roots, regions=regions)


def capacity_workload(wf: WorkloadFile, train_seconds: float, dissemination_seconds: float,
                      staleness: int | None = None) -> Workload:
    """The capacity model's view of the workload at T and D."""
    r, r_step = wf.rollout, wf.train.groups_per_step
    return Workload(train_seconds=train_seconds, groups_per_step=r_step, groups_per_batch=r.groups_per_batch,
                    staleness=wf.train.staleness if staleness is None else staleness,
                    dissemination_seconds=dissemination_seconds, upload_seconds=wf.network.upload_seconds,
                    publish_every=wf.publish.every,
                    max_pending_batches=r.max_pending_batches or math.ceil(r_step / r.groups_per_batch))


def reclaim_overrides(wf: WorkloadFile, offers: list[Offer]) -> dict[str, float] | None:
    """Spot reclaim rates per offer: the workload's or activation's, times ``actors.reclaim_factor``."""
    if wf.actors.reclaim_per_hour is not None:
        return {"spot": wf.actors.reclaim_per_hour * wf.actors.reclaim_factor}
    if wf.actors.reclaim_factor == 1.0:
        return None
    return {o.name + ":spot": reclaim_rate(o, True) * wf.actors.reclaim_factor for o in offers}


def _choose(wf, workload, offers, profiles, total_b, active_b, budget, shape=None):
    markets = ("spot", "on-demand") if wf.actors.market == "both" else (wf.actors.market,)
    reclaim = reclaim_overrides(wf, offers)
    batch_tokens = wf.rollout.groups_per_batch * wf.rollout.group_size * wf.rollout.completion_tokens_mean
    gpus = wf.actors.gpus
    renamed: dict[str, Offer] = {}
    if shape is not None or wf.rollout.completion_tokens_p95 is not None:
        offers, profiles, renamed = _with_speeds(wf, offers, profiles, gpus, total_b, active_b, shape)
        gpus = None
    found = choose_fleet(workload, offers, profiles, model_params_b=total_b, active_params_b=active_b,
                         batch_tokens=batch_tokens, target_utilization=wf.actors.target_utilization, markets=markets,
                         gpus=gpus, reclaim=reclaim, caps=wf.actors.caps, budget_usd_per_hour=budget)
    if found is not None and renamed:
        found.fleet = [(replace(c, offer=renamed[c.offer.name]), n) for c, n in found.fleet]
    return found


def _with_speeds(wf, offers, profiles, gpus, total_b, active_b, shape):
    """Offers and profiles as step 5 of the module docstring hands them to the chooser."""
    match = gpu_matcher(gpus)
    out_offers, out_profiles, renamed = [], {}, {}
    for o in offers:
        profile = profile_for(profiles, o.gpu)
        if profile is None or not match(o.gpu):
            continue
        key = f"{profile.name}/{o.gpu_count}"
        if gpu_key(key) not in out_profiles:
            # one size, the model's: speed(total, active) is exactly this figure (a single-entry table)
            got = actor_speed.speed(wf, profile, o.gpu_count, total_b=total_b, active_b=active_b, shape=shape)
            out_profiles[gpu_key(key)] = Profile(key, {total_b: got.per_gpu}, got.source)
        out_offers.append(replace(o, gpu=key))
        renamed[o.name] = o
    return out_offers, out_profiles, renamed


def _fleet_rows(activation) -> list[dict]:
    return activation.as_dict()["fleet"] if activation else []


def _neighbour(wf, t, d, offers, profiles, total_b, active_b, budget, staleness, shape) -> dict:
    w = capacity_workload(wf, t, d, staleness)
    found = _choose(wf, w, offers, profiles, total_b, active_b, budget, shape)
    if found is None:
        return {"staleness": staleness, "feasible": False, "fleet": [], "workers": 0, "usd_per_hour": None,
                "predicted_utilization": None, "step_seconds": None,
                "reason": f"no fleet reaches {wf.actors.target_utilization:.0%} utilization at S={staleness}"}
    p = found.prediction
    return {"staleness": staleness, "feasible": True, "fleet": _fleet_rows(found), "workers": found.instances,
            "usd_per_hour": found.usd_per_hour, "predicted_utilization": p.utilization, "step_seconds": p.step_seconds,
            "usd_per_step": found.usd_per_hour * p.step_seconds / 3600}


def plan_run(wf: WorkloadFile, offers: list[Offer], profiles: dict[str, Profile], *,
             mfu: tuple[float, str] | None = None, changed_fraction: tuple[float, str] | None = None,
             budget_usd: float | None = None, deadline_hours: float | None = None,
             budget_usd_per_hour: float | None = None, reclaim_hours: float | None = None,
             neighbours: tuple[int, ...] = NEIGHBOURS, seed: int = 0, keep: dict | None = None) -> dict:
    """The plan of a whole run (module docstring): a JSON-ready dict. ``offers`` holds both markets (the learner
    and the actors pick theirs). ``mfu`` / ``changed_fraction``: (value, source) overriding the workload's.
    ``reclaim_hours``: simulate reclaims over that many hours instead of the run's. ``keep``: filled with what the
    plan chose as objects (the fleet, the workload as planned), for ``run_range.py`` to draw around it."""
    total_b, active_b = wf.params_b()
    _check_gpus(wf, offers, profiles)
    auto_gpus = wf.learner.gpus is None
    if auto_gpus:
        wf = wf.model_copy(update={"learner": wf.learner.model_copy(update={"gpus": _learner_gpus(wf, offers)})})
    t, t_info = _train_seconds(wf, active_b or total_b, mfu)
    shape = actor_speed.model_shape(wf)
    if changed_fraction is None:
        changed_fraction = ((wf.network.changed_fraction, wf.sources.get("network.changed_fraction", "given"))
                            if wf.network.changed_fraction is not None
                            else (dissemination.DEFAULT_CHANGED_FRACTION,
                                  dissemination.DEFAULT_CHANGED_FRACTION_SOURCE))
    vb = dissemination.version_bytes(total_b * 1e9, keyframe_every=wf.publish.keyframe_every,
                                     changed_fraction=changed_fraction[0])
    groups: list[tuple[str, str, int]] = []
    found = None
    d = _dissemination(wf, vb["mean"], groups)
    for _ in range(FIXED_POINT_ROUNDS):  # D follows the fleet, the fleet follows D
        workload = capacity_workload(wf, t, d)
        found = _choose(wf, workload, offers, profiles, total_b, active_b, budget_usd_per_hour, shape)
        if found is None:
            break
        new_groups = _groups(found)
        new_d = _dissemination(wf, vb["mean"], new_groups)
        if new_groups == groups and math.isclose(new_d, d, rel_tol=1e-6):
            break
        groups, d = new_groups, new_d
    workload = capacity_workload(wf, t, d)
    out: dict = {"workload_name": wf.name, "description": wf.description, "model": {
        "total_params_b": total_b, "active_params_b": active_b}, "learner_step": t_info,
        "versions": {**vb, "changed_fraction": changed_fraction[0], "changed_fraction_source": changed_fraction[1],
                     "keyframe_every": wf.publish.keyframe_every},
        "dissemination_seconds": d, "dissemination_seconds_keyframe": _dissemination(wf, vb["keyframe"], groups),
        "workload": asdict(workload), "staleness": wf.train.staleness,
        "target_utilization": wf.actors.target_utilization,
        "prices": wf.actors.market, "feasible": found is not None,
        "required_throughput": wf.train.groups_per_step / t,
        "required_tokens_per_second": wf.completion_tokens_per_step() / t}
    out["neighbours"] = [_neighbour(wf, t, d, offers, profiles, total_b, active_b, budget_usd_per_hour,
                                    wf.train.staleness + k, shape) for k in neighbours
                         if k and wf.train.staleness + k >= wf.publish.every - 1]
    out["assumptions"] = plan_notes.assumptions(wf, t_info, changed_fraction, total_b, active_b, profiles,
                                                found.fleet if found else [])
    if auto_gpus:
        row = next(a for a in out["assumptions"] if a["name"] == "learner.gpus")
        row["source"] = (f"chosen: the fewest of 1, 2, 4, 8 {wf.learner.gpu} that hold the learner's ranks "
                         "(learner_memory.py)")
    if found is None:
        out.update({"fleet": [], "workers": 0, "usd_per_hour": None, "predicted_utilization": None,
                    "utilization": None, "step_seconds": None, "min_staleness": None,
                    "reason": f"no fleet reaches {wf.actors.target_utilization:.0%} utilization at "
                              f"S={wf.train.staleness}" + (f" under ${budget_usd_per_hour:g}/h"
                                                           if budget_usd_per_hour else "")})
        return out
    batch_tokens = wf.rollout.groups_per_batch * wf.rollout.group_size * wf.rollout.completion_tokens_mean
    batches = batch_seconds_of(found.fleet, workload, batch_tokens)
    if keep is not None:
        keep.update({"wf": wf, "found": found, "workload": workload, "shape": shape, "groups": groups,
                     "changed_fraction": changed_fraction[0],
                     "versions": vb, "total_b": total_b, "active_b": active_b, "t_info": t_info})
    p = found.prediction
    step_seconds = p.step_seconds
    tail = max(batches)
    out.update({"fleet": _fleet_rows(found), "workers": found.instances, "usd_per_hour": found.usd_per_hour,
                "predicted_utilization": p.utilization, "utilization": p.utilization,
                "step_seconds": step_seconds, "bound": p.bound, "lag": {str(k): v for k, v in sorted(p.lag.items())},
                "min_staleness": min_staleness(workload, batches), "proven_optimal": found.proven_optimal,
                "chooser_rounds": found.rounds,
                "tail": {"seconds": tail, "binds": any("by the batch tail" in c.speed_source or "drains" in
                                                        c.speed_source for c, _ in found.fleet)},
                "usd_per_step": found.usd_per_hour * step_seconds / 3600})
    steps = wf.steps()
    if steps is not None:
        out.update(_totals(wf, out, found, workload, vb, steps, offers, step_seconds, d, batches,
                           reclaim_hours, seed, total_b))
        out.update(_budget_and_deadline(out, budget_usd, deadline_hours))
        out["compare"] = [r.model_dump() for r in wf.compare]
        out["verdict"] = plan_notes.verdict(out, wf)
    elif reclaim_hours is not None:
        out["reclaims"] = _reclaims(wf, found, workload, reclaim_hours, seed)
    return out


def _traffic(wf: WorkloadFile, learner: Offer, found, vb: dict, steps: int) -> dict:
    """The run's traffic with the learner on ``learner`` (module docstring, step 6)."""
    store = (wf.store.provider or learner.provider, wf.store.region or learner.region)
    versions = math.ceil(steps / wf.publish.every)
    groups = _groups(found)
    moved = traffic.traffic_per_run(vb["mean"], versions, groups, store)
    upload_gb = versions * vb["mean"] / 1e9
    learner_to_store = upload_gb * transfer_usd_per_gb(learner.provider, learner.region, *store)
    rollout_gb = steps * wf.completion_tokens_per_step() * ROLLOUT_BYTES_PER_TOKEN / 1e9
    total_actors = max(1, found.instances)
    rollouts_usd = sum(rollout_gb * n / total_actors * transfer_usd_per_gb(p, r, *store) for p, r, n in groups)
    rollouts_usd += rollout_gb * transfer_usd_per_gb(*store, learner.provider, learner.region)  # the learner reads them
    fixed = learner_to_store + rollouts_usd
    relay_usd, store_usd = moved["relay"]["usd"] + fixed, moved["store_only"]["usd"] + fixed
    return {"usd": relay_usd if wf.network.relay else store_usd, "store": store, "relay": wf.network.relay,
            "usd_with_relay": relay_usd, "usd_store_only": store_usd, "versions": versions,
            "versions_to_actors": {k: {kk: vv for kk, vv in v.items() if kk != "by_provider"}
                                   for k, v in moved.items() if k != "versions"},
            "usd_learner_to_store": learner_to_store, "usd_rollouts": rollouts_usd, "rollout_gb": rollout_gb}


def burst_pools(found, workload: Workload, batch_tokens: float) -> list[run_costs.BurstPool]:
    """The spot actors per provider, as bursts take them (on-demand instances are not reclaimed)."""
    pools: dict[str, list] = {}
    for c, n in found.fleet:
        if not c.spot:
            continue
        g = (batch_tokens / c.tokens_per_second + workload.actor_wait) / c.availability
        pool = pools.setdefault(c.offer.provider, [0, 0.0, 0.0])
        pool[0] += n
        pool[1] += n * workload.groups_per_batch / g
        pool[2] += n * c.usd_per_hour
    return [run_costs.BurstPool(p, n, mu, usd) for p, (n, mu, usd) in sorted(pools.items())]


def _totals(wf, out, found, workload, vb, steps, offers, step_seconds, d, batches, reclaim_hours, seed,
            total_b) -> dict:
    learner = learner_offer(wf, offers)
    store_place = (wf.store.provider or learner.provider, wf.store.region or learner.region)
    startup = run_costs.startup_seconds(total_params_b=total_b, store_gbit=wf.network.store_gbit,
                                        actor_boot_seconds=wf.actors.replacement_seconds,
                                        keyframe_seconds=out["dissemination_seconds_keyframe"],
                                        first_batch_seconds=max(batches))
    ckpt = run_costs.checkpoints(steps=steps, every=wf.train.checkpoint_every, total_params_b=total_b,
                                 ranks=wf.learner.gpus, store_gbit=wf.network.store_gbit,
                                 learner_place=(learner.provider, learner.region), store_place=store_place)
    base_hours = (steps * step_seconds + startup + ckpt["seconds"]) / 3600
    reclaims = _reclaims(wf, found, workload, reclaim_hours or base_hours, seed)
    # the headline buys the fleet the reliability rule asks for: the extras that hold the target 95% of the time
    extra = reclaims.get("extra_workers") or 0
    fleet_usd_per_hour = reclaims.get("usd_per_hour_with_extra", found.usd_per_hour) if extra else found.usd_per_hour
    batch_tokens = wf.rollout.groups_per_batch * wf.rollout.group_size * wf.rollout.completion_tokens_mean
    need = workload.groups_per_step / workload.train_seconds
    fleet_rate = sum(workload.groups_per_batch / (g + workload.actor_wait) for g in batches)
    bursts = run_costs.expected_bursts(burst_pools(found, workload, batch_tokens), base_hours, fleet_rate, need,
                                       per_hour=wf.actors.burst_per_hour, share=wf.actors.burst_share,
                                       seconds=wf.actors.replacement_seconds,
                                       backlog_groups=workload.max_pending_batches * workload.groups_per_batch)
    hours = base_hours + bursts["hours"]
    learner_price = learner.price(wf.learner.market == "spot")
    moved = _traffic(wf, learner, found, vb, steps)
    store, usd_traffic = moved.pop("store"), moved.pop("usd")
    usd_traffic += ckpt["usd_egress"]
    usd_learner = learner_price * hours
    usd_actors = fleet_usd_per_hour * hours + bursts["usd_replacements"]

    def fixed_usd(offer: Offer) -> float:
        """What the run pays beside the hourly prices with the learner on ``offer``: traffic, the checkpoints'
        egress from its place, the bursts' replacements."""
        place = (offer.provider, offer.region)
        egress = ckpt["gb"] * transfer_usd_per_gb(*place, wf.store.provider or offer.provider,
                                                  wf.store.region or offer.region)
        return _traffic(wf, offer, found, vb, steps)["usd"] + egress + bursts["usd_replacements"]

    spot = _spot_learner(wf, offers, hours, step_seconds, fleet_usd_per_hour, fixed_usd)
    gap_hours = usd_reclaims = 0.0
    if wf.learner.market == "spot" and spot is not None and spot["finishes"]:  # the plan's own learner is reclaimed
        gap_hours, usd_reclaims = spot["gap_hours"], spot["usd_reclaims"]
    refused = [{"offer": o.name, "usd_per_hour": o.price(wf.learner.market == "spot"), "refused": why}
               for o, why in learner_refusals(wf, offers) if why is not None
               and o.price(wf.learner.market == "spot") < learner_price]
    return {"steps": steps, "hours": hours + gap_hours, "startup_seconds": startup,
            "usd_learner": usd_learner, "usd_actors": usd_actors, "usd_traffic": usd_traffic,
            "usd_learner_reclaims": usd_reclaims, "usd_total": usd_learner + usd_actors + usd_traffic + usd_reclaims,
            "learner": {"offer": learner.as_dict(), "market": wf.learner.market, "usd_per_hour": learner_price,
                        "gpus_billed": learner.gpu_count, "needs": learner_needs_of(wf).as_dict(),
                        "cheaper_refused": refused[:3]},
            "store": {"provider": store[0], "region": store[1]}, "traffic": moved, "checkpoints": ckpt,
            "bursts": bursts, "fleet_usd_per_hour": fleet_usd_per_hour, "extra_workers": extra,
            "reclaims": reclaims, "spot_learner": spot}


def _learner_in(wf: WorkloadFile, offers: list[Offer], market: str) -> Offer | None:
    try:
        return learner_offer(wf.model_copy(update={"learner": wf.learner.model_copy(update={"market": market})}),
                             offers)
    except Echo2InputError:
        return None


def _spot_learner(wf: WorkloadFile, offers: list[Offer], hours: float, step_seconds: float,
                  actors_usd_per_hour: float, traffic_usd: Callable[[Offer], float]) -> dict | None:
    """The learner at spot against on demand (``spot_learner.py``), each with the run's traffic from its own
    place (``traffic_usd(offer)``); None without a spot offer of its GPUs."""
    spot, on_demand = _learner_in(wf, offers, "spot"), _learner_in(wf, offers, "on-demand")
    if spot is None:
        return None
    lw = wf.learner
    if lw.reclaims_per_hour is not None:
        rate, rate_source = lw.reclaims_per_hour, wf.sources.get("learner.reclaims_per_hour", "the workload")
    else:
        rate, rate_source = facts(spot.provider).spot_reclaims_per_hour, f"providers.py's {spot.provider} spot rate"
    notice_q, notice_s = spot_learner.notice_of(spot.provider)
    io = spot_learner.state_seconds(LEARNER_BYTES_PER_PARAM * wf.params_b()[0] * 1e9, wf.network.store_gbit,
                                    lw.gpus or 1)
    out = spot_learner.price_spot_learner(
        hours=hours, step_seconds=step_seconds, spot_usd_per_hour=spot.price(True),
        on_demand_usd_per_hour=None if on_demand is None else on_demand.price(False),
        actors_usd_per_hour=actors_usd_per_hour, traffic_usd=traffic_usd(spot),
        on_demand_traffic_usd=None if on_demand is None else traffic_usd(on_demand), reclaims_per_hour=rate,
        recovery_seconds=lw.recovery_minutes * 60,
        resume_seconds=io if lw.resume_seconds is None else lw.resume_seconds,
        checkpoint_every=wf.train.checkpoint_every,
        notice_probability=notice_q if lw.notice_probability is None else lw.notice_probability,
        notice_seconds=notice_s if lw.notice_seconds is None else lw.notice_seconds, checkpoint_seconds=io)
    out.update({"offer": spot.as_dict(), "usd_per_hour": spot.price(True), "rate_source": rate_source,
                "on_demand_offer": None if on_demand is None else on_demand.as_dict(),
                "on_demand_usd_per_hour": None if on_demand is None else on_demand.price(False),
                "note": "the plan's hours and actors with the learner at spot (its traffic from the spot offer's "
                        "place), plus its expected reclaims (spot_learner.py)"})
    out["verdict"] = spot_learner.verdict(out, rate_source=rate_source)
    return out


def _reclaims(wf, found, workload, hours, seed) -> dict:
    """``simulate_reclaims`` of the chosen fleet over ``hours``, and the dollars of the time replacements are billed
    but not producing."""
    batch_tokens = wf.rollout.groups_per_batch * wf.rollout.group_size * wf.rollout.completion_tokens_mean
    pairs = [(WorkerType(c.offer, c.usd_per_hour, batch_tokens / c.tokens_per_second, c.tokens_per_second,
                         c.speed_source), n) for c, n in found.fleet]
    rate = wf.actors.reclaim_per_hour
    if rate is None:  # the fleet's mean rate, weighted by instances
        rate = sum(c.reclaim_per_hour * n for c, n in found.fleet) / max(1, found.instances)
    result = simulate_reclaims(pairs, hours, rate, wf.actors.replacement_seconds, seed, workload=workload,
                               trials=RECLAIM_TRIALS)
    lost = result["expected_reclaims"] * wf.actors.replacement_seconds / 3600 * found.usd_per_hour / found.instances
    return {**result, "rate_per_hour": rate, "usd_lost_time": lost}


def _budget_and_deadline(out: dict, budget_usd: float | None, deadline_hours: float | None) -> dict:
    res: dict = {}
    per_hour = out["usd_total"] / out["hours"]
    if budget_usd is not None:
        hours = budget_usd / per_hour
        res["budget"] = {"usd": budget_usd, "met": budget_usd >= out["usd_total"], "hours_bought": hours,
                         "steps_bought": min(out["steps"], int(max(0.0, hours * 3600 - out["startup_seconds"])
                                                               / out["step_seconds"]))}
    if deadline_hours is not None:
        met = deadline_hours >= out["hours"]
        res["deadline"] = {"hours": deadline_hours, "met": met, "usd": out["usd_total"] if met else None,
                           "steps_by_then": min(out["steps"], int(max(0.0, deadline_hours * 3600 -
                                                                      out["startup_seconds"]) / out["step_seconds"])),
                           "usd_by_then": per_hour * min(deadline_hours, out["hours"])}
    return res
