"""SkyPilot's catalog as a price source: ``sky.catalog.list_accelerators``, when SkyPilot is installed.

SkyPilot is the ``cloud`` extra (it pins click<8.2, so it is never in the base install); without it
this source is ``PriceSourceUnavailable`` with the install command, and its tests are skipped with
that reason. With it, ``list_accelerators(gpus_only=True, all_regions=True)`` gives one
``InstanceTypeInfo`` per (cloud, instance type, region): accelerator name and count, per-GPU
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

INSTALL = "pip install -e '.[cloud]'"


def _price(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def offers_from_listing(listing: dict[str, list]) -> list[Offer]:
    """``list_accelerators``'s answer ({GPU name: [InstanceTypeInfo, ...]}) as offers."""
    out = {}
    for gpu, infos in listing.items():
        for info in infos:
            itype = getattr(info, "instance_type", None)
            count = _price(getattr(info, "accelerator_count", None))
            if not itype or (isinstance(itype, float) and math.isnan(itype)) or count is None or count != int(count):
                continue
            memory = _price(getattr(info, "device_memory", None))
            region = getattr(info, "region", None) or "?"
            offer = Offer(str(info.cloud).lower(), str(itype), str(getattr(info, "accelerator_name", gpu) or gpu),
                          int(count), memory, str(region), _price(info.price),
                          _price(getattr(info, "spot_price", None)))
            if offer.price(True) is None and offer.price(False) is None:
                continue
            out.setdefault(offer.name, offer)
    return sorted(out.values(), key=lambda o: o.name)


def import_sky(needed_by: str = "the skypilot price source", error: type[Exception] = PriceSourceUnavailable, *,
               catalog: bool = True):
    """SkyPilot's ``sky`` module (with ``sky.catalog`` unless ``catalog`` is False), or ``error`` saying that
    ``needed_by`` needs it and how to install it. The SkyPilot fleet backend asks through here too
    (``backends/skypilot_api.py``), with its own error."""
    try:
        import sky  # noqa: F401  (the cloud extra)
        if catalog:
            import sky.catalog
    except ImportError as exc:
        raise error(f"{needed_by} needs SkyPilot, which is not installed here ({exc.name or exc}): {INSTALL}") from None
    return sky


class SkyPilotPrices:
    """Offers and prices of SkyPilot's catalog for ``clouds`` (None = every cloud it knows)."""

    name = "skypilot"

    def __init__(self, clouds: list[str] | None = None):
        self.clouds = list(clouds) if clouds else None
        self.version: str | None = None

    def offers(self, gpus: list[str] | None = None, spot: bool | None = None) -> list[Offer]:
        sky = import_sky()
        self.version = getattr(sky, "__version__", None)
        try:
            listing = sky.catalog.list_accelerators(gpus_only=True, clouds=self.clouds, case_sensitive=False,
                                                    all_regions=True, require_price=True)
        except Exception as exc:  # SkyPilot raises plain ValueError/AttributeError for unknown clouds
            raise Echo2InputError(f"skypilot catalog: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
        match = gpu_matcher(gpus)
        return select(offers_from_listing({k: v for k, v in listing.items() if match(k)}), gpus, spot)

    def describe(self) -> dict:
        return {"source": self.name, "date": None,
                "detail": f"SkyPilot {self.version or ''} catalog (~/.sky/catalogs), "
                          + (", ".join(self.clouds) if self.clouds else "all clouds")}
