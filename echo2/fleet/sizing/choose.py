"""The one chooser of what is bought: ``choose_fleet``, used by ``echo2 plan``, ``echo2 bench cost``
and the live fleet (``fleet.actors: auto``), so the three buy the same mix for the same inputs.

Model. The capacity model (``capacity.py``) says how many groups per second keep the learner busy:
R / T (``capacity.required_throughput``), scaled by the target utilization u. Cost-aware activation
(``activation.py``) finds the cheapest counts of (offer, market) candidates whose *expected*
groups/s (each instance's throughput times its availability under its reclaim rate) covers a
target: an exact bounded covering knapsack. The throughput target is necessary, not sufficient:
the learner also waits when fresh rollouts arrive late (staleness S, dissemination D, the fill
time F_R) or when batch granularity leaves it short. So:

1. target = u * R / T (groups/s); activate the candidates on it.
2. Check the fleet with ``capacity.predict``: each instance enters as a worker whose batch time
   ``g'`` gives its expected groups/s, ``b / (g' + U) = a * b / (g + U)`` with ``g`` its batch time
   while up and ``a`` its availability, i.e. ``g' = (g + U) / a - U`` (reclaims spread as a slower
   worker: the mean, not the bursts; ``planner/reclaim_simulation.simulate_reclaims`` has the bursts).
3. If predict's utilization is below u, raise the target by the shortfall's ratio u / utilization
   (at least ``MIN_RAISE``, at most ``MAX_RAISE``, and past the missing fleet's expected throughput,
   so that each round buys more) and solve again; stop when predict meets u, when
   no fleet within the caps and the budget covers the raised target, or after ``MAX_ROUNDS`` rounds.

Assumptions (stated, not measured): one actor per instance, its batch split over the instance's
GPUs; an instance's speed is its GPUs' profiled speed (``Profile.speed``: on the active parameters
for a mixture of experts where the profile supports it, memory on the total); the fleet is fixed
for the check (no reclaims but through availability). The raise stops short of optimality in one
way: a cheaper fleet might meet u at a target between two rounds' targets; the rounds' ratio is
the shortfall itself, so that gap is at most ``MIN_RAISE`` of throughput when the model is near
linear (the throughput-bound case). Some S can never be met (a version that reaches the actors
later than S steps allow): that is checked first with infinitely fast workers, and answered None.
"""

from __future__ import annotations

import math

from echo2.errors import Echo2InputError
from echo2.fleet.prices.catalog import Offer, Profile
from echo2.fleet.sizing.activation import Activation, activate, candidates, target_groups_per_second
from echo2.fleet.sizing.capacity import Prediction, Workload, predict

MIN_RAISE = 1.02
"""The least a round raises the target by (2% of throughput)."""
MAX_RAISE = 2.0
MAX_ROUNDS = 40
BISECTIONS = 12
"""Halvings ``best_effort`` takes to find the most throughput the caps and the budget allow (to 1/4096)."""
PREDICT_STEPS = 200
"""Learner steps ``predict`` simulates for the check (its first half is warm-up)."""


def batch_seconds_of(fleet: list, workload: Workload, batch_tokens: float) -> list[float]:
    """One entry per instance of ``fleet`` ([(Candidate, count)]): its batch time as step 2 of the module
    docstring has it (the expected throughput of an instance reclaimed at its rate)."""
    out = []
    u = workload.actor_wait
    for c, n in fleet:
        g = batch_tokens / c.tokens_per_second
        out += [(g + u) / c.availability - u] * n
    return out


def _most_within(cands: list, target: float, budget: float | None) -> float | None:
    """The largest throughput below ``target`` some fleet within the caps and ``budget`` covers, to
    ``BISECTIONS`` halvings (coverable targets are a prefix: a fleet covering x covers anything less); None when
    not even a sliver of it can be had."""
    lo, hi = 0.0, target
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        if activate(cands, mid, budget_usd_per_hour=budget) is not None:
            lo = mid
        else:
            hi = mid
    return lo if lo > 0 else None


def check(activation: Activation, workload: Workload, batch_tokens: float) -> Prediction:
    """capacity.predict for a chosen fleet (step 2)."""
    return predict(workload, batch_seconds_of(activation.fleet, workload, batch_tokens), steps=PREDICT_STEPS)


def choose_fleet(workload: Workload, offers: list[Offer], profiles: dict[str, Profile], *,
                 model_params_b: float, active_params_b: float | None = None, batch_tokens: float,
                 target_utilization: float = 0.95, markets: tuple[str, ...] = ("spot",),
                 gpus: list[str] | None = None, reclaim: dict[str, float] | None = None,
                 caps: dict[str, int] | None = None, budget_usd_per_hour: float | None = None,
                 best_effort: bool = False) -> Activation | None:
    """The cheapest fleet (activation's exact solver) whose predicted utilization reaches
    ``target_utilization`` (see the module docstring); None when none within the caps and the budget
    does. ``best_effort`` (the live fleet): instead of None, the fleet of the last round that could be
    bought, its ``prediction`` telling how far it falls short; where not even the first target can be
    covered, the fleet of the most throughput the caps and the budget allow (``_most_within``). The
    result carries ``prediction`` (``capacity.Prediction``) and ``rounds``."""
    if not 0 < target_utilization <= 1:
        raise Echo2InputError(f"target utilization {target_utilization} must be in (0, 1]")
    if not batch_tokens > 0 or not math.isfinite(batch_tokens):
        raise Echo2InputError(f"tokens per batch {batch_tokens} must be a finite number > 0")
    cands = candidates(offers, profiles, model_params_b, active_params_b=active_params_b, unit="groups/s",
                       workload=workload, batch_tokens=batch_tokens, markets=tuple(markets), gpus=gpus,
                       reclaim=reclaim, caps=caps)
    if not cands:
        return None
    fastest = [1e-6] * math.ceil(workload.groups_per_step / workload.groups_per_batch)
    if predict(workload, fastest, steps=PREDICT_STEPS).utilization < target_utilization - 1e-9 and not best_effort:
        return None  # S out of reach for any fleet
    target = target_groups_per_second(workload, target_utilization)
    last = None
    if best_effort and activate(cands, target, budget_usd_per_hour=budget_usd_per_hour) is None:
        target = _most_within(cands, target, budget_usd_per_hour)
        if target is None:
            return None
    for rounds in range(1, MAX_ROUNDS + 1):
        found = activate(cands, target, budget_usd_per_hour=budget_usd_per_hour)
        if found is None:
            break
        found.prediction = check(found, workload, batch_tokens)
        found.rounds = rounds
        last = found
        utilization = found.prediction.utilization
        if utilization >= target_utilization - 1e-9:
            return found
        raise_by = target_utilization / utilization if utilization > 0 else MAX_RAISE
        # and past what this fleet already makes, so the next round buys more than the fleet that missed
        target = max(target * min(MAX_RAISE, max(MIN_RAISE, raise_by)), found.expected_throughput * (1 + 1e-6))
    return last if best_effort else None
