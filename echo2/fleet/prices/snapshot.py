"""The snapshot price source: the dated catalog shipped under ``infra/prices/``, read by ``catalog.py``.

The default, and the only source that works offline and gives the same answer every time.
"""

from __future__ import annotations

from pathlib import Path

from echo2.fleet.prices.base import select
from echo2.fleet.prices.catalog import DEFAULT_CATALOG, Offer, load_catalog, snapshot_info


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
