"""The ``PriceSource`` interface, and the offer filters every source shares.

A price source answers ``offers(gpus, spot)`` with ``prices.catalog.Offer`` rows and ``describe()`` with what a
table title says about them. ``select`` and ``cheapest_first`` are the filters and the order every
source and every consumer applies the same way; ``gpu_matcher`` knows a GPU's aliases from the worker
profiles. The sources themselves are the sibling files; ``__init__.make_price_source`` builds one.
"""

from __future__ import annotations

from typing import Protocol

from echo2.errors import Echo2InputError
from echo2.fleet.prices.catalog import Offer, gpu_key, load_profiles


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
        shown = (o.price(spot),) if spot is not None else (o.price(True), o.price(False))
        prices = [p for p in shown if p is not None]
        return (min(prices) if prices else float("inf"), o.name)
    return sorted(offers, key=key)
