"""A spot learner priced against an on-demand one: expected reclaims x (recovery + lost work) at the run's burn rate,
against the on-demand premium (``echo2 plan``; ``run_plan._totals`` calls ``price_spot_learner``).

Model (every input is a workload field, ``workload_file.py``; defaults are assumptions, sources below):

- The plan's run takes ``H`` hours with a learner that is never reclaimed (``run_plan``), a step takes ``T``
  seconds, the actors cost ``A`` $/h, the learner ``p_od`` $/h on demand, ``p_spot`` at spot (the cheapest fitting
  catalog offer of each market: ``run_plan.learner_offer``), the traffic ``X`` $ in all with the spot learner and
  ``X_od`` with the on-demand one (each from its own offer's place: ``run_plan._traffic``).
- The spot learner's machine is reclaimed at ``lam`` per hour (``learner.reclaims_per_hour``, else
  ``providers.py``'s spot rate for the spot offer's provider: the rate the actors are planned with).
- Each reclaim costs a gap of ``g = R + r + L`` seconds during which the run makes no progress and everything
  keeps billing (the actors wait for the relaunched learner and keep their machines):
  ``R`` relaunch (``learner.recovery_minutes``: SkyPilot's managed-job recovery provisioning another instance, its
  setup, the learner process starting), ``r`` resume (``learner.resume_seconds``, else the training state,
  ``LEARNER_BYTES_PER_PARAM`` bytes per parameter, read by the learner's ranks in parallel, each at
  ``network.store_gbit``), ``L`` lost work, redone after the resume (the actors' rollouts of the lost timeline are
  set aside too, so the whole run's burn rate pays for it).
- Lost work. With a notice (probability ``q``, ``learner.notice_probability``) the learner checkpoints at once: the
  step in flight finishes if it ends in time for the checkpoint write (the same bytes at the same rate as the
  resume) within the notice's ``W`` seconds (``learner.notice_seconds``), else it is abandoned -- at most one step.
  The notice falls uniformly within a step, so the expected loss is ``(T - s)^2 / (2T)`` with ``s = W - write``
  the slack (0 if ``s >= T``; a notice too short for the write, ``s < 0``, saves nothing: a reclaim without a
  notice). Without a notice the work since the last periodic checkpoint is lost: uniformly up to
  ``c = train.checkpoint_every`` steps, ``c T / 2`` expected. ``L = q L_notice + (1 - q) c T / 2``.
- Reclaims come as a Poisson process over the run's wall time, gaps included: ``N = lam H' `` with
  ``H' = H + N g``, so ``N = lam H / (1 - lam g)`` (in hours); ``lam g >= 1`` never finishes.
- Cost: ``burn = p_spot + A + X / H`` $/h (the whole run's burn rate with a spot learner: the traffic is spread
  over the hours, slightly pessimistic since a gap publishes nothing); the reclaims cost ``N g burn``. A spot
  learner's run costs ``p_spot H + A H + X + N g burn``; the on-demand one ``p_od H + A H + X_od``; the saving is
  ``K - N g burn`` with ``K = (p_od - p_spot) H + X_od - X`` (the on-demand premium, and the traffic's difference),
  and it vanishes at ``lam* = K / (g (H burn + K))`` reclaims per hour (``P / (g (burn + P))`` for equal traffic,
  ``P = p_od - p_spot``).

Left out: a failed relaunch (no capacity: SkyPilot retries other regions, within ``R``), a relaunch in another
region than the spot offer's (its traffic is the offer's), and reclaims that come in bursts (the mean rate only).
"""

from __future__ import annotations

NOTICE = {"aws": (0.95, 120.0), "gcp": (0.95, 30.0)}
"""Provider -> (share of reclaims with a notice the learner hears, seconds the notice gives)."""
NOTICE_SOURCE = ("AWS: a spot interruption notice two minutes ahead, 'emitted on a best effort basis' "
                 "(docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html); GCP: a "
                 "preemption notice 30 s ahead (ACPI soft off); 0.95: an assumption for 'best effort'. Other "
                 "providers promise no notice: 0 assumed (a SIGTERM at a clean host shutdown is a bonus)")
NO_NOTICE = (0.0, 0.0)


def notice_of(provider: str) -> tuple[float, float]:
    """(probability, seconds) of the notice a learner on ``provider`` hears (``NOTICE``; none elsewhere)."""
    return NOTICE.get(provider.lower(), NO_NOTICE)


def state_seconds(state_bytes: float, store_gbit: float, ranks: int) -> float:
    """Seconds to read (or write) the training state with ``ranks`` readers, each at ``store_gbit``."""
    return state_bytes / (max(1, ranks) * store_gbit * 1e9 / 8)


def lost_seconds(step_seconds: float, checkpoint_every: int, notice_probability: float, notice_seconds: float,
                 checkpoint_seconds: float) -> dict:
    """Expected work lost per reclaim (module docstring), and its parts."""
    t = step_seconds
    slack = notice_seconds - checkpoint_seconds
    notice_saves = notice_probability > 0 and slack >= 0
    with_notice = (max(0.0, t - slack) ** 2 / (2 * t) if t > 0 else 0.0) if notice_saves else checkpoint_every * t / 2
    without = checkpoint_every * t / 2
    q = notice_probability
    return {"seconds": q * with_notice + (1 - q) * without, "with_notice_seconds": with_notice,
            "without_notice_seconds": without, "notice_fits_checkpoint": notice_saves,
            "worst_steps_with_notice": 1 if notice_saves else checkpoint_every,
            "worst_steps_without_notice": checkpoint_every}


def price_spot_learner(*, hours: float, step_seconds: float, spot_usd_per_hour: float,
                       on_demand_usd_per_hour: float | None, actors_usd_per_hour: float, traffic_usd: float,
                       on_demand_traffic_usd: float | None = None,
                       reclaims_per_hour: float, recovery_seconds: float, resume_seconds: float,
                       checkpoint_every: int, notice_probability: float, notice_seconds: float,
                       checkpoint_seconds: float) -> dict:
    """The spot learner's expected reclaims, their cost, and the comparison with an on-demand learner (module
    docstring). JSON-ready; ``finishes`` False (and no totals) when a reclaim is expected before each gap ends."""
    lost = lost_seconds(step_seconds, checkpoint_every, notice_probability, notice_seconds, checkpoint_seconds)
    gap_s = recovery_seconds + resume_seconds + lost["seconds"]
    lam, g = reclaims_per_hour, gap_s / 3600
    out: dict = {"plan_hours": hours, "reclaims_per_hour": lam, "recovery_seconds": recovery_seconds,
                 "resume_seconds": resume_seconds,
                 "checkpoint_seconds": checkpoint_seconds, "checkpoint_every": checkpoint_every,
                 "notice_probability": notice_probability, "notice_seconds": notice_seconds,
                 "lost_seconds": lost["seconds"], "lost": lost, "gap_seconds": gap_s, "finishes": lam * g < 1}
    if not out["finishes"]:
        return {**out, "cheaper": "on-demand", "saving_usd": None, "break_even_reclaims_per_hour": None}
    n = lam * hours / (1 - lam * g)
    burn = spot_usd_per_hour + actors_usd_per_hour + (traffic_usd / hours if hours > 0 else 0.0)
    usd_reclaims = n * g * burn
    usd_learner = spot_usd_per_hour * hours
    usd_total = usd_learner + actors_usd_per_hour * hours + traffic_usd + usd_reclaims
    out.update({"expected_reclaims": n, "gap_hours": n * g, "hours": hours + n * g, "burn_usd_per_hour": burn,
                "usd_reclaims": usd_reclaims, "usd_learner": usd_learner, "usd_total": usd_total})
    if on_demand_usd_per_hour is None:
        return {**out, "cheaper": None, "saving_usd": None, "break_even_reclaims_per_hour": None}
    premium_rate = on_demand_usd_per_hour - spot_usd_per_hour
    od_traffic = traffic_usd if on_demand_traffic_usd is None else on_demand_traffic_usd
    on_demand_total = on_demand_usd_per_hour * hours + actors_usd_per_hour * hours + od_traffic
    saving = on_demand_total - usd_total
    k = premium_rate * hours + od_traffic - traffic_usd
    out.update({"on_demand_usd_total": on_demand_total, "premium_usd": premium_rate * hours,
                "traffic_usd": traffic_usd, "on_demand_traffic_usd": od_traffic, "saving_usd": saving,
                "saving_share": saving / on_demand_total if on_demand_total > 0 else None,
                "cheaper": "spot" if saving > 0 else "on-demand",
                "break_even_reclaims_per_hour": k / (g * (hours * burn + k)) if k > 0 and g > 0 else None})
    return out


def verdict(s: dict, *, rate_source: str) -> str:
    """One line: which learner is cheaper for the workload, by how much, and at what reclaim rate it turns."""
    if not s["finishes"]:
        return (f"spot learner: at {s['reclaims_per_hour']:g} reclaims/h and a {s['gap_seconds'] / 60:.0f} min gap "
                "per reclaim the run never finishes: keep the learner on demand")
    head = (f"spot learner: {s['expected_reclaims']:.2f} expected reclaims at {s['reclaims_per_hour']:g}/h "
            f"({rate_source}) x {s['gap_seconds'] / 60:.1f} min each (relaunch {s['recovery_seconds'] / 60:.0f} + "
            f"resume {s['resume_seconds'] / 60:.1f} + lost work {s['lost_seconds'] / 60:.1f}) at "
            f"${s['burn_usd_per_hour']:.2f}/h = ${s['usd_reclaims']:,.2f}")
    if s["saving_usd"] is None:
        return head + "; no on-demand offer of the learner's GPUs to compare with"
    turn = s["break_even_reclaims_per_hour"]
    turn_text = "" if turn is None else f"; break-even at {turn:.2f} reclaims/h"
    if s["cheaper"] == "spot":
        return (head + f", against an on-demand premium of ${s['premium_usd']:,.2f}{_traffic_text(s)}: the spot "
                f"learner is cheaper by "
                f"${s['saving_usd']:,.2f} ({s['saving_share']:.1%} of the on-demand run's "
                f"${s['on_demand_usd_total']:,.2f})" + turn_text)
    return (head + f", against an on-demand premium of ${s['premium_usd']:,.2f}{_traffic_text(s)}: the on-demand "
            f"learner is cheaper by "
            f"${-s['saving_usd']:,.2f} ({-s['saving_share']:.1%})" + turn_text)


def _traffic_text(s: dict) -> str:
    diff = s["on_demand_traffic_usd"] - s["traffic_usd"]
    return "" if abs(diff) < 0.005 else f" and {'$' if diff > 0 else '-$'}{abs(diff):,.2f} of traffic"
