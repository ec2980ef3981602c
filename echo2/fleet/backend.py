"""The ``FleetBackend`` interface: what differs between places actors run.

A backend launches one actor from an ``ActorLaunch``, tells its state, and terminates it. Desired
against actual (how many, which offer, replacing the reclaimed, the budget, the ledger events) is
the manager's (``manager.py``), the same for every backend, so a new cloud is one file here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class Offer:
    """What an actor runs on, as bought: one catalog offer (or this machine, priced at 0)."""

    provider: str = "local"
    instance_type: str = "process"
    gpu: str = "cpu"
    gpu_count: int = 0
    region: str = "local"
    spot: bool = False
    usd_per_hour: float = 0.0
    on_demand_usd_per_hour: float = 0.0
    simulated_price: bool = False
    """True when a local process is priced as this offer (a realistic cost report of a local run)."""

    def event_fields(self) -> dict:
        """How the ledger records it (``fleet/costs.py`` reads these)."""
        return {"provider": self.provider, "instance_type": self.instance_type, "gpu": self.gpu,
                "gpu_count": self.gpu_count, "region": self.region, "spot": self.spot,
                "price_usd_per_hour": self.usd_per_hour, "on_demand_usd_per_hour": self.on_demand_usd_per_hour,
                "simulated_price": self.simulated_price}


@dataclass(frozen=True)
class ActorLaunch:
    """Everything a backend needs to start one actor."""

    actor_id: str
    run_url: str
    command: list[str]
    """The actor's argv (``python -m echo2.cli actor --run ... --actor-id ...``): nothing secret."""
    env: dict[str, str] = field(default_factory=dict)
    """Plain environment (store options without credentials, log settings)."""
    secrets: dict[str, str] = field(default_factory=dict)
    """Delivered through the backend's secret channel only: never argv, a file in the repo, or the store."""
    offer: Offer = field(default_factory=Offer)


class ActorState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"        # ended by itself with code 0 (the run finished, or it was told to stop)
    CRASHED = "crashed"      # ended by itself with an error
    RECLAIMED = "reclaimed"  # taken away by the provider (spot), or by the local reclaim injector


@dataclass(frozen=True)
class ActorStatus:
    state: ActorState
    detail: str = ""
    """Exit code, the provider's reason: what the ledger event records."""

    @property
    def ended(self) -> bool:
        return self.state in (ActorState.EXITED, ActorState.CRASHED, ActorState.RECLAIMED)


class CapacityError(Exception):
    """The offer cannot be had now (no capacity, quota, price above the bid): try the next offer."""


class FleetBackend(ABC):
    name: str

    @abstractmethod
    def launch(self, spec: ActorLaunch) -> dict:
        """Start the actor ``spec.actor_id``; what the ledger's launch event should add (pid, cluster
        name...). Raises ``CapacityError`` when the offer is unavailable."""

    @abstractmethod
    def poll(self, actor_id: str) -> ActorStatus:
        """The actor's state now."""

    @abstractmethod
    def terminate(self, actor_id: str, grace_s: float = 10.0) -> None:
        """Stop the actor: SIGTERM-like first (a commit under way finishes), then for good."""

    def new_log_lines(self, actor_id: str) -> list[str]:
        """Lines the actor logged since the last call (where the backend can read them)."""
        return []

    def close(self) -> None:
        """Release what the backend holds (threads, clients) once every actor is terminated."""
