"""Price sources: where the fleet's offers and their prices come from.

Every consumer (``echo2 prices``, activation, ``echo2 bench cost``, the fleet manager) asks a
``PriceSource`` (``base.py``) for ``offers(gpus, spot)`` and gets ``prices.catalog.Offer`` rows, whatever the origin:

* ``snapshot`` (``snapshot.py``): the dated catalog under ``infra/prices/``, read by ``catalog.py``. The
  default, and the only source that works offline and gives the same answer every time.
* ``aws`` (``aws.py``): live spot prices from EC2's ``describe_spot_price_history``, joined
  with the snapshot's instance metadata (GPUs, on-demand price).
* ``skypilot`` (``skypilot.py``): SkyPilot's catalog (``sky.catalog.list_accelerators``),
  when the ``cloud`` extra is installed.

``make_price_source`` builds the configured one (``fleet.prices`` in the config, or ``--source``
on the command line); an unknown name or a source that cannot run here is one
``Echo2InputError`` line, never a traceback.

Adding a source is three steps, as for tasks, engines and fleet backends:

1. its config class in ``echo2/config/fleet.py``, a member of the ``PriceSourceConfig`` union with its
   own ``source: Literal["name"]``;
2. one file here, ``echo2/fleet/prices/<name>.py``, whose class has ``name``, ``offers`` and
   ``describe`` (``base.PriceSource``) and imports what it shares from ``base.py``, never from here;
3. one branch in ``make_price_source`` below, from its config class to its class.
"""

from __future__ import annotations

import os
from typing import get_args

from pydantic import ValidationError

from echo2.config import AwsPricesConfig, PriceSourceConfig, SkyPilotPricesConfig, SnapshotPricesConfig
from echo2.errors import Echo2InputError
from echo2.fleet.prices.base import PriceSource, PriceSourceUnavailable, cheapest_first, gpu_matcher, select

CONFIGS = {cls.model_fields["source"].annotation.__args__[0]: cls for cls in get_args(get_args(PriceSourceConfig)[0])}
"""Source name -> its config class, read off the ``PriceSourceConfig`` union (so a new member is named here too)."""
SOURCES = tuple(CONFIGS)


def price_source_config(name: str, **options) -> PriceSourceConfig:
    """The config of source ``name`` with ``options`` (``--source``, ``--catalog``, ``--region`` on the command
    line); an option left empty (None, []) is the source's default."""
    cls = CONFIGS.get(name)
    if cls is None:
        raise Echo2InputError(f"unknown price source {name!r}; choose one of {', '.join(SOURCES)}")
    # paths come from typer as Path; the config holds the str a YAML file would
    options = {k: os.fspath(v) if isinstance(v, os.PathLike) else v
               for k, v in options.items() if v is not None and v != []}
    accepted = set(cls.model_fields) - {"source"}
    wrong = sorted(set(options) - accepted)
    if wrong:
        raise Echo2InputError(f"the {name} price source takes no {', '.join(wrong)} (it takes: "
                              f"{', '.join(sorted(accepted)) or 'nothing'})")
    try:
        return cls(source=name, **options)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise Echo2InputError(f"the {name} price source: {error['loc'][0]}: {error['msg']}") from None


def make_price_source(config: PriceSourceConfig | str | None = None, **options) -> PriceSource:
    """The price source of a ``fleet.prices`` config (``echo2.config.PriceSourceConfig``), or of a
    name (``"snapshot"``, ``"aws"``, ``"skypilot"``) with its options as keywords."""
    if config is None or isinstance(config, str):
        config = price_source_config(config or "snapshot", **options)
    elif options:
        config = price_source_config(config.source, **{**config.model_dump(exclude={"source"}), **options})
    if isinstance(config, SnapshotPricesConfig):
        from echo2.fleet.prices.snapshot import SnapshotPrices

        return SnapshotPrices(catalog=config.catalog)
    if isinstance(config, AwsPricesConfig):
        from echo2.fleet.prices.aws import AwsSpotPrices

        return AwsSpotPrices(regions=config.regions, endpoint_url=config.endpoint_url, catalog=config.catalog)
    if isinstance(config, SkyPilotPricesConfig):
        from echo2.fleet.prices.skypilot import SkyPilotPrices

        return SkyPilotPrices(clouds=config.clouds)
    raise ValueError(f"no price source for config {type(config).__name__}")


__all__ = ["CONFIGS", "PriceSource", "PriceSourceUnavailable", "SOURCES", "cheapest_first", "gpu_matcher",
           "make_price_source", "price_source_config", "select"]
