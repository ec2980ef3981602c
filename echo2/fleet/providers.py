"""What echo2 assumes about each cloud provider, in one table: the name SkyPilot knows it by, how often its spot
(interruptible) instances are reclaimed (one by one, and in correlated bursts: ``spot_bursts_per_hour``,
``spot_burst_share``, ``BURST_SOURCE``), how many instances of one offer a run may count on, how a reclaim is told
from a crash, and what moving a GB out of, into and within it costs.

Every figure is a planning assumption with its source beside it (``ProviderFacts.source``); the run's own ledger
replaces the reclaim rate once it has measured one (``sizing/activation.py``), and ``echo2 plan --workload`` lists
which of these its answer used. A provider missing from the table gets ``DEFAULT``'s figures, said as such.

Transfer prices are list prices of the first paid tier, per GB as each provider bills it, without the free
allowances (AWS and Azure: the first 100 GB a month) or volume discounts; the egress sources were checked on
2026-12-03 (the provider's own page where one was found, else a dated third-party summary, named in ``source``).
A marketplace bills bandwidth at both ends and between its own hosts (``ingress_usd_per_gb``,
``intraregion_usd_per_gb``); a hyperscaler bills neither.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ProviderFacts:
    name: str
    skypilot_cloud: str | None
    """SkyPilot's cloud name (``sky/clouds/``), None where SkyPilot 0.14 cannot launch there."""
    spot_reclaims_per_hour: float
    """Reclaims per spot instance-hour (on-demand: 0, hardware failures ignored)."""
    cap: int
    """Instances of one (instance type, region, market) a plan may buy."""
    reclaim_detector: str | None
    """How an ended instance is told a reclaim or a crash (``backends/reclaims.py``): "aws" (EC2 state reason and
    spot request status), "gcp" (preemption operations), None (a vanished spot instance counts as reclaimed)."""
    egress_usd_per_gb: float
    """Data leaving the provider to the internet (another cloud, a home machine), the first price tier."""
    interregion_usd_per_gb: float
    """Data between two regions of the provider."""
    source: str
    ingress_usd_per_gb: float = 0.0
    """Data arriving at one of its machines (free on every hyperscaler; a marketplace host may bill downloads)."""
    intraregion_usd_per_gb: float = 0.0
    """Data between two of its machines in one region (free on hyperscalers within a zone or region as echo2 places
    actors; a marketplace's machines are separate hosts, each billing its bandwidth)."""
    spot_bursts_per_hour: float = 0.05
    """Correlated reclaims: how often the provider takes a share of a run's spot actors at once (``BURST_SOURCE``)."""
    spot_burst_share: float = 0.25
    """The share of the run's spot actors at that provider one burst takes."""


_HYPERSCALER_RECLAIM = ("0.1 reclaims per spot instance-hour: deliberately pessimistic beside AWS's Spot Instance "
                        "Advisor (<5% ... >20% of instances interrupted per month, < 0.001/h) because GPU spot pools "
                        "are reclaimed in bursts (ECHO-2's pool saw up to 40% bursty reclaim)")
_MARKETPLACE_RECLAIM = "0.2 reclaims per interruptible instance-hour: marketplace capacity (an assumption)"
BURST_SOURCE = ("bursts: an assumption, 0.05 an hour (one per 20 h) taking 25% of a provider's spot actors (0.1 an "
                "hour on marketplaces); no provider publishes burst statistics (AWS's Spot Instance Advisor gives "
                "monthly interruption buckets per instance type only); GPU spot capacity is reclaimed per pool, so "
                "instances of one offer go together; ECHO-2's launch article reports up to 40% of its spot pool "
                "reclaimed in bursts (`echo2 plan` prints that as a scenario)")
_CAP8 = "cap 8 per (instance type, region, market): an assumption standing in for regional capacity and quotas"
_UNCHECKED_EGRESS = "egress: AWS's list price assumed, this provider's own was not checked"
_VAST_BANDWIDTH = 0.02

PROVIDERS: dict[str, ProviderFacts] = {p.name: p for p in [
    ProviderFacts("aws", "aws", 0.1, 8, "aws", 0.09, 0.02,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: aws.amazon.com/ec2/pricing/on-demand (data transfer out "
                  "to the internet, up to 10 TB/month $0.09/GB after the first 100 GB; between regions $0.02/GB), "
                  "checked 2026-12-03 against wring.co/blog/aws-data-transfer-pricing-guide (2026: $0.09/GB up to "
                  "10 TB, cross-region $0.02/GB, ingress free)"),
    ProviderFacts("gcp", "gcp", 0.1, 8, "gcp", 0.12, 0.02,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: cloud.google.com/vpc/network-pricing (premium tier "
                  "internet egress to North America, 1 GiB-1 TiB a month, $0.12/GiB; between regions within North "
                  "America $0.02/GiB), checked 2026-12-03 against egresscost.com/gcp/regions (2026-04: $0.12 premium, "
                  "$0.085 standard tier, the same from every source region) and brainagents.ai's GCP egress guide "
                  "(same continent $0.01-0.02)"),
    ProviderFacts("azure", "azure", 0.1, 8, None, 0.087, 0.02,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: azure.microsoft.com/pricing/details/bandwidth "
                  "(internet egress after the first 100 GB, up to 10 TB, $0.087/GB; inter-region within North America "
                  "$0.02/GB), checked 2026-12-03 against c3x.dev/blog/azure-egress-bandwidth-cost (~$0.087/GB) and "
                  "lucidity.cloud's Azure egress guide (within North America or Europe $0.02/GB)"),
    ProviderFacts("lambda", "lambda", 0.1, 8, None, 0.0, 0.0,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: docs.lambda.ai/public-cloud/billing (billed resources "
                  "are instances, clusters and filesystems; \"you are not charged for ingress or egress\"), checked "
                  "2026-12-03; a third-party blog (promptcost.org, 2026-04) claims $0.09/GB past 1 TB a month, which "
                  "the provider's own page does not say"),
    ProviderFacts("runpod", "runpod", 0.2, 8, None, 0.0, 0.0, spot_bursts_per_hour=0.1, source=
                  f"{_MARKETPLACE_RECLAIM}; {_CAP8}; egress: docs.runpod.io/accounts-billing/billing (\"all compute "
                  "and storage charges are billed per second, with no fees for data transfer\"), checked 2026-12-03"),
    ProviderFacts("vast", "vast", 0.2, 2, None, _VAST_BANDWIDTH, _VAST_BANDWIDTH,
                  f"{_MARKETPLACE_RECLAIM}; cap 2: SkyPilot's vast catalog (sky/catalog/data_fetchers/fetch_vast.py) "
                  "writes a row only where at least two marketplace hosts offered that machine; bandwidth: "
                  "docs.vast.ai/documentation/instances/pricing (a rental's cost is compute, storage and bandwidth, "
                  "each host sets its own prices; not in the price catalog), so $0.02/GB up and down, the figure "
                  "fast.ai's course docs quoted for vast (an old figure: an assumption), at every host: uploads, "
                  "downloads and host-to-host traffic alike", _VAST_BANDWIDTH, _VAST_BANDWIDTH,
                  spot_bursts_per_hour=0.1),
    ProviderFacts("nebius", "nebius", 0.1, 8, None, 0.0, 0.0,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: nebius.com/prices (outgoing traffic not billed); not "
                  "confirmed on 2026-12-03: the provider's compute terms (docs.nebius.com/legal/specific-terms/compute "
                  "2.5) name outgoing traffic among the service's items, and no stored page gave its price"),
    ProviderFacts("shadeform", "shadeform", 0.1, 8, None, 0.0, 0.0,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: a broker of other clouds' machines; 0 assumed, "
                  "not checked"),
    ProviderFacts("verda", "verda", 0.1, 8, None, 0.0, 0.0,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: 0 assumed, not checked"),
]}

DEFAULT = ProviderFacts("*", None, 0.1, 8, None, 0.09, 0.02,
                        f"{_HYPERSCALER_RECLAIM}; {_CAP8}; {_UNCHECKED_EGRESS}")

SKYPILOT_CLOUDS = ("aws", "azure", "cudo", "do", "fluidstack", "gcp", "hyperbolic", "ibm", "lambda", "mithril",
                   "nebius", "oci", "paperspace", "primeintellect", "runpod", "scp", "seeweb", "shadeform", "vast",
                   "verda", "yotta")
"""Price-catalog provider names SkyPilot 0.14 has a cloud for (``sky/clouds/``); the backend asks
``sky.enabled_clouds()`` which of them this machine's credentials reach."""


def facts(provider: str) -> ProviderFacts:
    """The table's row for ``provider`` (any case), or ``DEFAULT``'s figures under that name."""
    key = provider.lower()
    if key in PROVIDERS:
        return PROVIDERS[key]
    return replace(DEFAULT, name=key, skypilot_cloud=key if key in SKYPILOT_CLOUDS else None)


def transfer_usd_per_gb(src_provider: str, src_region: str, dst_provider: str, dst_region: str) -> float:
    """What moving one GB from a machine in (provider, region) to one in another costs, both ends together: the
    sender pays its intra-region price within a region (0 on hyperscalers), its inter-region price between two of
    its regions, its internet egress price across providers; the receiver pays its ingress price (0 on
    hyperscalers)."""
    src, dst = facts(src_provider), facts(dst_provider)
    if src_provider.lower() == dst_provider.lower():
        sent = src.intraregion_usd_per_gb if src_region == dst_region else src.interregion_usd_per_gb
    else:
        sent = src.egress_usd_per_gb
    return sent + dst.ingress_usd_per_gb
