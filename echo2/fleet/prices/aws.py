"""Live AWS spot prices: EC2's ``describe_spot_price_history``, joined with the snapshot catalog.

EC2 answers per instance type and availability zone, and says nothing about GPUs; the snapshot
(``infra/prices/``) knows each instance type's GPUs and each region's on-demand price. So:

1. the instance types are the snapshot's AWS types (of the GPUs asked for), the regions those of
   the snapshot's AWS rows unless configured;
2. per region, one paginated call for all of them (``StartTime`` = now: the price in force in
   each zone), Linux only; the newest price per (type, zone) is kept, then the region's spot price
   is the minimum over its zones -- the rule the snapshot itself was built with (``infra/prices/
   README.md``), so live and snapshot figures compare;
3. each (type, region) becomes an ``Offer`` with the type's GPUs from the snapshot, the snapshot's
   on-demand price of that region (None where the snapshot has no row there) and the live spot
   price (None where AWS quoted none: the snapshot's spot figure is stale by definition and is
   never mixed in).

boto3 is imported only here (it is the dev/cloud extras' package, not a base dependency);
credentials come from the usual chain. Every failure is one ``Echo2InputError`` line naming the
region. Tests run it against moto, whose spot prices are a fixed stub: they check the parsing and
the join, not the figures.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from echo2.errors import Echo2InputError
from echo2.fleet.prices.base import PriceSourceUnavailable, select
from echo2.fleet.prices.catalog import DEFAULT_CATALOG, Offer, load_catalog

TYPES_PER_CALL = 50
"""Instance types per request: a bounded filter list (the GPU types of the snapshot are ~36)."""


def parse_price_history(rows: list[dict]) -> dict[str, tuple[float, str]]:
    """``SpotPriceHistory`` entries of one region -> {instance type: (min over zones of each zone's
    newest price, that zone)}. Unparseable, non-positive or non-Linux entries are skipped."""
    newest: dict[tuple[str, str], tuple[str, float]] = {}
    for row in rows:
        if not str(row.get("ProductDescription", "Linux/UNIX")).startswith("Linux/UNIX"):
            continue
        try:
            price = float(row["SpotPrice"])
            key = (str(row["InstanceType"]), str(row["AvailabilityZone"]))
        except (KeyError, TypeError, ValueError):
            continue
        if not price > 0:
            continue
        stamp = row.get("Timestamp")
        stamp = stamp.isoformat() if hasattr(stamp, "isoformat") else str(stamp or "")
        if key not in newest or stamp > newest[key][0]:
            newest[key] = (stamp, price)
    best: dict[str, tuple[float, str]] = {}
    for (itype, zone), (_, price) in sorted(newest.items()):
        if itype not in best or price < best[itype][0]:
            best[itype] = (price, zone)
    return best


class AwsSpotPrices:
    """Spot prices asked of EC2 now; GPUs and on-demand prices from the snapshot catalog."""

    name = "aws"

    def __init__(self, regions: list[str] | None = None, endpoint_url: str | None = None,
                 catalog: str | Path | None = None, client_factory=None):
        self.regions = list(regions) if regions else None
        self.endpoint_url = endpoint_url
        self.catalog = Path(catalog) if catalog else DEFAULT_CATALOG
        self.client_factory = client_factory or self._client
        self.asked_at: str | None = None
        self.zones: dict[str, str] = {}
        """Offer name -> the zone whose price is the region's minimum (for the JSON output)."""

    def _client(self, region: str):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise PriceSourceUnavailable("the aws price source needs boto3: pip install boto3 "
                                         "(or the project's dev/cloud extra)") from None
        return boto3.session.Session().client(
            "ec2", region_name=region, endpoint_url=self.endpoint_url,
            config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 3, "mode": "standard"}))

    def spot_prices(self, region: str, instance_types: list[str]) -> dict[str, tuple[float, str]]:
        """{instance type: (spot $/h, zone)} in ``region`` now (see ``parse_price_history``)."""
        try:
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError:
            raise PriceSourceUnavailable("the aws price source needs boto3: pip install boto3") from None
        client = self.client_factory(region)
        rows: list[dict] = []
        now = datetime.now(timezone.utc)
        try:
            pages = client.get_paginator("describe_spot_price_history")
            for i in range(0, len(instance_types), TYPES_PER_CALL):
                for page in pages.paginate(InstanceTypes=instance_types[i:i + TYPES_PER_CALL], StartTime=now,
                                           ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"]):
                    rows.extend(page.get("SpotPriceHistory", []))
        except (BotoCoreError, ClientError) as exc:
            raise Echo2InputError(f"aws spot prices in {region}: {str(exc).splitlines()[0]}") from None
        return parse_price_history(rows)

    def offers(self, gpus: list[str] | None = None, spot: bool | None = None) -> list[Offer]:
        snapshot = select([o for o in load_catalog(self.catalog, spot=None) if o.provider == "aws"], gpus)
        if not snapshot:
            raise Echo2InputError(f"the snapshot {self.catalog.name} has no AWS instance type"
                                  + (f" with {', '.join(gpus)}" if gpus else "") + " to ask spot prices for")
        meta = {o.instance_type: o for o in sorted(snapshot, key=lambda o: o.name)}
        on_demand = {(o.instance_type, o.region): o.on_demand_usd_per_hour for o in snapshot}
        regions = self.regions or sorted({o.region for o in snapshot})
        self.asked_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        live: dict[tuple[str, str], float] = {}
        for region in regions:
            for itype, (price, zone) in self.spot_prices(region, sorted(meta)).items():
                if itype in meta:  # a type the snapshot does not describe has no GPUs to plan with
                    live[(itype, region)] = price
                    self.zones[f"aws/{itype}@{region}"] = zone
        pairs = set(live) | {k for k in on_demand if k[1] in regions}
        out = []
        for itype, region in sorted(pairs):
            m = meta[itype]
            out.append(Offer("aws", itype, m.gpu, m.gpu_count, m.gpu_memory_gib, region,
                             on_demand.get((itype, region)), live.get((itype, region))))
        return select(out, None, spot)

    def describe(self) -> dict:
        regions = f"{len(self.regions)} region(s)" if self.regions else "the snapshot's AWS regions"
        return {"source": self.name, "date": self.asked_at,
                "detail": f"EC2 describe_spot_price_history now, {regions}"
                          + (f" at {self.endpoint_url}" if self.endpoint_url else "")
                          + f"; GPUs and on-demand prices from {self.catalog.name}"}
