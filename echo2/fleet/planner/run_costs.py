"""The parts of a run's hours and dollars beyond steps x step time: checkpoints, the start, and correlated reclaims.

Checkpoints. echo2's learner writes one every ``train.checkpoint_every`` steps and one at the end
(``learner/checkpoint.py``): each rank its shard of the fp32 weights and AdamW's two fp32 moments, 12 bytes per
parameter in all (measured 12.03, docs/learner.md), straight to the store, and the step waits for it. A checkpoint
takes ``12 P / (ranks x store_gbit)`` seconds (every rank writing at the store's rate, as ``spot_learner.state_seconds``
reads it back), and its bytes cross from the learner's place to the store's at ``providers.transfer_usd_per_gb``.
Stored bytes are not priced (hours of object storage cost cents).

The start. The learner loads the model (rank 0 reads the bf16 weights once, at the store's rate) while the actors
boot (``actors.replacement_seconds``: provisioning, setup, model load); then version 0 reaches them (D of a
keyframe) and their first batches take one batch time before the first step can be collected.

Bursts. Spot capacity is reclaimed per pool, so a provider takes a share of a run's actors at once
(``providers.ProviderFacts.spot_bursts_per_hour`` / ``spot_burst_share``, or the workload's). During a burst,
``replacement_seconds`` long, the fleet makes ``(1 - share of it that went)`` of its groups. The learner consumes
``R / T`` groups/s when it does not wait; it paces at ``min(fleet, R / T)``. A burst costs the groups the pace lost
over its length, less the backlog flow control let the fleet build beforehand (``max_pending_batches x b`` groups,
full only where the fleet is faster than the learner), in seconds at the pace. The independent reclaims are in each
instance's availability already (``activation.py``); bursts are on top of them. Replacements bill from launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from echo2.fleet.providers import facts, transfer_usd_per_gb

CHECKPOINT_BYTES_PER_PARAM = 12.0
"""fp32 weights + AdamW's two fp32 moments: 12 bytes per trainable parameter (measured 12.03, docs/learner.md)."""


def checkpoint_count(steps: int, every: int) -> int:
    """Periodic checkpoints and the one at the end (not twice when the end falls on a period)."""
    return steps // every + (1 if steps % every else 0)


def checkpoint_seconds(total_params_b: float, ranks: int, store_gbit: float) -> float:
    return CHECKPOINT_BYTES_PER_PARAM * total_params_b * 1e9 / (max(1, ranks) * store_gbit * 1e9 / 8)


def checkpoints(*, steps: int, every: int, total_params_b: float, ranks: int, store_gbit: float,
                learner_place: tuple[str, str], store_place: tuple[str, str]) -> dict:
    """Count, seconds, bytes and egress dollars of a run's checkpoints (module docstring)."""
    n = checkpoint_count(steps, every)
    each = checkpoint_seconds(total_params_b, ranks, store_gbit)
    gb = CHECKPOINT_BYTES_PER_PARAM * total_params_b * n
    usd = gb * transfer_usd_per_gb(*learner_place, *store_place)
    return {"count": n, "seconds_each": each, "seconds": n * each, "gb_each": gb / n if n else 0.0, "gb": gb,
            "usd_egress": usd, "route": f"{'/'.join(learner_place)} -> {'/'.join(store_place)}"}


def startup_seconds(*, total_params_b: float, store_gbit: float, actor_boot_seconds: float,
                    keyframe_seconds: float, first_batch_seconds: float) -> float:
    """From launch to the first step's rollouts collected (module docstring)."""
    learner_load = 2.0 * total_params_b * 1e9 / (store_gbit * 1e9 / 8)
    return max(learner_load, actor_boot_seconds) + keyframe_seconds + first_batch_seconds


@dataclass(frozen=True)
class BurstPool:
    """One provider's actors, as a burst sees them."""

    provider: str
    instances: int
    groups_per_second: float
    """Their expected groups/s together."""
    usd_per_hour: float
    """Their price together."""


def burst_rates(provider: str, per_hour: float | None, share: float | None) -> tuple[float, float]:
    """(bursts per hour, share) for a provider: the workload's where given, else providers.py's."""
    f = facts(provider)
    return (f.spot_bursts_per_hour if per_hour is None else per_hour,
            f.spot_burst_share if share is None else share)


def burst_cost(pool: BurstPool, fleet_groups_per_second: float, need_groups_per_second: float, *, share: float,
               seconds: float, backlog_groups: float) -> tuple[float, float]:
    """(learner seconds lost, dollars of replacements billed while not producing) of one burst of ``pool``."""
    pace = min(fleet_groups_per_second, need_groups_per_second)
    if pace <= 0:
        return 0.0, 0.0
    during = min(fleet_groups_per_second - share * pool.groups_per_second, need_groups_per_second)
    cushion = backlog_groups if fleet_groups_per_second > need_groups_per_second * 1.02 else 0.0
    lost_groups = max(0.0, (pace - during) * seconds - cushion)
    taken = math.ceil(share * pool.instances - 1e-9) if share > 0 else 0
    usd = taken * (pool.usd_per_hour / max(1, pool.instances)) * seconds / 3600
    return lost_groups / pace, usd


def expected_bursts(pools: list[BurstPool], hours: float, fleet_groups_per_second: float,
                    need_groups_per_second: float, *, per_hour: float | None, share: float | None, seconds: float,
                    backlog_groups: float, counts: list[int] | None = None) -> dict:
    """The bursts of a run of ``hours``: their expected number (or ``counts``, one per pool, drawn by the caller),
    the learner hours they cost and the dollars of replacements (module docstring)."""
    lost_s = usd = n_total = 0.0
    rows = []
    for i, pool in enumerate(pools):
        rate, s = burst_rates(pool.provider, per_hour, share)
        n = rate * hours if counts is None else counts[i]
        lost, cost = burst_cost(pool, fleet_groups_per_second, need_groups_per_second, share=s, seconds=seconds,
                                backlog_groups=backlog_groups)
        lost_s += n * lost
        usd += n * cost
        n_total += n
        rows.append({"provider": pool.provider, "bursts": n, "per_hour": rate, "share": s,
                     "learner_seconds_each": lost})
    return {"bursts": n_total, "hours": lost_s / 3600, "usd_replacements": usd, "pools": rows}
