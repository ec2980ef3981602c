"""What moving one policy version to the fleet costs in data transfer, with and without the relay.

Model (``traffic_per_version``): a version of ``version_bytes`` lives in the object store at (provider, region);
the actors are groups of (provider, region, count). Every actor must receive the whole version once.

* without the relay (``broadcast.mode: store``) every actor reads it from the store;
* with the relay and region-aware roots (``broadcast/topology.py``'s plan), each (provider, region) that holds
  actors gets one root that reads the store; every other actor there reads it from a peer in the same provider
  and region. So one copy crosses into each region, and peer traffic never leaves a region.

Each transfer is priced by ``echo2.fleet.providers.transfer_usd_per_gb``, both ends together: the sender's price
(nothing within a hyperscaler's region, its inter-region price between its own regions, its internet egress price
across providers) plus the receiver's ingress price (0 on hyperscalers; a marketplace such as vast bills its hosts'
downloads, uploads and host-to-host traffic, so there a peer's copy costs too). Assumptions:

* a GB is 10**9 bytes (providers bill per GB; where a bill means 2**30 bytes this overstates by 7%);
* the first price tier, no free allowances (AWS's first 100 GB a month, Azure's first 100 GB), no committed-use
  discounts, no per-request charges of the store (GET requests: cents per million);
* no retries and no failed parents: a parent the plan drops sends its children to the store (``topology.py``),
  which costs what the store-only row does for those actors;
* the relay is not always cheaper: from a store that bills no egress to marketplace hosts that bill both ends, a
  peer's copy (billed at two hosts) costs more than the store's (billed at one); the model says so rather than
  assume it;
* a relay root could instead be fed from a root in another region of its own provider at the inter-region price,
  cheaper than a second copy over the internet; echo2's plan does not do that, so neither does this model.

The bytes of one version come from ``planner/dissemination.py`` (``version_bytes``); a run's traffic is this
times its number of versions.
"""

from __future__ import annotations

import math

from echo2.errors import Echo2InputError
from echo2.fleet.providers import transfer_usd_per_gb

GB = 1e9


def _groups(actors: list[tuple[str, str, int]]) -> dict[tuple[str, str], int]:
    """Actors merged per (provider, region): provider names in lower case, groups of zero actors dropped."""
    groups: dict[tuple[str, str], int] = {}
    for item in actors:
        if not (isinstance(item, (tuple, list)) and len(item) == 3):
            raise Echo2InputError(f"an actor group must be (provider, region, count), got {item!r:.80}")
        provider, region, count = item
        if not (isinstance(provider, str) and provider and isinstance(region, str)):
            raise Echo2InputError(f"an actor group needs a provider and a region name, got {item!r:.80}")
        if not (isinstance(count, int) and not isinstance(count, bool) and count >= 0):
            raise Echo2InputError(f"an actor group's count must be an integer >= 0, got {count!r:.40}")
        if count:
            key = (provider.lower(), region)
            groups[key] = groups.get(key, 0) + count
    return groups


def traffic_per_version(version_bytes: float, actors: list[tuple[str, str, int]], store: tuple[str, str], *,
                        relay: bool) -> dict:
    """Bytes and dollars of getting one version of ``version_bytes`` to every actor (module docstring).

    Returns ``bytes_from_store`` (read from the store), ``bytes_between_peers`` (sent by peers),
    ``bytes_cross_provider`` and ``bytes_cross_region`` (of those, what crossed into another provider, or into
    another region of the same provider), ``usd``, and ``by_provider``: per actors' provider, ``actors``,
    ``bytes_from_store``, ``bytes_from_peers`` and ``usd`` (what getting the version to them cost, whoever bills
    it); ``roots``: how many actors read the store."""
    if not (isinstance(version_bytes, (int, float)) and math.isfinite(version_bytes) and version_bytes >= 0):
        raise Echo2InputError(f"version bytes must be a number >= 0, got {version_bytes!r:.40}")
    if not (isinstance(store, (tuple, list)) and len(store) == 2 and all(isinstance(x, str) for x in store)
            and store[0]):
        raise Echo2InputError(f"the store must be (provider, region), got {store!r:.80}")
    store_provider, store_region = store[0].lower(), store[1]
    out = {"bytes_from_store": 0.0, "bytes_between_peers": 0.0, "bytes_cross_provider": 0.0,
           "bytes_cross_region": 0.0, "usd": 0.0, "roots": 0, "by_provider": {}}
    for (provider, region), count in sorted(_groups(actors).items()):
        readers = 1 if relay else count
        from_store = readers * version_bytes
        from_peers = (count - readers) * version_bytes
        usd = from_store / GB * transfer_usd_per_gb(store_provider, store_region, provider, region)
        usd += from_peers / GB * transfer_usd_per_gb(provider, region, provider, region)
        out["bytes_from_store"] += from_store
        out["bytes_between_peers"] += from_peers
        if provider != store_provider:
            out["bytes_cross_provider"] += from_store
        elif region != store_region:
            out["bytes_cross_region"] += from_store
        out["usd"] += usd
        out["roots"] += readers
        row = out["by_provider"].setdefault(provider, {"actors": 0, "bytes_from_store": 0.0, "bytes_from_peers": 0.0,
                                                       "usd": 0.0})
        row["actors"] += count
        row["bytes_from_store"] += from_store
        row["bytes_from_peers"] += from_peers
        row["usd"] += usd
    return out


def traffic_per_run(version_bytes: float, versions: int, actors: list[tuple[str, str, int]],
                    store: tuple[str, str]) -> dict:
    """``{"relay": ..., "store_only": ..., "versions": n}``: ``traffic_per_version`` both ways, times ``versions``
    (bytes and dollars scale; ``roots`` and ``by_provider[...]["actors"]`` do not)."""
    if not (isinstance(versions, int) and versions >= 0):
        raise Echo2InputError(f"versions must be an integer >= 0, got {versions!r:.40}")
    result: dict = {"versions": versions}
    for key, relay in (("relay", True), ("store_only", False)):
        one = traffic_per_version(version_bytes, actors, store, relay=relay)
        scaled = {k: (v * versions if k.startswith(("bytes_", "usd")) else v) for k, v in one.items()
                  if k != "by_provider"}
        scaled["by_provider"] = {p: {k: (v * versions if k != "actors" else v) for k, v in row.items()}
                                 for p, row in one["by_provider"].items()}
        result[key] = scaled
    return result
