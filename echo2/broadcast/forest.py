"""The bandwidth-aware relay forest: fast peers near the roots with more children, slow ones at the leaves.

``topology.plan`` calls ``rated_forest`` when the learner has the peers' rates (the publisher always has
them, from the peer records: ``topology.relay_plan``); without rates the plan is the rotating hash order of
``topology.parent_index``. The learner signs the result into the manifest with every peer's ``parent``
written out, so actors never recompute it: every actor reads the same forest from the signed manifest
(``topology.source_peers``), whatever float arithmetic its machine does.

The model. A version moves through the forest as a pipeline of chunks, so what bounds a subtree is the
slowest link on its path to a root, a link carrying its parent's uplink split among the parent's children.
The rule, per site (one forest per provider and region, ``topology``'s sites):

* a peer's *rate* is what the caller gives (the learner: the uplink the peer reports, no more than the
  downlink it reports, since a node cannot forward faster than it receives: ``topology.planning_rate``),
  rounded down to a half-octave (a power of sqrt 2) so that noise in measurements does not reorder peers of
  about the same speed: within a half-octave the hash order of the version decides, and still rotates roots
  and inner nodes from version to version (between half-octaves it does not: the fast peers relay every
  version, which is what their uplinks are for);
* unknown rates (a new actor, an actor that measured nothing yet, a record with an invalid rate) count as
  the median of the known ones, over all planned peers; a claim counts at most ``RATE_SPREAD`` x that
  median; with no known rate at all every peer counts the same;
* peers are laid out fastest first; the site's first ``site_roots`` peers are its roots (they read the
  store), and each later peer, in that order, gets as parent the earliest peer with a child slot left,
  breadth first;
* children in proportion to the rate: a peer has ``c = floor(rate / L)`` slots (at most ``MAX_CHILDREN``,
  or ``fanout`` where that is more), so every link carries at least ``L``, and ``L`` is the fastest link
  rate at which the slots carry every peer of the site, but no faster than the fastest rate over
  ``fanout``: the fastest peer has at least ``fanout`` children. Uniform rates give every peer ``fanout``
  slots, the forest of ``parent_index`` node for node; on uneven ones the slow peers get no slot as long
  as the fast ones can carry them, and sit at the leaves. This maximises the slowest link over the forests
  laid out fastest first (a pipeline moves a version at about its slowest link), and with it the depth is
  what the slots make it: on the issue's mix (uplinks 25/100/200/1000 Mbit/s cycled over 16 peers) the four
  1000 Mbit/s peers carry four children each at 250 Mbit/s, two levels deep.

Latency (``latency_fanout``): where the learner knows the round trip between its peers and the version's
size (``topology.plan``'s ``rtt_s``, ``version_bytes``, ``chunk_bytes``; none of them is measured by the relay
yet, so only a caller that declares them, the benchmark, gets this), the fan-out is at least the one a model
of the pipeline finds fastest. With ``N`` peers of uplink ``B``, a version of ``S`` bytes in chunks of ``c``,
and a one-way delay ``d``: a forest of fan-out ``f`` (every parent ``f`` children, so every link carries
``B / f``) has ``D_f`` levels (the least ``D`` with ``1 + f + ... + f^(D-1) >= N``), and moves the version in
about ``T(f) = f S / B + D_f (d + f c / B)``: the last peer's link rate for the whole version, plus, per level,
one chunk at that rate and the delay (each level sends a chunk on only once it has it all, verified). A chain
(``f = 1``) pays the delay ``N`` times, a fan-out of 2 about ``log2 N`` times but halves every link: fan-out 2
wins only where ``N (d + c/B) - D_2 (d + 2c/B)`` exceeds ``S / B``: small versions (a sparse delta) or long
round trips over many peers. At 64 MB over 200 Mbit/s links to 8 peers with 1 MB chunks and an 80 ms round trip
the chain's 3.34 s beats fan-out 2's 5.86 s; at 4 MB, 0.25 MB chunks and 200 ms, fan-out 2 (0.82 s) beats the
chain (1.05 s). ``B`` is the median planning rate (the rates are uniform where this matters most); ties go to
the smaller fan-out. The plan stays deterministic: the learner writes every parent into the signed manifest.

Untrusted claims. Rates are what actors say they measured; a liar can claim 100 Gbit/s. What bounds it: a
claim above ``RATE_SPREAD`` x the median counts as that; a claim never makes its peer a root unless it was
put to the test (``measured``: the learner passes the peers that were a parent in a signed plan of the last
``REPORT_VERSIONS`` versions, ``relayed_lately``; a reported one is demoted, below): the roots are chosen
with every other claim counted at most at the median, so a liar is never its site's only root by its claim,
and its children fall back to an honest root, not all to the store; below the roots every claim counts (a
fast new peer gets children, and with them its test); no parent gets more than ``MAX_CHILDREN`` children
(or ``fanout``), so a liar holds at most that many; those children report it (``failed_parents``,
``topology``); ``QUORUM`` reporters take it out of the plan, and a single report *demotes* it (``demoted``,
which ``topology.relay_plan`` fills only with reports whose reporter had the reported peer among its sources
in the signed plan of the version reported, so a report of a peer one never fetched from demotes nobody):
a demoted peer's own claim never counts; it is planned at the slowest rate of its site's other peers and
goes behind them, at the leaves (where no other rate in its site is known, at the median like every peer
there: its hash place). So a failed peer's claim gives it children at most once per ``REPORT_VERSIONS``
versions. What a lone liar can do to others: claim a high rate (one version as a parent of at most
``MAX_CHILDREN`` children, held once), or report its own parent and ancestors (they go to the leaves for
``REPORT_VERSIONS`` versions): it costs speed, never a byte's correctness (every chunk is checked against
the signed manifest).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection

RATE_SPREAD = 16.0
"""A claimed rate counts at most this many times the median known rate of the plan."""
MAX_CHILDREN = 8
"""No parent gets more children than this (or ``fanout`` where that is more), whatever its rate."""


MAX_LATENCY_FANOUT = 4
"""The most children the latency model gives a peer (``latency_fanout``)."""


def levels(n: int, fanout: int) -> int:
    """Levels of a forest of one root and ``fanout`` children per parent holding ``n`` peers."""
    if fanout <= 1:
        return n
    depth, held, width = 0, 0, 1
    while held < n:
        held, width, depth = held + width, width * fanout, depth + 1
    return depth


def pipeline_s(n: int, fanout: int, *, version_bytes: int, chunk_bytes: int, rate_mbit: float,
               one_way_s: float) -> float:
    """The model's time for a version through a forest of ``fanout`` (module docstring: ``T(f)``)."""
    link = rate_mbit * 1e6 / 8 / fanout  # bytes/s each link carries
    return version_bytes / link + levels(n, fanout) * (one_way_s + chunk_bytes / link)


def latency_fanout(n: int, *, version_bytes: int, chunk_bytes: int, rate_mbit: float, rtt_s: float,
                   most: int = MAX_LATENCY_FANOUT) -> int:
    """The fan-out in 1..``most`` with the least ``pipeline_s`` (ties: the smaller)."""
    if n <= 1 or rate_mbit <= 0 or version_bytes <= 0:
        return 1
    times = {f: pipeline_s(n, f, version_bytes=version_bytes, chunk_bytes=min(chunk_bytes, version_bytes),
                           rate_mbit=rate_mbit, one_way_s=max(0.0, rtt_s) / 2) for f in range(1, most + 1)}
    return min(times, key=lambda f: (times[f], f))


def half_octave(rate: float) -> float:
    """``rate`` rounded down to a power of sqrt(2): measurements a few percent apart plan alike."""
    return 2.0 ** (math.floor(2 * math.log2(rate)) / 2)


def _claim(rates: dict[str, float | None], peer: str, max_rate: float) -> float | None:
    r = rates.get(peer)
    ok = isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
    return half_octave(min(float(r), max_rate)) if ok else None


def _median_claim(ids: list[str], rates: dict[str, float | None], demoted: Collection[str],
                  max_rate: float) -> float | None:
    """The median of the known claims (capped, half-octaves) of the peers not demoted; None if none is known."""
    known = [r for i in ids if i not in demoted and (r := _claim(rates, i, max_rate)) is not None]
    return statistics.median_low(sorted(known)) if known else None


def planning_rates(ids: list[str], rates: dict[str, float | None], demoted: Collection[str],
                   site: dict[str, str] | None, max_rate: float) -> tuple[dict[str, float], set[str]]:
    """The rate each peer is planned with (module docstring): capped, half-octaves, the median for the
    unknown, the site's slowest for the demoted; 1.0 for every peer where no rate is known. Also the peers
    demoted in effect: those of ``demoted`` in a site where some other peer's rate is known."""
    where = site or {}
    known = {i: r for i in ids if i not in demoted and (r := _claim(rates, i, max_rate)) is not None}
    median = _median_claim(ids, rates, demoted, max_rate)
    if median is None:
        return {i: 1.0 for i in ids}, set()
    out = {i: min(r, RATE_SPREAD * median) if i not in demoted and (r := _claim(rates, i, max_rate)) is not None
           else median for i in ids}  # a demoted peer's claim counts for nothing
    rated_sites = {where.get(i, "") for i in known}
    effective = {i for i in demoted if i in out and where.get(i, "") in rated_sites}
    for i in effective:
        out[i] = min(out[j] for j in ids if j not in demoted and where.get(j, "") == where.get(i, ""))
    return out, effective


def _fill(ids: list[str], slots: list[int], roots: int) -> list[tuple[str, str | None]] | None:
    """Breadth first: each non-root peer's parent is the earliest peer before it with a slot left; None
    when some peer finds none (the slots before it are too few)."""
    out: list[tuple[str, str | None]] = []
    left, p = list(slots), 0
    for k, peer in enumerate(ids):
        if k < roots:
            out.append((peer, None))
            continue
        while p < k and left[p] == 0:
            p += 1
        if p == k:
            return None
        left[p] -= 1
        out.append((peer, ids[p]))
    return out


def layout_site(ids: list[str], rate: dict[str, float], demoted: Collection[str], *, fanout: int,
                roots: int, root_rate: dict[str, float] | None = None) -> list[tuple[str, str | None]]:
    """(peer, parent) of one site's forest, fastest first (module docstring); parent None = a root.
    ``root_rate``: the rates the roots are chosen by, where they differ from ``rate`` (the claims not measured
    yet count at most the median: module docstring)."""
    hashed, ids = ids, sorted(ids, key=lambda i: (-rate[i], i in demoted))  # stable: the hash order breaks ties
    if not ids:
        return []
    if root_rate is not None:
        first = sorted(hashed, key=lambda i: (-root_rate[i], i in demoted))[:roots]
        ids = first + [i for i in ids if i not in first]
    most = max(fanout, MAX_CHILDREN)
    top = max(rate[i] for i in ids) / fanout
    links = sorted({r / c for r in {rate[i] for i in ids} for c in range(1, most + 1) if r / c <= top} | {top},
                   reverse=True)
    for link in links:  # the fastest link rate every peer can be carried at
        slots = [0 if i in demoted else min(most, math.floor(rate[i] / link + 1e-9)) for i in ids]
        if (out := _fill(ids, slots, roots)) is not None:
            return out
    return _fill(ids, [max(1, math.floor(rate[i] / links[-1] + 1e-9)) for i in ids], roots) or []


def rated_forest(live: dict[str, str], ids: list[str], *, fanout: int, roots: int, site: dict[str, str] | None,
                 site_roots: dict[str, int] | None, rates: dict[str, float | None], demoted: Collection[str],
                 max_rate: float, latency: tuple[int, int, float] | None = None,
                 measured: Collection[str] | None = None) -> dict:
    """The relay section with explicit parents (``shape: parents``); ``ids`` in the version's hash order,
    ``site`` peer -> site name (None: one forest), ``site_roots`` roots per site. Each peer entry carries
    ``parent`` (None for a root) and, where its rate is known, ``up_mbit``: the rate it was planned by as
    reported (``topology.planning_rate``: its uplink, no more than its downlink), neither capped by the
    median nor rounded, which its children hold it to, shared among them (``receiver.py``). ``latency``:
    (version bytes, chunk bytes, round trip in s) where known: the fan-out is at least ``latency_fanout``'s for
    the largest site, at the median planning rate (module docstring). ``measured``: the peers whose claims
    their children have put to the test (``relayed_lately``); the roots are chosen with every other
    claim counted at most at the median (None: every claim counts, as where the caller knows the rates)."""
    asked = {i for i in demoted if i in live}
    rate, demoted = planning_rates(ids, rates, asked, site, max_rate)
    root_rate = None
    if measured is not None and (median := _median_claim(ids, rates, asked, max_rate)) is not None:
        root_rate = {i: rate[i] if i in measured else min(rate[i], median) for i in ids}
    known = [r for i in ids if _claim(rates, i, max_rate) is not None and (r := rate[i]) > 0]
    if latency is not None and known:
        largest = max(sum(1 for i in ids if (site or {}).get(i, "") == s) for s in {(site or {}).get(i, "")
                                                                                     for i in ids})
        version_bytes, chunk_bytes, rtt_s = latency
        fanout = max(fanout, latency_fanout(largest, version_bytes=version_bytes, chunk_bytes=chunk_bytes,
                                            rate_mbit=statistics.median_low(sorted(known)), rtt_s=rtt_s))
    groups = sorted(set(site.values())) if site is not None else [""]
    peers = []
    for name in groups:
        members = [i for i in ids if site is None or site[i] == name]
        n_roots = roots if site_roots is None else site_roots[name]
        for peer, parent in layout_site(members, rate, demoted, fanout=fanout, roots=n_roots, root_rate=root_rate):
            entry = {"id": peer, "url": live[peer], "parent": parent}
            if site is not None:
                entry["site"] = name
            if (up := rates.get(peer)) is not None and _claim(rates, peer, max_rate) is not None:
                entry["up_mbit"] = min(float(up), max_rate)  # as reported: what its children hold it to
            peers.append(entry)
    relay: dict = {"fanout": fanout, "roots": roots, "shape": "parents"}
    if site_roots is not None:
        relay["site_roots"] = site_roots
    relay["peers"] = peers
    return relay


def relayed_lately(plans: Callable[[int], dict | None], version: int, versions: int) -> set[str]:
    """The peers named as a parent in the signed plan of one of the ``versions`` versions before ``version``:
    their claims were put to the test by children that would have reported them (a parent too slow for its
    child's need is reported too, ``fetcher.py``). ``plans(version)``: that plan's relay section, None when
    unknown; a plan without explicit parents (before rates) names none."""
    out: set[str] = set()
    for v in range(max(0, version - versions), version):
        relay = plans(v)
        if isinstance(relay, dict) and relay.get("shape") == "parents" and isinstance(relay.get("peers"), list):
            out |= {p["parent"] for p in relay["peers"] if isinstance(p, dict) and isinstance(p.get("parent"), str)}
    return out
