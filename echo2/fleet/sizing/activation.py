"""Cost-aware activation: the cheapest set of offers whose expected rollout throughput meets a target.

Candidates. Every offer of a price source (``prices/``) is a candidate once per market
it is quoted in: (provider, instance type, region, spot or on-demand). Its throughput when up,
``x``, is its GPUs' profiled speed (``prices.Profile.speed`` at the model size, log-log
interpolated between profiled sizes; ``measured.with_measurements`` puts measured figures in
first) times its GPU count -- in tokens/s, or, for a capacity-model target, in groups/s
``b / (batch_tokens / tokens_per_second + U)`` (as ``planner/reclaim_simulation.WorkerType.groups_per_second``
has it). Offers whose model does not fit one GPU (``prices.fits``) or whose GPU nobody profiled are left out.

Reclaims. An instance reclaimed ``r`` times an hour, each time out of work for ``t`` seconds
(``recovery_seconds``: a replacement's boot, environment, model load and first weights, plus the
batch lost), is producing a share ``a = 1 / (1 + r t / 3600)`` of the time (a renewal process:
mean up time 1/r, then down t). Its expected throughput is ``a x``, and the fleet is sized on
expected throughput: that is the over-provisioning for each offer's own reclaim rate, whatever
mix of markets the fleet ends up with. ``r`` comes from ``RECLAIM_PER_HOUR`` (per provider and
market, source in ``RECLAIM_SOURCE``), overridable per provider, market or offer.

Caps. A catalog row is not an unlimited supply: ``CAPS`` bounds the instances bought of one
(offer, market) (source in ``CAPS_SOURCE``), overridable per provider or offer; a budget in $/h
bounds the whole fleet.

Problem. Counts ``0 <= n_j <= cap_j`` minimizing ``sum n_j p_j`` subject to
``sum n_j a_j x_j >= target`` and ``sum n_j p_j <= budget``: a bounded integer covering knapsack.

Algorithm (exact):
1. Merge candidates of equal price and equal expected throughput (interchangeable) into one
   group whose cap is the sum of theirs; a group's count is later spread over its offers in name
   order.
2. Drop dominated groups: B is dominated by A if ``p_A <= p_B``, ``a_A x_A >= a_B x_B`` and A
   alone can cover the target within its cap (``cap_A >= ceil(target / (a_A x_A))``). Proof that
   an optimum survives: in an optimal fleet replace every B by an A; if that exceeds A's cap, use
   ``ceil(target / (a_A x_A))`` A's alone, fewer than the A's and B's before, so no dearer.
3. Groups of equal expected throughput and different prices (one instance type in several
   regions, sizes of one GPU) become one type with a convex cost: its N instances are the N
   cheapest of its groups, since an optimal fleet never buys a dearer unit of equal throughput
   while a cheaper one is free. The full catalog's ~1100 candidates become a few dozen types.
4. Branch and bound over the types: ``cover.cover_search``'s depth-first search (types
   cheapest per unit of expected throughput first, counts tried from the
   greedy cover downwards, pruned by the fractional (LP) cover bound and the budget), given each
   type's convex cost as price segments. Exact unless it hits its node limit (``proven_optimal``
   False). tests/e2e/test_activation.py checks it against brute force over every count vector on small
   random instances with ties, equal throughputs and dominated offers.

Baseline (``baseline``): for each GPU type, the cheapest fleet of its on-demand offers alone,
under the same caps (on-demand is never reclaimed here); the cheapest of those. This is the fleet
one would buy without a cost-aware planner: one GPU type, no spot.

Nothing here prints; ``echo2 bench cost`` and the fleet manager format the results.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from echo2.errors import Echo2InputError
from echo2.fleet.prices import gpu_matcher
from echo2.fleet.prices.catalog import Offer, Profile, fits, profile_for
from echo2.fleet.providers import DEFAULT, PROVIDERS
from echo2.fleet.sizing.capacity import Prediction, Workload, required_throughput
from echo2.fleet.sizing.cover import cover_search

RECLAIM_PER_HOUR = {("*", "on-demand"): 0.0, ("*", "spot"): DEFAULT.spot_reclaims_per_hour,
                    **{(name, "spot"): f.spot_reclaims_per_hour for name, f in PROVIDERS.items()}}
"""Reclaims per instance-hour by (provider, market): ``providers.py``'s table."""
RECLAIM_SOURCE = (
    "planning assumptions, not measurements: on-demand is not reclaimed (hardware failures ignored); "
    "spot 0.1 reclaims per instance-hour, deliberately pessimistic next to AWS's Spot Instance Advisor, which "
    "publishes each type's share of instances interrupted over the trailing month in bands <5% ... >20% "
    "(aws.amazon.com/ec2/spot/instance-advisor; even >20%/month is < 0.001/h), because GPU spot pools are "
    "reclaimed in bursts (ECHO-2's pool saw up to 40% bursty reclaim); marketplace interruptible capacity "
    "(runpod, vast) 0.2/h. Replace them with the reclaim rates a run's ledger measured.")
RECOVERY_SECONDS = 600.0
"""Seconds an instance is out of work per reclaim: a replacement's provisioning and setup, model
load and first weights, and the batch in flight when it was taken."""
CAPS = {"*": DEFAULT.cap, **{name: f.cap for name, f in PROVIDERS.items()}}
"""Instances per (offer, market) by provider: ``providers.py``'s table."""
CAPS_SOURCE = (
    "vast 2: SkyPilot's vast catalog (sky/catalog/data_fetchers/fetch_vast.py) writes a row only where at "
    "least two marketplace hosts offered that machine at snapshot time; every other provider 8 per "
    "(instance type, region, market): an assumption standing in for regional capacity and quotas.")


@dataclass(frozen=True)
class Candidate:
    """One offer in one market, as activation weighs it."""

    offer: Offer
    spot: bool
    usd_per_hour: float
    throughput: float
    """Per instance while it is up, in ``unit``."""
    unit: str
    tokens_per_second: float
    """Per instance (all its GPUs)."""
    reclaim_per_hour: float
    recovery_seconds: float
    cap: int
    speed_source: str
    gpu_type: str = ""
    """The worker profile's GPU name (``H100`` for an ``H100-MEGA`` offer too): what "one type" means."""

    @property
    def market(self) -> str:
        return "spot" if self.spot else "on-demand"

    @property
    def name(self) -> str:
        return f"{self.offer.name}:{self.market}"

    @property
    def availability(self) -> float:
        """Expected share of the time the instance produces (see the module docstring)."""
        return 1.0 / (1.0 + self.reclaim_per_hour * self.recovery_seconds / 3600.0)

    @property
    def expected_throughput(self) -> float:
        return self.throughput * self.availability

    def as_dict(self) -> dict:
        return {"offer": self.offer.as_dict(), "market": self.market, "usd_per_hour_each": self.usd_per_hour,
                "throughput_each": self.throughput, "expected_throughput_each": self.expected_throughput,
                "tokens_per_second_each": self.tokens_per_second, "unit": self.unit,
                "reclaim_per_hour": self.reclaim_per_hour, "availability": self.availability, "cap": self.cap,
                "speed_source": self.speed_source, "gpu_type": self.gpu_type}


def _lookup(table: dict, offer: Offer, *keys: str):
    for key in (f"{offer.name}:{keys[0]}" if keys else None, offer.name, *(f"{offer.provider}:{k}" for k in keys),
                offer.provider, *(f"*:{k}" for k in keys), *keys, "*"):
        if key is not None and key in table:
            return table[key]
    return None


def reclaim_rate(offer: Offer, spot: bool, overrides: dict[str, float] | None = None) -> float:
    """Reclaims per instance-hour: an override (``name:market``, ``name``, ``provider:market``,
    ``provider``, ``market``), else ``RECLAIM_PER_HOUR``."""
    market = "spot" if spot else "on-demand"
    if overrides:
        value = _lookup(overrides, offer, market)
        if value is not None:
            return value
    return RECLAIM_PER_HOUR.get((offer.provider, market), RECLAIM_PER_HOUR[("*", market)])


def cap_for(offer: Offer, spot: bool, overrides: dict[str, int] | None = None) -> int:
    """Instances of one (offer, market) at most: an override (as for ``reclaim_rate``), else ``CAPS``."""
    market = "spot" if spot else "on-demand"
    value = _lookup(overrides, offer, market) if overrides else None
    return int(value if value is not None else CAPS.get(offer.provider, CAPS["*"]))


def parse_overrides(texts: list[str] | None, what: str, cast=float) -> dict:
    """``KEY=VALUE`` options (``aws:spot=0.3``, ``spot=0.2``, ``vast=4``) as a table."""
    out = {}
    for text in texts or []:
        key, sep, value = text.partition("=")
        try:
            number = cast(value)
            if not sep or not key.strip() or number < 0 or not math.isfinite(number):
                raise ValueError
        except ValueError:
            raise Echo2InputError(f"{what} {text!r} must look like KEY=NUMBER >= 0 (KEY: spot, on-demand, a "
                                  "provider, provider:market or an offer name)") from None
        out[key.strip()] = number
    return out


def candidates(offers: list[Offer], profiles: dict[str, Profile], model_params_b: float, *,
               active_params_b: float | None = None, unit: str = "tokens/s", workload: Workload | None = None,
               batch_tokens: float | None = None,
               markets: tuple[str, ...] = ("spot", "on-demand"), gpus: list[str] | None = None,
               reclaim: dict[str, float] | None = None, caps: dict[str, int] | None = None,
               recovery_seconds: float = RECOVERY_SECONDS) -> list[Candidate]:
    """Every (offer, market) that can serve a ``model_params_b`` model, in ``unit`` (``tokens/s``,
    or ``groups/s`` of ``workload`` with ``batch_tokens`` output tokens per batch). A mixture of experts
    gives ``active_params_b``: speed follows it (``Profile.speed``), memory the total."""
    if unit not in ("tokens/s", "groups/s"):
        raise Echo2InputError(f"unknown throughput unit {unit!r}: tokens/s or groups/s")
    if unit == "groups/s" and (workload is None or not batch_tokens):
        raise Echo2InputError("a groups/s target needs the workload and the tokens per batch")
    match = gpu_matcher(gpus)
    out = []
    for offer in offers:
        profile = profile_for(profiles, offer.gpu)
        if profile is None or not match(offer.gpu) or not fits(model_params_b, offer.gpu_memory_gib):
            continue
        per_gpu = (profile.speed(model_params_b) if active_params_b is None
                   else profile.speed(model_params_b, active_params_b))
        speed = per_gpu * offer.gpu_count
        for market in markets:
            spot = market == "spot"
            price = offer.price(spot)
            if price is None:
                continue
            x = (speed if unit == "tokens/s"
                 else workload.groups_per_batch / (batch_tokens / speed + workload.upload_seconds))
            out.append(Candidate(offer, spot, price, x, unit, speed, reclaim_rate(offer, spot, reclaim),
                                 recovery_seconds, cap_for(offer, spot, caps), profile.source, profile.name))
    return out


def target_groups_per_second(workload: Workload, target_utilization: float = 0.95) -> float:
    """The capacity model's target: the groups/s that keep the learner busy ``target_utilization``
    of the time (``capacity.required_throughput``, R / T, scaled)."""
    return target_utilization * required_throughput(workload)


@dataclass
class Activation:
    """A chosen fleet: (candidate, count) pairs and what they add up to."""

    target: float
    unit: str
    fleet: list[tuple[Candidate, int]]
    proven_optimal: bool
    search_seconds: float
    candidates: int
    types_searched: int
    prediction: Prediction | None = None
    """``choose.choose_fleet``'s check of this fleet with ``capacity.predict`` (None: not checked)."""
    rounds: int = 0
    """``choose.choose_fleet``'s rounds of raising the target (0: activated once, not checked)."""

    @property
    def usd_per_hour(self) -> float:
        return sum(c.usd_per_hour * n for c, n in self.fleet)

    @property
    def expected_throughput(self) -> float:
        return sum(c.expected_throughput * n for c, n in self.fleet)

    @property
    def nominal_throughput(self) -> float:
        """With no instance reclaimed."""
        return sum(c.throughput * n for c, n in self.fleet)

    @property
    def instances(self) -> int:
        return sum(n for _, n in self.fleet)

    def as_dict(self) -> dict:
        return {"target": self.target, "unit": self.unit, "usd_per_hour": self.usd_per_hour,
                "expected_throughput": self.expected_throughput, "nominal_throughput": self.nominal_throughput,
                "instances": self.instances, "gpus": sum(c.offer.gpu_count * n for c, n in self.fleet),
                "proven_optimal": self.proven_optimal, "search_seconds": self.search_seconds,
                "candidates": self.candidates, "types_searched": self.types_searched,
                "prediction": self.prediction.as_dict() if self.prediction else None, "rounds": self.rounds,
                "fleet": [{**c.as_dict(), "count": n, "usd_per_hour": c.usd_per_hour * n,
                           "expected_throughput": c.expected_throughput * n} for c, n in self.fleet]}


def reduce(cands: list[Candidate], target: float) -> list[tuple[float, list[tuple[float, int, list[Candidate]]]]]:
    """Steps 1-3 of the module docstring: per type, (expected throughput, [(price, cap, offers), ...]
    cheapest first), the types cheapest per unit first."""
    merged: dict[tuple[float, float], list[Candidate]] = {}
    for c in sorted(cands, key=lambda c: c.name):
        if c.cap > 0 and c.expected_throughput > 0:
            merged.setdefault((c.usd_per_hour, c.expected_throughput), []).append(c)
    groups = [(p, g, sum(c.cap for c in members), members) for (p, g), members in merged.items()]
    covering = [(p, g) for p, g, cap, _ in groups if cap >= math.ceil(target / g - 1e-9)]
    kept = [t for t in groups if not any(p <= t[0] and g >= t[1] and (p, g) != (t[0], t[1]) for p, g in covering)]
    types: dict[float, list] = {}
    for p, g, cap, members in sorted(kept, key=lambda t: (t[0], t[3][0].name)):
        types.setdefault(g, []).append((p, cap, members))
    return sorted(types.items(), key=lambda t: (t[1][0][0] / t[0], t[1][0][2][0].name))


def activate(cands: list[Candidate], target: float, *, budget_usd_per_hour: float | None = None,
             max_nodes: int = 2_000_000) -> Activation | None:
    """The cheapest fleet of ``cands`` whose expected throughput is at least ``target`` (in the
    candidates' unit), within their caps and the budget; None when none is."""
    if not target > 0 or not math.isfinite(target):
        raise Echo2InputError(f"activation target {target} must be a finite number > 0")
    units = {c.unit for c in cands}
    if len(units) > 1:
        raise Echo2InputError(f"candidates mix throughput units {sorted(units)}")
    started = time.perf_counter()
    types = reduce(cands, target)
    need = target * (1 - 1e-9)  # sums of floats: a fleet exactly on target must count as meeting it
    found = cover_search([[(p, cap) for p, cap, _ in segments] for _, segments in types],
                         [([g for g, _ in types], need)], [sum(cap for _, cap, _ in segments) for _, segments in types],
                         budget=budget_usd_per_hour, max_nodes=max_nodes)
    seconds = time.perf_counter() - started
    if found is None:
        return None
    counts, _, _, cut = found
    fleet = []
    for (_, segments), n in zip(types, counts):
        for _, _, members in segments:  # the cheapest groups first, each offer up to its cap
            for c in members:
                take = min(n, c.cap)
                if take:
                    fleet.append((c, take))
                n -= take
    fleet.sort(key=lambda cn: (-cn[0].usd_per_hour * cn[1], cn[0].name))
    return Activation(target, cands[0].unit, fleet, not cut, seconds, len(cands), len(types))


def baseline(cands: list[Candidate], target: float) -> Activation | None:
    """The cheapest all-on-demand fleet of a single GPU type meeting ``target`` (see the module
    docstring), or None when no GPU type can."""
    by_gpu: dict[str, list[Candidate]] = {}
    for c in cands:
        if not c.spot:
            by_gpu.setdefault(c.gpu_type or c.offer.gpu, []).append(c)
    best = None
    for _, group in sorted(by_gpu.items()):
        fleet = activate(group, target)
        if fleet is not None and (best is None or fleet.usd_per_hour < best.usd_per_hour - 1e-12):
            best = fleet
    return best

