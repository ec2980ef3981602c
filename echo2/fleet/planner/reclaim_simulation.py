"""The reclaim simulation: how many extra instances hold a planned fleet's throughput while spot instances
are reclaimed (``simulate_reclaims``; its docstring has the model). ``run_plan.py`` runs it on the fleet
``choose.choose_fleet`` bought, and the plan's headline buys the extra instances it asks for. Nothing here prints.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from echo2.errors import Echo2InputError
from echo2.fleet.prices.catalog import Offer
from echo2.fleet.sizing.capacity import Workload


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


def simulate_reclaims(pairs: list[tuple[WorkerType, int]], hours: float, reclaim_rate_per_hour: float,
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
    pairs = list(pairs)
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
