"""The ``FleetBackend`` interface: start, watch and stop rollout actors for one run."""

from __future__ import annotations

from abc import ABC, abstractmethod


class FleetBackend(ABC):
    @abstractmethod
    def start(self) -> None:
        """Launch the configured actors."""

    @abstractmethod
    def reconcile(self) -> dict:
        """Compare desired with actual: replace actors that died. Returns a status summary."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every actor this backend started (idempotent)."""
