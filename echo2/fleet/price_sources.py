"""Price sources: where the fleet's offers and their prices come from.

Every consumer (``echo2 prices``, activation, ``echo2 bench cost``, the fleet manager) asks a
``PriceSource`` for ``offers(gpus, spot)`` and gets ``prices.Offer`` rows, whatever the origin:

* ``snapshot`` (this file): the dated catalog under ``infra/prices/``, read by ``prices.py``. The
  default, and the only source that works offline and gives the same answer every time.
* ``aws`` (``price_aws.py``): live spot prices from EC2's ``describe_spot_price_history``, joined
  with the snapshot's instance metadata (GPUs, on-demand price).
* ``skypilot`` (``price_skypilot.py``): SkyPilot's catalog (``sky.catalog.list_accelerators``),
  when the ``cloud`` extra is installed.

``make_price_source`` builds the configured one (``fleet.prices`` in the config, or ``--source``
on the command line); an unknown name or a source that cannot run here is one
``Echo2InputError`` line, never a traceback.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Protocol

from echo2.errors import Echo2InputError
from echo2.fleet.prices import DEFAULT_CATALOG, Offer, gpu_key, load_catalog, load_profiles, snapshot_info

SOURCES = ("snapshot", "aws", "skypilot")


class PriceSourceUnavailable(Echo2InputError):
    """The source cannot run on this machine (a package is missing); the message says what to install."""


class PriceSource(Protocol):
    name: str

    def offers(self, gpus: list[str] | None = None, spot: bool | None = None) -> list[Offer]:
        """The offers of the GPUs named (None = all), with a spot price (``spot=True``), an on-demand
        price (``False``), or either (None)."""
        ...

    def describe(self) -> dict:
        """``{"source": name, "date": ..., "detail": ...}``: what a table title says about the prices."""
        ...


def gpu_matcher(gpus: list[str] | None):
    """A predicate on GPU names: True for every GPU when ``gpus`` is empty, else for the names given
    and their aliases in the worker profiles (``--gpu H100`` also matches ``H100-MEGA``)."""
    if not gpus:
        return lambda name: True
    wanted = {gpu_key(g) for g in gpus}
    try:
        profiles = load_profiles()
    except Echo2InputError:
        profiles = {}
    for key in list(wanted):
        profile = profiles.get(key)
        if profile is not None:
            wanted |= {gpu_key(n) for n in (profile.name, *profile.aliases)}
    return lambda name: gpu_key(name) in wanted


def select(offers: list[Offer], gpus: list[str] | None = None, spot: bool | None = None) -> list[Offer]:
    """The offers of ``gpus`` that have the price ``spot`` asks for (see ``PriceSource.offers``)."""
    match = gpu_matcher(gpus)
    return [o for o in offers if match(o.gpu) and
            (o.price(spot) is not None if spot is not None else (o.price(True) or o.price(False)) is not None)]


def cheapest_first(offers: list[Offer], spot: bool | None = None) -> list[Offer]:
    """Offers by the price shown (spot when asked, on-demand when asked, else the lower of the two)."""
    def key(o: Offer):
        prices = [p for p in ((o.price(spot),) if spot is not None else (o.price(True), o.price(False))) if p is not None]
        return (min(prices) if prices else float("inf"), o.name)
    return sorted(offers, key=key)


class SnapshotPrices:
    """The dated catalog shipped under ``infra/prices/`` (or another CSV of the same columns)."""

    name = "snapshot"

    def __init__(self, catalog: str | Path | None = None):
        self.catalog = Path(catalog) if catalog else DEFAULT_CATALOG

    def offers(self, gpus: list[str] | None = None, spot: bool | None = None) -> list[Offer]:
        return select(load_catalog(self.catalog, spot=None), gpus, spot)

    def describe(self) -> dict:
        info = snapshot_info(self.catalog)
        return {"source": self.name, "date": info["date"], "detail": f"{self.catalog.name}"
                + (f" from {info['source']}" if info["source"] else ""), "origin": info["source"]}


def make_price_source(config=None, **options) -> PriceSource:
    """The price source of a ``fleet.prices`` config (``echo2.config.PriceSourceConfig``), or of a
    name (``"snapshot"``, ``"aws"``, ``"skypilot"``) with its options as keywords."""
    if config is None or isinstance(config, str):
        name = config or "snapshot"
    else:
        options = {**config.model_dump(exclude={"source"}), **options}
        name = config.source
    options = {k: v for k, v in options.items() if v is not None and v != []}
    if name == "snapshot":
        cls = SnapshotPrices
    elif name == "aws":
        from echo2.fleet.price_aws import AwsSpotPrices as cls
    elif name == "skypilot":
        from echo2.fleet.price_skypilot import SkyPilotPrices as cls
    else:
        raise Echo2InputError(f"unknown price source {name!r}; choose one of {', '.join(SOURCES)}")
    accepted = set(inspect.signature(cls).parameters) - {"client_factory"}
    wrong = sorted(set(options) - accepted)
    if wrong:
        raise Echo2InputError(f"the {name} price source takes no {', '.join(wrong)} (it takes: "
                              f"{', '.join(sorted(accepted)) or 'nothing'})")
    return cls(**options)


def print_offers(offers: list[Offer], info: dict, spot: bool | None, limit: int = 0, console=None) -> None:
    """``echo2 prices``: a rich table of ``offers`` (as sorted), titled with the source and its date."""
    from rich.console import Console
    from rich.table import Table

    market = "" if spot is None else " (spot)" if spot else " (on-demand)"
    table = Table(title=f"{len(offers)} GPU offers{market}, cheapest first -- {info['source']}"
                        f"{' ' + info['date'] if info.get('date') else ''}: {info['detail']}")
    for col in ("provider", "instance", "GPU x count", "region", "spot $/h", "on-demand $/h", "spot discount"):
        table.add_column(col, justify="right" if "$" in col or "discount" in col else "left")
    for o in offers[:limit or None]:
        s, d = o.spot_usd_per_hour, o.on_demand_usd_per_hour
        table.add_row(o.provider, o.instance_type, f"{o.gpu} x{o.gpu_count}", o.region,
                      "-" if s is None else f"{s:.4f}", "-" if d is None else f"{d:.4f}",
                      f"{1 - s / d:.0%}" if s is not None and d else "-")
    if console is None:
        console = Console()
        console = console if console.is_terminal else Console(width=150)  # a pipe gets whole names, not 80 columns
    console.print(table)
    if limit and len(offers) > limit:
        console.print(f"... {len(offers) - limit} more (--limit 0 shows all)")
