"""SkyPilot's catalog as a price source: ``sky.catalog.list_accelerators``, asked in SkyPilot's own environment.

SkyPilot never shares echo2's environment (it pins click<8.2): ``make setup`` builds ``.venv-sky``, and the
catalog is listed there by ``echo2/fleet/backends/sky_bridge.py`` (``accelerators``). Without that environment
this source is ``PriceSourceUnavailable`` with the install command. With it, ``list_accelerators(gpus_only=True,
all_regions=True)`` gives one row per (cloud, instance type, region): accelerator name and count, per-GPU
device memory, on-demand price and the cheapest zone's spot price -- the same catalog files
(``catalogs/v8/<cloud>/vms.csv``) the snapshot was cut from, but as SkyPilot has them now
(downloaded at first use into ``~/.sky/catalogs``; SkyPilot's own download, with no timeout).

Rows are kept as the snapshot keeps them: GPU rows only, whole GPUs (fractional counts such as
AWS's g6f are skipped), and no row without an instance type (GCP lists accelerators apart from
their host VM: their price is not what a launch costs). NaN or non-positive prices are "none".
"""

from __future__ import annotations

import math

from echo2.errors import Echo2InputError
from echo2.fleet.prices.base import PriceSourceUnavailable, gpu_matcher, select
from echo2.fleet.prices.catalog import Offer


def _price(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def offers_from_listing(listing: dict[str, list[dict]]) -> list[Offer]:
    """The bridge's ``accelerators`` listing ({GPU name: [row, ...]}, each row ``InstanceTypeInfo``'s fields) as
    offers."""
    out = {}
    for gpu, infos in listing.items():
        for info in infos:
            itype = info.get("instance_type")
            count = _price(info.get("accelerator_count"))
            if not itype or count is None or count != int(count):
                continue
            offer = Offer(str(info["cloud"]).lower(), str(itype), str(info.get("accelerator_name") or gpu),
                          int(count), _price(info.get("device_memory")), str(info.get("region") or "?"),
                          _price(info.get("price")), _price(info.get("spot_price")))
            if offer.price(True) is None and offer.price(False) is None:
                continue
            out.setdefault(offer.name, offer)
    return sorted(out.values(), key=lambda o: o.name)


class SkyPilotPrices:
    """Offers and prices of SkyPilot's catalog for ``clouds`` (None = every cloud it knows)."""

    name = "skypilot"

    def __init__(self, clouds: list[str] | None = None):
        self.clouds = list(clouds) if clouds else None
        self.version: str | None = None

    def offers(self, gpus: list[str] | None = None, spot: bool | None = None) -> list[Offer]:
        from echo2.fleet.backends.skypilot_api import SkyError, SkyPilotUnavailable, bridge

        try:
            answer = bridge("accelerators", {"clouds": self.clouds})
        except SkyPilotUnavailable as exc:
            raise PriceSourceUnavailable(f"the skypilot price source: {exc}") from None
        except SkyError as exc:  # SkyPilot raises plain ValueError/AttributeError for unknown clouds
            raise Echo2InputError(f"skypilot catalog: {type(exc).__name__}: "
                                  f"{(str(exc).splitlines() or [''])[0][:200]}") from None
        self.version = answer["version"]
        match = gpu_matcher(gpus)
        return select(offers_from_listing({k: v for k, v in answer["listing"].items() if match(k)}), gpus, spot)

    def describe(self) -> dict:
        return {"source": self.name, "date": None,
                "detail": f"SkyPilot {self.version or ''} catalog (~/.sky/catalogs), "
                          + (", ".join(self.clouds) if self.clouds else "all clouds")}
