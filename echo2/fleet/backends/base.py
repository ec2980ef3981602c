"""The ``FleetBackend`` interface: what differs between places actors run.

A backend names the offers its actors may run on, builds one actor's launch (``ActorLaunch``) from what the
run gives every backend (``LaunchContext``), launches it, tells its state, and terminates it. Desired
against actual (how many, which offer, replacing the reclaimed, the budget, the ledger events) is
the manager's (``echo2/fleet/manager.py``), the same for every backend, so a new cloud is one file beside this
one (the steps are in ``__init__.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.data.relay_certs import RELAY_TLS_ENV, RelayCA
from echo2.data.relay_tokens import RELAY_TOKEN_ENV
from echo2.data.relay_tokens import mint as mint_relay_token


@dataclass(frozen=True)
class ActorOffer:
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
    tokens_per_second: float | None = None
    """Expected rollout throughput of one instance (worker profiles at the model's size), where known."""
    catalog: Any = field(default=None, compare=False, repr=False)
    """The price catalog row (``prices.catalog.Offer``) this offer was bought from, where it was: what the
    chooser (``sizing/choose.py``) weighs. Not part of the offer's identity."""

    @property
    def usd_per_throughput(self) -> float:
        """What the manager orders offers by: $ per expected token/s, or $/h where no speed is known."""
        return self.usd_per_hour / self.tokens_per_second if self.tokens_per_second else self.usd_per_hour

    def interchangeable(self, other: "ActorOffer") -> bool:
        """Same GPU type and count in the same market: equal throughput, so the cheaper one is the better."""
        return (self.gpu, self.gpu_count, self.spot) == (other.gpu, other.gpu_count, other.spot)

    @classmethod
    def from_catalog(cls, offer, spot: bool, *, tokens_per_second: float | None = None,
                     simulated: bool = False) -> "ActorOffer":
        """A price catalog row (``prices.catalog.Offer``) bought in one market."""
        price = offer.price(spot)
        if price is None:
            raise ValueError(f"{offer.name} has no {'spot' if spot else 'on-demand'} price")
        return cls(provider=offer.provider, instance_type=offer.instance_type, gpu=offer.gpu,
                   gpu_count=offer.gpu_count, region=offer.region, spot=spot, usd_per_hour=price,
                   on_demand_usd_per_hour=offer.on_demand_usd_per_hour or price, simulated_price=simulated,
                   tokens_per_second=tokens_per_second, catalog=offer)

    @property
    def name(self) -> str:
        return f"{self.provider}/{self.instance_type}@{self.region}:{'spot' if self.spot else 'on-demand'}"

    @classmethod
    def from_event(cls, event: dict) -> "ActorOffer":
        """The offer a ledger event names (``event_fields``), without the catalog row or the expected speed."""
        return cls(provider=str(event.get("provider", "local")),
                   instance_type=str(event.get("instance_type", "process")), gpu=str(event.get("gpu", "cpu")),
                   gpu_count=int(event.get("gpu_count") or 0),
                   region=str(event.get("region", "local")), spot=bool(event.get("spot", False)),
                   usd_per_hour=float(event.get("price_usd_per_hour") or 0.0),
                   on_demand_usd_per_hour=float(event.get("on_demand_usd_per_hour") or 0.0),
                   simulated_price=bool(event.get("simulated_price", False)))

    def event_fields(self) -> dict:
        """How the ledger records it (``fleet/bill/ledger.py`` reads these)."""
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
    offer: ActorOffer = field(default_factory=ActorOffer)
    alternatives: tuple[ActorOffer, ...] = ()
    """Offers interchangeable with ``offer`` (same GPU type and count, other regions or clouds): a backend
    that can ask for any of several (SkyPilot's any_of) may land on one of them; ``poll`` says which."""
    expires_at: float | None = None
    """When the actor's scoped credentials stop working (epoch seconds): the manager replaces it before."""


class RelaySecrets:
    """Each actor's relay secrets, issued by the learner: its own relay token, signed with the run key (never the
    key itself), and its relay certificate and key from the run's CA (``data/relay_certs.py``), valid as long as
    the token. They go through the backend's secret channel (local processes: their environment; SkyPilot: its
    secrets), never argv or the store."""

    def __init__(self, run_key: Ed25519PrivateKey, run_id: str):
        self._key = run_key
        self._ca = RelayCA(run_key, run_id)
        self.run_id = run_id

    def __repr__(self) -> str:  # never the key
        return f"RelaySecrets({self.run_id!r})"

    def __call__(self, actor_id: str, expires_at: float) -> dict[str, str]:
        return {RELAY_TOKEN_ENV: mint_relay_token(self._key, self.run_id, actor_id, expires_at),
                RELAY_TLS_ENV: self._ca.issue(actor_id, expires_at)}


@dataclass(frozen=True)
class LaunchContext:
    """What the run gives every backend to build its actors' launches (``FleetBackend.launch_spec``)."""

    store_url: str
    """The run's store: where the actor reads versions and commits rollouts (``--run``)."""
    store_options: dict
    """The run's ``store.options`` as configured, credentials included: a backend passes on only what its
    actors may hold (a remote actor gets scoped credentials instead)."""
    relay_secrets: RelaySecrets
    """``relay_secrets(actor_id, expires_at)``: the actor's own relay token, certificate and key, valid until
    ``expires_at``, for its launch's ``secrets`` (never argv or the store)."""
    run_id: str
    actor_command: list[str] | None = None
    """Replaces ``python -m echo2.cli actor`` for local actors (the overlap benchmark's timing workload)."""
    outlive_learner: bool = False
    """The learner's own machine is spot (``learner.market: spot``): its actors must outlive it, so that the
    relaunched learner adopts them (a local actor then runs in a session of its own, without the parent-death
    signal or the parent-pid watch)."""


class ActorState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    UNAVAILABLE = "unavailable"  # the launch found no capacity on any of its offers: try the next offer
    EXITED = "exited"        # ended by itself with code 0 (the run finished, or it was told to stop)
    CRASHED = "crashed"      # ended by itself with an error
    RECLAIMED = "reclaimed"  # taken away by the provider (spot), or by the local reclaim injector


@dataclass(frozen=True)
class ActorStatus:
    state: ActorState
    detail: str = ""
    """Exit code, the provider's reason: what the ledger event records."""
    offer: ActorOffer | None = None
    """The offer the actor runs on, where the backend chose among the launch's alternatives."""

    @property
    def ended(self) -> bool:
        return self.state in (ActorState.EXITED, ActorState.CRASHED, ActorState.RECLAIMED, ActorState.UNAVAILABLE)


class CapacityError(Exception):
    """The offer cannot be had now (no capacity, quota, price above the bid): try the next offer."""


class AdoptError(Exception):
    """A resumed learner cannot take over an actor its predecessor launched (gone, another machine or boot,
    another process under its pid, a cluster not UP): the manager records ``adopt_failed`` and stops it."""


class FleetApiError(RuntimeError):
    """A provider or credentials API call failed for a reason that passes (a dropped request, a throttle, an
    API server restarting), after the caller's bounded retries: the manager skips this reconcile pass, logged,
    and the next pass asks again. Nothing about an actor is concluded from it."""


class FleetBackend(ABC):
    """Constructing a backend starts nothing (no thread, no staged file): ``make_fleet`` asks it for its
    ``offers`` first, and a fleet that fits none stops there with nothing to undo. What it runs starts in
    ``start``."""

    name: str

    def offers(self, model_params_b: float | None, active_params_b: float | None = None) -> list[ActorOffer] | None:
        """The offers its actors may run on, for a policy of ``model_params_b`` billion parameters (of which
        ``active_params_b`` are active per token, a mixture of experts); None: this machine, free. Raises
        ``Echo2InputError`` when none fits."""
        return None

    def launch_spec(self, actor_id: str, offer: ActorOffer, launch: LaunchContext) -> ActorLaunch:
        """What ``launch`` is given for the actor ``actor_id`` on ``offer``: its command, its plain environment,
        its secrets (relay, and any credentials it mints), when they expire."""
        raise NotImplementedError(f"the {self.name} backend builds no launch spec (make_fleet needs one)")

    def manager_options(self) -> dict:
        """``FleetManager`` keyword arguments of this backend (``alternatives``, ``unavailable_retry_s``)."""
        return {}

    def start(self) -> None:
        """Start what the backend runs beside its actors (threads, staged files); once, whoever calls first:
        ``FleetManager.start``, or ``launch`` for a backend driven without a manager."""

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

    def adopt(self, actor_id: str, launched: dict, launch: LaunchContext | None, offer: ActorOffer) -> str:
        """Take over ``actor_id``, which the previous learner of this run launched (``launched``: its ledger
        ``launch`` event; ``offer``: what it was bought as) and which is still running: from now on ``poll``,
        ``terminate`` and ``new_log_lines`` answer for it. Returns how it was found ("pid", "cluster"); raises
        ``AdoptError`` when it cannot be reached (the manager then stops what is left of it)."""
        raise AdoptError(f"the {self.name} backend cannot adopt actors")

    def release_leftovers(self, actor_ids: list[str]) -> None:
        """Stop what a previous learner of this run left running (``--resume``): ``actor_ids`` are the actors
        its ledger launched and never saw end. Local actors die with their learner (``--parent-pid``)."""

    def new_log_lines(self, actor_id: str) -> list[str]:
        """Lines the actor logged since the last call (where the backend can read them)."""
        return []

    def close(self) -> None:
        """Release what the backend holds (threads, clients) once every actor is terminated."""
