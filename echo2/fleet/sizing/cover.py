"""A generic bounded integer covering search: the cheapest counts of item types whose gains meet every cover.

Shared by cost-aware activation (``activation.activate``: one cover, convex per-type costs), on which
``choose.choose_fleet`` stands, the one chooser of what is bought (``echo2 plan``, ``echo2 bench cost`` and the
live fleet with ``fleet.actors: auto``), and ``plan.cheapest_mix`` (two covers, throughput and freshness, then
the capacity model's check as ``accept``). The algorithm (depth-first
branch and bound, counts tried from the greedy cover downwards, pruned by each cover's fractional bound) is
described in ``plan.py``'s module docstring; tests/test_plan.py and tests/test_activation.py check it against
brute force.
"""

from __future__ import annotations

import math

MAX_NODES = 200_000


def cover_search(prices: list, covers: list[tuple[list[float], float]], caps: list[int], *,
                 budget: float | None = None, accept=None, max_nodes: int = MAX_NODES):
    """Branch and bound for integer covering: the counts 0 <= c_j <= caps[j] of least total
    price sum c_j prices[j] (within ``budget``) such that every cover (gains, need) holds,
    sum c_j gains[j] >= need, and ``accept(counts)`` (when given) returns something not None.

    A price is a number, or a list of (unit price, units) segments: type j's units then cost
    the cheapest first (a convex cost), which is how offers of equal throughput and different
    prices collapse into one type (activation); the fractional bound takes the segments apart.

    The search of the module docstring, shared by ``cheapest_mix`` (two covers and predict as
    ``accept``) and ``activation.activate`` (one cover, nothing to verify). Types are branched in
    the order given (put the cheapest per unit of the first cover first: the greedy fleet found
    first then prunes most of the tree); each cover's fractional bound takes its types cheapest
    per unit of that cover first. Returns (counts, cost, what accept returned, cut) or None;
    ``cut`` says the search stopped at ``max_nodes`` nodes, so the result may not be optimal."""
    n = len(prices)
    segments = [[(p, caps[i])] if isinstance(p, (int, float)) else sorted(p) for i, p in enumerate(prices)]
    cum = []  # cum[j][c]: the price of c units of type j
    for j, p in enumerate(prices):
        if isinstance(p, (int, float)):
            cum.append([c * p for c in range(caps[j] + 1)])
            continue
        row = [0.0]
        for unit, units in segments[j]:
            for _ in range(units):
                row.append(row[-1] + unit)
        cum.append(row[:caps[j] + 1])
    orders = [sorted(((i, unit, units) for i in range(n) if gains[i] > 0 for unit, units in segments[i]),
                     key=lambda t, g=gains: t[1] / g[t[0]]) for gains, _ in covers]
    # a fleet costing exactly the budget is within it (costs are compared with a 1e-9 margin below)
    state = {"cost": budget * (1 + 1e-12) + 1e-9 if budget is not None else math.inf,
             "best": None, "nodes": 0, "cut": False}

    def cover_bound(order, gain: list[float], rem: float) -> float:
        cost = 0.0
        for i, unit, units in order:  # fractional cover, cheapest per unit first
            if rem <= 1e-12:
                break
            take = min(units * gain[i], rem)
            cost += take * unit / gain[i]
            rem -= take
        return cost if rem <= 1e-12 else math.inf

    counts = [0] * n

    def dfs(j: int, cost: float, got: list[float]) -> None:
        state["nodes"] += 1
        if cost >= state["cost"] - 1e-9 or state["nodes"] > max_nodes:
            state["cut"] |= state["nodes"] > max_nodes
            return
        if all(g >= need for g, (_, need) in zip(got, covers)):
            verdict = accept(counts) if accept is not None else True
            if verdict is not None:  # any fleet below this node costs more
                state["cost"], state["best"] = cost, (list(counts), cost, verdict)
                return
        if j == n:
            return
        bound = max(cover_bound([t for t in order if t[0] >= j], gains, need - g)
                    for order, g, (gains, need) in zip(orders, got, covers))
        if cost + bound >= state["cost"] - 1e-9:
            return
        greedy = 0
        for g, (gains, need) in zip(got, covers):
            if gains[j] > 0:
                greedy = max(greedy, math.ceil(max(0.0, need - g) / gains[j] - 1e-12))
        greedy = min(caps[j], greedy)
        for c in [*range(greedy, -1, -1), *range(greedy + 1, caps[j] + 1)]:
            if c > greedy and cost + cum[j][c] >= state["cost"] - 1e-9:
                break
            counts[j] = c
            dfs(j + 1, cost + cum[j][c], [g + c * gains[j] for g, (gains, _) in zip(got, covers)])
        counts[j] = 0

    dfs(0, 0.0, [0.0] * len(covers))
    if state["best"] is None:
        return None
    best, cost, verdict = state["best"]
    return best, cost, verdict, state["cut"]
