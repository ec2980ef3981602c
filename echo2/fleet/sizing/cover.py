"""A generic bounded integer covering search: the cheapest counts of item types whose gains meet every cover.

Cost-aware activation (``activation.activate``: one cover, convex per-type costs) runs on it, and on that
``choose.choose_fleet`` stands, the one chooser of what is bought (``echo2 plan``, ``echo2 bench cost`` and the
live fleet with ``fleet.actors: auto``). The algorithm: depth-first branch and bound over the types. A node fixes
the counts of the first j types; it is pruned when its cost plus the largest of the covers' fractional (LP) bounds
(covering what each cover still needs with the remaining types) is no cheaper than the best found, or when it
breaks the budget. Whenever a node meets every cover it is checked with ``accept`` (when given): a pass becomes
the new best (adding items would only cost more); a miss lets the search go on adding items. Counts are tried
from the greedy cover downwards, so the first solution found is the greedy one and prunes most of the tree.
tests/e2e/test_activation.py checks it against brute force, with one cover and with two covers and an ``accept``.
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

    The search of the module docstring (``activation.activate`` gives one cover and nothing to
    verify). Types are branched in
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
