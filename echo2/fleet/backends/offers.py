"""Which offers a run's fleet launches actors on, from ``fleet.prices`` and the worker profiles.

- ``local``: this machine, free; or each actor priced as one of the catalog offers ``fleet.price_as`` names,
  so a local run's cost report shows what its hours would have cost there ("simulated prices"); each carries
  the profiled tokens/s of its GPU at the model's size where the GPU is profiled (the speed the chooser and
  ``echo2 plan`` give it: a local run priced as catalog offers is planned as if its actors ran there).
- ``skypilot``: every catalog offer of a provider SkyPilot launches on and this machine's SkyPilot has enabled
  (``sky.enabled_clouds()``, asked by the backend through ``SkyApi``), in the configured market, whose GPU is
  profiled and fits the model (``activation.candidates``: the same speeds, fit rule and reclaim rates
  ``echo2 plan`` and ``echo2 bench cost`` use), each carrying its expected tokens/s. With a fixed fleet size the
  manager tries them cheapest per expected token/s first; with ``actors: auto`` it buys the chooser's mix
  (``sizing/choose.py``). Either way it names the interchangeable ones (same GPU type and count elsewhere) as
  SkyPilot any_of alternatives of each launch.

Every offer keeps its catalog row (``ActorOffer.catalog``): what the chooser weighs.

Each backend's ``offers`` (``echo2/fleet/backends/``) answers with its function here.
"""

from __future__ import annotations

from echo2.config import FleetConfig, LocalFleetConfig, SkyPilotFleetConfig
from echo2.errors import Echo2InputError
from echo2.fleet.backends.base import ActorOffer
from echo2.fleet.providers import SKYPILOT_CLOUDS, facts

SKYPILOT_PROVIDERS = SKYPILOT_CLOUDS


def _catalog(config: FleetConfig):
    from echo2.fleet.prices import make_price_source

    return make_price_source(config.prices).offers()


def _profiled_speed(offer, model_params_b: float | None, active_params_b: float | None) -> float | None:
    """Tokens/s of one instance of a catalog offer by its GPU's worker profile, None where unknown."""
    from echo2.fleet.prices.catalog import DEFAULT_PROFILES, load_profiles, profile_for

    profile = profile_for(load_profiles(DEFAULT_PROFILES), offer.gpu) if model_params_b else None
    return profile.speed(model_params_b, active_params_b) * offer.gpu_count if profile else None


def local_offers(config: LocalFleetConfig, model_params_b: float | None = None,
                 active_params_b: float | None = None) -> list[ActorOffer] | None:
    """None (this machine, free), or the catalog offers local actors are priced as (``fleet.price_as``)."""
    names = [config.price_as] if isinstance(config.price_as, str) else list(config.price_as or [])
    if not names:
        return None
    spot = config.price_as_spot
    catalog = {offer.name: offer for offer in _catalog(config)}
    out = []
    for name in dict.fromkeys(names):
        offer = catalog.get(name)
        if offer is None:
            raise Echo2InputError(f"fleet.price_as: no offer {name!r} in the {config.prices.source} price source "
                                  f"(`echo2 prices --json` lists their names)")
        try:
            out.append(ActorOffer.from_catalog(offer, spot, simulated=True,
                                               tokens_per_second=_profiled_speed(offer, model_params_b,
                                                                                 active_params_b)))
        except ValueError as exc:
            raise Echo2InputError(f"fleet.price_as: {exc}") from None
    return out


def skypilot_offers(config: SkyPilotFleetConfig, model_params_b: float, enabled_clouds: list[str] | None = None,
                    active_params_b: float | None = None) -> list[ActorOffer]:
    """The catalog offers SkyPilot actors may land on, each with its expected tokens/s: providers SkyPilot has a
    cloud for, of those ``enabled_clouds`` (SkyPilot's names, as ``sky.enabled_clouds()`` gives them; None: every
    one), of those ``fleet.providers`` names."""
    from echo2.fleet.prices.catalog import DEFAULT_PROFILES, load_profiles
    from echo2.fleet.sizing.activation import candidates

    sk = config
    wanted = {p.lower() for p in sk.providers} if sk.providers else set(SKYPILOT_PROVIDERS)
    reachable = set(SKYPILOT_PROVIDERS)
    if enabled_clouds is not None:
        enabled = {str(c).lower() for c in enabled_clouds}
        reachable = {p for p in SKYPILOT_PROVIDERS if (facts(p).skypilot_cloud or p) in enabled}
        if not reachable & wanted:
            raise Echo2InputError(f"fleet: SkyPilot has none of {', '.join(sorted(wanted))} enabled (enabled: "
                                  f"{', '.join(sorted(enabled)) or 'none'}); `sky check` tells which credentials "
                                  "are missing")
    offers = [o for o in _catalog(config) if o.provider.lower() in wanted and o.provider.lower() in reachable
              and not o.instance_type.startswith("gpu-only:")]  # a GPU without its host VM is not launchable
    market = "spot" if sk.spot else "on-demand"
    cands = candidates(offers, load_profiles(DEFAULT_PROFILES), model_params_b, active_params_b=active_params_b,
                       markets=(market,), gpus=sk.gpus)
    out = [ActorOffer.from_catalog(c.offer, c.spot, tokens_per_second=c.expected_throughput) for c in cands]
    if not out:
        raise Echo2InputError(f"fleet: no {market} offer of {', '.join(sk.gpus or ['any GPU'])} on "
                              f"{', '.join(sorted(wanted))} in the {config.prices.source} price source fits a "
                              f"{model_params_b:g}B model")
    return out
