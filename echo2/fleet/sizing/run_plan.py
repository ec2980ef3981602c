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
5. The tail: echo2's actor commits whole batches, and a sequence decodes one token per engine step, so a batch
   lasts at least as long as its p95 completion takes alone (``completion_tokens_p95 /
   single_stream_tokens_per_second``), however fast the GPUs are: an instance whose GPUs would finish the batch's
   tokens sooner is in effect slower. The chooser is given each offer at that effective speed (its per-GPU speed
   capped at ``batch_tokens / (tail x gpu_count)``): to do so each offer is handed to it under a GPU name of its
   own (``GPU/count``, restored in the result), since the chooser's speeds are per GPU name. No p95: no tail term,
   the plain chooser, exactly what the live fleet calls.
6. Totals: hours = steps x predicted step seconds + one start-up (D + the first batch) ; $ learner = the cheapest
   catalog instance of the learner's GPU with at least its GPU count in its market (billed whole) x hours; $ actors
   = the fleet's $/h x hours (reclaimed time is billed: availability already sized the fleet for it); $ traffic =
   the versions' bytes to the actors (``traffic.traffic_per_run``, with the relay or without, both reported) plus
   the learner's upload of each version to the store and the actors' rollout files to the store, each priced by
   ``providers.transfer_usd_per_gb``. Reclaims: ``plan.simulate_reclaims`` (Monte Carlo) over the run's hours.
   The learner at spot against on demand (``spot_learner.py``: expected learner reclaims x (relaunch + resume +
   lost work) at the run's burn rate, against the on-demand premium): ``spot_learner`` in the result; with
   ``learner.market: spot`` the plan's own hours and dollars include those reclaims (``usd_learner_reclaims``).
7. Budget and deadline: the hours and steps a budget buys at the plan's $/h; whether a deadline is met, and the
   cheapest way if it is (the plan's own cost).

Assumptions beyond the modules': the learner's GPUs hold ``LEARNER_BYTES_PER_PARAM`` bytes per parameter between
them; rollout files weigh ``ROLLOUT_BYTES_PER_TOKEN`` bytes per completion token (token
id and behavior logprob, 4 bytes each, before compression); the learner runs in the store's place unless it is
pinned elsewhere; the learner bills for the whole run including its waits. Every assumption the answer used is in
the result's ``assumptions`` list with its source.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, replace

from echo2.errors import Echo2InputError
from echo2.fleet.prices import gpu_matcher
from echo2.fleet.prices.catalog import Offer, Profile, gpu_key, profile_for
from echo2.fleet.providers import facts, transfer_usd_per_gb
from echo2.fleet.sizing import dissemination, spot_learner, step_time, traffic
from echo2.fleet.sizing.capacity import Workload, min_staleness
from echo2.fleet.sizing.choose import batch_seconds_of, choose_fleet
from echo2.fleet.sizing.plan import WorkerType, simulate_reclaims
from echo2.fleet.sizing.workload_file import WorkloadFile

FIXED_POINT_ROUNDS = 4
ROLLOUT_BYTES_PER_TOKEN = 8.0
LEARNER_BYTES_PER_PARAM = 16.0
"""Training state per parameter: fp32 master weights, gradients and AdamW's two moments (4 x 4 bytes; bf16 copies
and activations are left to the rest of the GPU), sharded over the learner's GPUs (FSDP)."""
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


def learner_offer(wf: WorkloadFile, offers: list[Offer]) -> Offer:
    """The cheapest instance for the learner (module docstring, step 6) whose GPUs hold the training state:
    ``LEARNER_BYTES_PER_PARAM`` bytes per parameter sharded over the learner's GPUs (an unknown memory size
    is given the benefit of the doubt)."""
    spot = wf.learner.market == "spot"
    need_gib = LEARNER_BYTES_PER_PARAM * wf.params_b()[0] * 1e9 / 2**30 / wf.learner.gpus
    fitting = [o for o in offers if gpu_key(o.gpu) == gpu_key(wf.learner.gpu) and o.gpu_count >= wf.learner.gpus
               and (o.gpu_memory_gib is None or o.gpu_memory_gib >= need_gib)
               and o.price(spot) is not None and (wf.learner.provider is None or o.provider == wf.learner.provider)
               and (wf.learner.region is None or o.region == wf.learner.region)]
    if not fitting:
        raise Echo2InputError(f"no {wf.learner.market} offer of {wf.learner.gpus}x {wf.learner.gpu} with "
                              f"{need_gib:.0f} GiB each for the learner"
                              + (f" at {wf.learner.provider}" if wf.learner.provider else "") + " in the catalog")
    return min(fitting, key=lambda o: (o.price(spot), o.name))


def _train_seconds(wf: WorkloadFile, active_b: float, mfu: tuple[float, str] | None) -> tuple[float, dict]:
    if wf.train.train_seconds is not None:
        return wf.train.train_seconds, {"train_seconds": wf.train.train_seconds, "from": "given"}
    if mfu is None:
        mfu = ((wf.learner.mfu, wf.sources.get("learner.mfu", "given in the workload")) if wf.learner.mfu
               else (step_time.DEFAULT_MFU, step_time.DEFAULT_MFU_SOURCE))
    tokens = wf.tokens_per_step()
    t = step_time.train_seconds(active_b, tokens, gpu=wf.learner.gpu, gpus=wf.learner.gpus, mfu=mfu[0],
                                audit_fraction=wf.train.audit_fraction)
    return t, {"train_seconds": t, "from": "FLOP model", "tokens_per_step": tokens, "mfu": mfu[0],
               "mfu_source": mfu[1], "peak_tflops": step_time.peak_tflops(wf.learner.gpu),
               "flops_per_step": step_time.flops_per_step(active_b, tokens, wf.train.audit_fraction)}


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
    r = wf.rollout
    return Workload(train_seconds=train_seconds, groups_per_step=r.groups_per_step, groups_per_batch=r.groups_per_batch,
                    staleness=wf.train.staleness if staleness is None else staleness,
                    dissemination_seconds=dissemination_seconds, upload_seconds=wf.network.upload_seconds,
                    publish_every=wf.train.publish_every,
                    max_pending_batches=wf.train.max_pending_batches or math.ceil(r.groups_per_step /
                                                                                  r.groups_per_batch))


def _choose(wf, workload, offers, profiles, total_b, active_b, budget):
    markets = ("spot", "on-demand") if wf.actors.market == "both" else (wf.actors.market,)
    reclaim = None if wf.actors.reclaim_per_hour is None else {"spot": wf.actors.reclaim_per_hour}
    batch_tokens = wf.rollout.groups_per_batch * wf.rollout.group_size * wf.rollout.completion_tokens_mean
    tail = _tail_seconds(wf)
    gpus = wf.actors.gpus
    renamed: dict[str, Offer] = {}
    if tail > 0:
        offers, profiles, renamed = _tail_aware(offers, profiles, gpus, batch_tokens, tail, total_b, active_b)
        gpus = None
    found = choose_fleet(workload, offers, profiles, model_params_b=total_b, active_params_b=active_b,
                         batch_tokens=batch_tokens, target_utilization=wf.actors.target_utilization, markets=markets,
                         gpus=gpus, reclaim=reclaim, caps=wf.actors.caps, budget_usd_per_hour=budget)
    if found is not None and renamed:
        found.fleet = [(replace(c, offer=renamed[c.offer.name]), n) for c, n in found.fleet]
    return found


def _tail_aware(offers, profiles, gpus, batch_tokens, tail, total_b, active_b):
    """Offers and profiles as step 5 of the module docstring hands them to the chooser."""
    match = gpu_matcher(gpus)
    out_offers, out_profiles, renamed = [], {}, {}
    for o in offers:
        profile = profile_for(profiles, o.gpu)
        if profile is None or not match(o.gpu):
            continue
        cap = batch_tokens / (tail * o.gpu_count)
        speed = profile.speed(total_b, active_b)
        key = f"{profile.name}/{o.gpu_count}"
        if gpu_key(key) not in out_profiles:
            # one size, the model's: speed(total, active) is exactly this figure (a single-entry table)
            out_profiles[gpu_key(key)] = Profile(key, {total_b: min(speed, cap)}, profile.source
                                                 + (f"; capped at {cap:.0f} tok/s/GPU by the batch tail"
                                                    if cap < speed else ""))
        out_offers.append(replace(o, gpu=key))
        renamed[o.name] = o
    return out_offers, out_profiles, renamed


def _tail_seconds(wf: WorkloadFile) -> float:
    p95 = wf.rollout.completion_tokens_p95
    return 0.0 if p95 is None else p95 / wf.rollout.single_stream_tokens_per_second


def _fleet_rows(activation) -> list[dict]:
    return activation.as_dict()["fleet"] if activation else []


def _neighbour(wf, t, d, offers, profiles, total_b, active_b, budget, staleness) -> dict:
    w = capacity_workload(wf, t, d, staleness)
    found = _choose(wf, w, offers, profiles, total_b, active_b, budget)
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
             neighbours: tuple[int, ...] = NEIGHBOURS, seed: int = 0) -> dict:
    """The plan of a whole run (module docstring): a JSON-ready dict. ``offers`` holds both markets (the learner
    and the actors pick theirs). ``mfu`` / ``changed_fraction``: (value, source) overriding the workload's.
    ``reclaim_hours``: simulate reclaims over that many hours instead of the run's."""
    total_b, active_b = wf.params_b()
    _check_gpus(wf, offers, profiles)
    auto_gpus = wf.learner.gpus is None
    if auto_gpus:
        wf = wf.model_copy(update={"learner": wf.learner.model_copy(update={"gpus": _learner_gpus(wf, offers)})})
    t, t_info = _train_seconds(wf, active_b or total_b, mfu)
    if changed_fraction is None:
        changed_fraction = ((wf.network.changed_fraction, wf.sources.get("network.changed_fraction", "given"))
                            if wf.network.changed_fraction is not None
                            else (dissemination.DEFAULT_CHANGED_FRACTION,
                                  dissemination.DEFAULT_CHANGED_FRACTION_SOURCE))
    vb = dissemination.version_bytes(total_b * 1e9, keyframe_every=wf.network.keyframe_every,
                                     changed_fraction=changed_fraction[0])
    groups: list[tuple[str, str, int]] = []
    found = None
    d = _dissemination(wf, vb["mean"], groups)
    for _ in range(FIXED_POINT_ROUNDS):  # D follows the fleet, the fleet follows D
        workload = capacity_workload(wf, t, d)
        found = _choose(wf, workload, offers, profiles, total_b, active_b, budget_usd_per_hour)
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
                     "keyframe_every": wf.network.keyframe_every},
        "dissemination_seconds": d, "dissemination_seconds_keyframe": _dissemination(wf, vb["keyframe"], groups),
        "workload": asdict(workload), "staleness": wf.train.staleness,
        "target_utilization": wf.actors.target_utilization,
        "prices": wf.actors.market, "feasible": found is not None,
        "required_throughput": wf.rollout.groups_per_step / t,
        "required_tokens_per_second": wf.completion_tokens_per_step() / t}
    out["neighbours"] = [_neighbour(wf, t, d, offers, profiles, total_b, active_b, budget_usd_per_hour,
                                    wf.train.staleness + k) for k in neighbours
                         if k and wf.train.staleness + k >= wf.train.publish_every - 1]
    out["assumptions"] = _assumptions(wf, t_info, changed_fraction, total_b, active_b, profiles,
                                      {c.gpu_type or c.offer.gpu for c, _ in found.fleet} if found else set())
    if auto_gpus:
        row = next(a for a in out["assumptions"] if a["name"] == "learner.gpus")
        row["source"] = (f"chosen: the fewest of 1, 2, 4, 8 {wf.learner.gpu} whose memory holds "
                         f"{LEARNER_BYTES_PER_PARAM:g} bytes per parameter (training state, sharded)")
    if found is None:
        out.update({"fleet": [], "workers": 0, "usd_per_hour": None, "predicted_utilization": None,
                    "utilization": None, "step_seconds": None, "min_staleness": None,
                    "reason": f"no fleet reaches {wf.actors.target_utilization:.0%} utilization at "
                              f"S={wf.train.staleness}" + (f" under ${budget_usd_per_hour:g}/h"
                                                           if budget_usd_per_hour else "")})
        return out
    batch_tokens = wf.rollout.groups_per_batch * wf.rollout.group_size * wf.rollout.completion_tokens_mean
    batches = batch_seconds_of(found.fleet, workload, batch_tokens)
    p = found.prediction
    step_seconds = p.step_seconds
    tail = _tail_seconds(wf)
    out.update({"fleet": _fleet_rows(found), "workers": found.instances, "usd_per_hour": found.usd_per_hour,
                "predicted_utilization": p.utilization, "utilization": p.utilization,
                "step_seconds": step_seconds, "bound": p.bound, "lag": {str(k): v for k, v in sorted(p.lag.items())},
                "min_staleness": min_staleness(workload, batches), "proven_optimal": found.proven_optimal,
                "chooser_rounds": found.rounds,
                "tail": {"seconds": tail, "binds": any("by the batch tail" in c.speed_source for c, _ in found.fleet)},
                "usd_per_step": found.usd_per_hour * step_seconds / 3600})
    steps = wf.steps()
    if steps is not None:
        out.update(_totals(wf, out, found, workload, vb, steps, offers, step_seconds, d, batches,
                           reclaim_hours, seed))
        out.update(_budget_and_deadline(out, budget_usd, deadline_hours))
        out["compare"] = [r.model_dump() for r in wf.compare]
        out["verdict"] = _verdict(out, wf)
    elif reclaim_hours is not None:
        out["reclaims"] = _reclaims(wf, found, workload, reclaim_hours, seed)
    return out


def _traffic(wf: WorkloadFile, learner: Offer, found, vb: dict, steps: int) -> dict:
    """The run's traffic with the learner on ``learner`` (module docstring, step 6)."""
    store = (wf.store.provider or learner.provider, wf.store.region or learner.region)
    versions = math.ceil(steps / wf.train.publish_every)
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


def _totals(wf, out, found, workload, vb, steps, offers, step_seconds, d, batches, reclaim_hours, seed) -> dict:
    startup = d + max(batches)
    seconds = steps * step_seconds + startup
    hours = seconds / 3600
    learner = learner_offer(wf, offers)
    learner_price = learner.price(wf.learner.market == "spot")
    moved = _traffic(wf, learner, found, vb, steps)
    store, usd_traffic = moved.pop("store"), moved.pop("usd")
    usd_learner = learner_price * hours
    usd_actors = found.usd_per_hour * hours
    reclaims = _reclaims(wf, found, workload, reclaim_hours or hours, seed)
    spot = _spot_learner(wf, offers, hours, step_seconds, found.usd_per_hour,
                         lambda offer: _traffic(wf, offer, found, vb, steps)["usd"])
    gap_hours = usd_reclaims = 0.0
    if wf.learner.market == "spot" and spot is not None and spot["finishes"]:  # the plan's own learner is reclaimed
        gap_hours, usd_reclaims = spot["gap_hours"], spot["usd_reclaims"]
    return {"steps": steps, "hours": hours + gap_hours, "startup_seconds": startup,
            "usd_learner": usd_learner, "usd_actors": usd_actors, "usd_traffic": usd_traffic,
            "usd_learner_reclaims": usd_reclaims, "usd_total": usd_learner + usd_actors + usd_traffic + usd_reclaims,
            "learner": {"offer": learner.as_dict(), "market": wf.learner.market, "usd_per_hour": learner_price,
                        "gpus_billed": learner.gpu_count},
            "store": {"provider": store[0], "region": store[1]}, "traffic": moved,
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
    """plan.simulate_reclaims of the chosen fleet over ``hours``, and the dollars of the time replacements are
    billed but not producing."""
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


def _verdict(out: dict, wf: WorkloadFile) -> str:
    """One line: does echo2 beat each reference row, and if not, which assumption keeps it above."""
    if not wf.compare:
        return ""
    ref = min(wf.compare, key=lambda r: r.usd)
    usd_ok, hours_ok = out["usd_total"] <= ref.usd, out["hours"] <= ref.hours
    head = (f"echo2 predicts ${out['usd_total']:,.0f} in {out['hours']:.1f} h against {ref.name}'s "
            f"${ref.usd:,.0f} in {ref.hours:g} h")
    if usd_ok and hours_ok:
        return head + ": at or under both, on these assumptions (the ones the hours follow are listed first)."
    parts = []
    step = out["learner_step"]
    if not hours_ok:
        if step.get("from") == "FLOP model" and out.get("bound") == "learner":
            need = step["mfu"] * (out["hours"] * 3600 - out["startup_seconds"]) / (ref.hours * 3600 -
                                                                                   out["startup_seconds"])
            parts.append(f"hours: learner-bound at MFU {step['mfu']:.0%} ({step['mfu_source'].split(':')[0]}); "
                         f"MFU >= {need:.0%} would reach {ref.hours:g} h")
        else:
            parts.append(f"hours: {out.get('bound', '?')}-bound at {out['step_seconds']:.0f} s/step "
                         f"x {out['steps']} steps")
    if not usd_ok:
        biggest = max(("learner", out["usd_learner"]), ("actors", out["usd_actors"]),
                      ("traffic", out["usd_traffic"]), key=lambda kv: kv[1])
        parts.append(f"cost: the {biggest[0]} (${biggest[1]:,.0f}) is the largest share")
    return head + "; above it -- " + "; ".join(parts) + "."


def _assumptions(wf: WorkloadFile, t_info: dict, changed: tuple[float, str], total_b: float,
                 active_b: float | None, profiles: dict[str, Profile], fleet_gpus: set[str]) -> list[dict]:
    rows = [a for a in wf.assumptions() if a["name"] not in ("network.changed_fraction", "learner.mfu")]
    if t_info.get("from") == "FLOP model":
        rows.insert(0, {"name": "learner.mfu", "value": t_info["mfu"], "source": t_info["mfu_source"]})
        rows.insert(1, {"name": "learner bf16 peak (TFLOP/s per GPU)", "value": t_info["peak_tflops"],
                        "source": step_time.PEAK_SOURCE})
        rows.insert(2, {"name": "learner FLOPs per token", "value": "(6 + 2 x audit_fraction) x active",
                        "source": "step_time.py: 6N training (forward + backward) + 2N audit recomputation"})
    rows.append({"name": "network.changed_fraction", "value": changed[0], "source": changed[1]})
    some = next(iter(profiles.values()), None)
    if active_b is not None and some is not None:
        rows.append({"name": "MoE decode bytes factor", "value": some.moe_bytes_factor,
                     "source": "infra/profiles/rollout-throughput.yaml moe.bytes_factor: an estimate, not measured"})
    names = wf.actors.gpus or sorted(fleet_gpus)
    for name in names:
        profile = profiles.get(gpu_key(name))
        if profile is not None:
            rows.append({"name": f"actor speed {profile.name} (tok/s per GPU)",
                         "value": round(profile.speed(total_b, active_b)), "source": profile.source})
    rows.append({"name": "learner training state (bytes per parameter)", "value": LEARNER_BYTES_PER_PARAM,
                 "source": "assumption: fp32 weights, gradients and AdamW moments, sharded over the learner's GPUs"})
    rows.append({"name": "rollout bytes per completion token", "value": ROLLOUT_BYTES_PER_TOKEN,
                 "source": "assumption: token id + behavior logprob, 4 bytes each, uncompressed"})
    rows.append({"name": "spot learner notice by provider (share of reclaims, seconds)",
                 "value": spot_learner.NOTICE, "source": spot_learner.NOTICE_SOURCE})
    rows.append({"name": "provider facts (reclaim rate, cap, egress)", "value": "providers.py",
                 "source": "echo2/fleet/providers.py: each provider's row states its source"})
    return rows
