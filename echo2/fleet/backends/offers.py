"""Which offers a run's fleet launches actors on, from ``fleet.prices`` and the worker profiles.

- ``local``: this machine, free; or every actor priced as one catalog offer (``fleet.price_as``),
  so a local run's cost report shows what its hours would have cost there ("simulated prices").
- ``skypilot``: every catalog offer of a provider SkyPilot launches on, in the configured market, whose
  GPU is profiled and fits the model (``activation.candidates``: the same speeds, fit rule and reclaim
  rates ``echo2 plan`` and ``echo2 bench cost`` use), each carrying its expected tokens/s. The manager
  tries them cheapest per expected token/s first, and names the interchangeable ones (same GPU type and
  count elsewhere) as SkyPilot any_of alternatives of each launch.

Each backend's ``offers`` (``echo2/fleet/backends/``) answers with its function here.
"""

from __future__ import annotations

from echo2.config import FleetConfig, LocalFleetConfig, SkyPilotFleetConfig
from echo2.errors import Echo2InputError
from echo2.fleet.backends.base import ActorOffer
from echo2.fleet.providers import SKYPILOT_CLOUDS

SKYPILOT_PROVIDERS = SKYPILOT_CLOUDS


def _catalog(config: FleetConfig):
    from echo2.fleet.prices import make_price_source

    return make_price_source(config.prices).offers()


def local_offers(config: LocalFleetConfig) -> list[ActorOffer] | None:
    """None (this machine, free), or the one catalog offer every local actor is priced as."""
    name = config.price_as
    if name is None:
        return None
    spot = config.price_as_spot
    for offer in _catalog(config):
        if offer.name == name:
            try:
                return [ActorOffer.from_catalog(offer, spot, simulated=True)]
            except ValueError as exc:
                raise Echo2InputError(f"fleet.price_as: {exc}") from None
    raise Echo2InputError(f"fleet.price_as: no offer {name!r} in the {config.prices.source} price source "
                          f"(`echo2 prices --json` lists their names)")


def skypilot_offers(config: SkyPilotFleetConfig, model_params_b: float) -> list[ActorOffer]:
    """The catalog offers SkyPilot actors may land on, each with its expected tokens/s."""
    from echo2.fleet.prices.catalog import DEFAULT_PROFILES, load_profiles
    from echo2.fleet.sizing.activation import candidates

    sk = config
    wanted = {p.lower() for p in sk.providers} if sk.providers else set(SKYPILOT_PROVIDERS)
    offers = [o for o in _catalog(config) if o.provider.lower() in wanted and o.provider.lower() in SKYPILOT_PROVIDERS
              and not o.instance_type.startswith("gpu-only:")]  # a GPU without its host VM is not launchable
    market = "spot" if sk.spot else "on-demand"
    cands = candidates(offers, load_profiles(DEFAULT_PROFILES), model_params_b, markets=(market,), gpus=sk.gpus)
    out = [ActorOffer.from_catalog(c.offer, c.spot, tokens_per_second=c.expected_throughput) for c in cands]
    if not out:
        raise Echo2InputError(f"fleet: no {market} offer of {', '.join(sk.gpus or ['any GPU'])} on "
                              f"{', '.join(sorted(wanted))} in the {config.prices.source} price source fits a "
                              f"{model_params_b:g}B model")
    return out
