"""What echo2 assumes about each cloud provider, in one table: the name SkyPilot knows it by, how often its spot
(interruptible) instances are reclaimed, how many instances of one offer a run may count on, how a reclaim is told
from a crash, and what a GB leaving it costs.

Every figure is a planning assumption with its source beside it (``ProviderFacts.source``); the run's own ledger
replaces the reclaim rate once it has measured one (``sizing/activation.py``), and ``echo2 plan --workload`` lists
which of these its answer used. A provider missing from the table gets ``DEFAULT``'s figures, said as such.
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


_HYPERSCALER_RECLAIM = ("0.1 reclaims per spot instance-hour: deliberately pessimistic beside AWS's Spot Instance "
                        "Advisor (<5% ... >20% of instances interrupted per month, < 0.001/h) because GPU spot pools "
                        "are reclaimed in bursts (ECHO-2's pool saw up to 40% bursty reclaim)")
_MARKETPLACE_RECLAIM = "0.2 reclaims per interruptible instance-hour: marketplace capacity (an assumption)"
_CAP8 = "cap 8 per (instance type, region, market): an assumption standing in for regional capacity and quotas"
_UNCHECKED_EGRESS = "egress: AWS's list price assumed, this provider's own was not checked"

PROVIDERS: dict[str, ProviderFacts] = {p.name: p for p in [
    ProviderFacts("aws", "aws", 0.1, 8, "aws", 0.09, 0.02,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: aws.amazon.com/ec2/pricing/on-demand (data transfer out "
                  "to the internet, first 10 TB/month $0.09/GB; between US regions $0.02/GB)"),
    ProviderFacts("gcp", "gcp", 0.1, 8, "gcp", 0.12, 0.02,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: cloud.google.com/vpc/network-pricing (premium tier "
                  "internet egress 0-1 TiB $0.12/GB; between regions within North America $0.02/GB)"),
    ProviderFacts("azure", "azure", 0.1, 8, None, 0.087, 0.02,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: azure.microsoft.com/pricing/details/bandwidth "
                  "(internet egress after the first 100 GB $0.087/GB; inter-region within North America $0.02/GB)"),
    ProviderFacts("lambda", "lambda", 0.1, 8, None, 0.0, 0.0,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: lambda.ai/pricing (no data transfer fees)"),
    ProviderFacts("runpod", "runpod", 0.2, 8, None, 0.0, 0.0,
                  f"{_MARKETPLACE_RECLAIM}; {_CAP8}; egress: runpod.io/pricing (no ingress or egress fees)"),
    ProviderFacts("vast", "vast", 0.2, 2, None, 0.0, 0.0,
                  f"{_MARKETPLACE_RECLAIM}; cap 2: SkyPilot's vast catalog (sky/catalog/data_fetchers/fetch_vast.py) "
                  "writes a row only where at least two marketplace hosts offered that machine; egress: each host "
                  "sets its own bandwidth price, not in the catalog (0 assumed)"),
    ProviderFacts("nebius", "nebius", 0.1, 8, None, 0.0, 0.0,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: nebius.com/prices (outgoing traffic not billed)"),
    ProviderFacts("shadeform", "shadeform", 0.1, 8, None, 0.0, 0.0,
                  f"{_HYPERSCALER_RECLAIM}; {_CAP8}; egress: a broker of other clouds' machines; 0 assumed"),
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
    """What one GB moved from (provider, region) to another costs its sender: nothing within a region,
    the inter-region price within a provider, the internet egress price across providers."""
    if src_provider.lower() == dst_provider.lower():
        return 0.0 if src_region == dst_region else facts(src_provider).interregion_usd_per_gb
    return facts(src_provider).egress_usd_per_gb
