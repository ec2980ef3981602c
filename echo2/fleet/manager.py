"""The fleet manager: desired against actual, for every backend.

    start: launch the desired number of actors
    every reconcile (between learner steps, and while the learner waits for rollouts):
        poll each actor; one that was reclaimed, crashed or exited is recorded and replaced
            (a crash counts against fleet.max_restarts per slot; a reclaim never does: it is the
            provider's doing, and the replacement is the point of running on spot)
        launch what is missing, cheapest offer first; an offer that has no capacity now
            (CapacityError) is skipped for the next cheapest, and retried on a later reconcile
        never start a worker that would take the fleet above fleet.max_usd_per_hour
    resize(n): grow, or retire the newest actors (fleet.actors: auto, see autosize.py)
    stop: terminate every actor

Every change goes to ``ledger/events/`` with the actor's offer and price (requested, running,
reclaimed, crashed, exited, terminated, resize, budget), which is all ``fleet/costs.py`` needs
to bill the run. The flow only talks to this class; a new backend does not touch ``flows/``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from echo2.config import FleetConfig
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.data.ledger import write_event
from echo2.data.run_key import RELAY_SECRET_ENV, relay_secret
from echo2.data.store import ObjectStore
from echo2.fleet.backend import ActorLaunch, ActorState, CapacityError, FleetBackend, Offer
from echo2.fleet.costs import fleet_usd

log = logging.getLogger("echo2.fleet")


class FleetFailed(RuntimeError):
    """An actor keeps crashing (more than fleet.max_restarts times in one slot): something is wrong
    with the actor's code or environment, and replacing it again would only burn money."""


@dataclass
class _Slot:
    index: int
    actor_id: str
    offer: Offer
    crashes: int = 0
    running_seen: bool = False


class FleetManager:
    def __init__(self, backend: FleetBackend, config: FleetConfig, store: ObjectStore, *,
                 launch_spec: Callable[[str, Offer], ActorLaunch], offers: list[Offer] | None = None,
                 desired: int | None = None):
        """``launch_spec(actor_id, offer)`` builds what the backend launches; ``offers`` are the
        candidates, cheapest first (default: this machine, free)."""
        self.backend = backend
        self.config = config
        self.store = store
        self.launch_spec = launch_spec
        self.offers = sorted(offers or [Offer()], key=lambda o: o.usd_per_hour)
        self.desired = desired if desired is not None else (
            config.actors if isinstance(config.actors, int) else config.min_actors)
        self.slots: list[_Slot] = []
        self.sized_at: int | None = None
        """The learner step at which ``fleet.actors: auto`` last sized the fleet (autosize.py)."""
        self._next_index = 0
        self._budget_logged = False
        self._stopped = False
        atexit.register(self.stop)

    # -- desired against actual ------------------------------------------------------------
    def start(self) -> None:
        self._fill()

    def reconcile(self) -> dict:
        """Record and replace ended actors, launch what is missing; a status summary for the flow."""
        for slot in list(self.slots):
            status = self.backend.poll(slot.actor_id)
            if status.state == ActorState.RUNNING and not slot.running_seen:
                slot.running_seen = True
                write_event(self.store, "running", slot.actor_id, **slot.offer.event_fields())
            if not status.ended:
                continue
            self.slots.remove(slot)
            write_event(self.store, status.state.value, slot.actor_id, detail=status.detail,
                        **slot.offer.event_fields())
            crashes = slot.crashes + (status.state != ActorState.RECLAIMED)
            if status.state == ActorState.CRASHED and crashes > self.config.max_restarts:
                raise FleetFailed(f"actor {slot.actor_id} crashed ({status.detail}) and slot {slot.index} was "
                                  f"replaced {slot.crashes} times; see its log")
            log.warning("actor %s %s (%s); replacing it", slot.actor_id, status.state.value, status.detail)
            self._launch(slot.index, crashes=crashes, replaces=slot.actor_id)
        self._fill()
        return {"actors_alive": len(self.slots), "actors_desired": self.desired,
                "usd_per_hour": self.usd_per_hour()}

    def resize(self, n: int, reason: str) -> None:
        """Grow to ``n`` actors, or retire the newest ones; recorded even when ``n`` is the size already
        (the decision and its reason are what a user auditing the fleet wants to see)."""
        write_event(self.store, "resize", "fleet", actors_from=self.desired, actors_to=n, reason=reason)
        if n == self.desired:
            return
        log.info("fleet: %d -> %d actors (%s)", self.desired, n, reason)
        self.desired = n
        while len(self.slots) > n:
            self._retire(self.slots.pop())
        self._fill()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for slot in self.slots:
            self._retire(slot)
        self.slots = []
        self.backend.close()
        atexit.unregister(self.stop)

    # -- money -------------------------------------------------------------------------------
    def usd_per_hour(self) -> float:
        return sum(slot.offer.usd_per_hour for slot in self.slots)

    def cost_so_far(self) -> float:
        """Dollars the fleet has cost this run so far (``fleet/costs.py``, from the ledger)."""
        return fleet_usd(self.store)

    # -- logs --------------------------------------------------------------------------------
    def new_log_lines(self) -> list[str]:
        return [f"[{slot.actor_id}] {line}" for slot in self.slots for line in self.backend.new_log_lines(slot.actor_id)]

    # -- inside --------------------------------------------------------------------------------
    def _fill(self) -> None:
        while len(self.slots) < self.desired:
            self._next_index += 1
            if not self._launch(self._next_index - 1):
                self._next_index -= 1
                return

    def _launch(self, index: int, *, crashes: int = 0, replaces: str | None = None) -> bool:
        """Launch one actor in slot ``index`` on the cheapest offer that has capacity and fits the budget."""
        budget = self.config.max_usd_per_hour
        for offer in self.offers:
            if budget is not None and self.usd_per_hour() + offer.usd_per_hour > budget + 1e-9:
                if not self._budget_logged:
                    write_event(self.store, "budget", "fleet", max_usd_per_hour=budget,
                                usd_per_hour=self.usd_per_hour(), wanted=offer.usd_per_hour)
                    log.warning("fleet: another actor at $%.4f/h would exceed fleet.max_usd_per_hour=%g",
                                offer.usd_per_hour, budget)
                    self._budget_logged = True
                return False
            actor_id = f"actor{index}-{secrets.token_hex(3)}"
            write_event(self.store, "requested", actor_id, backend=self.backend.name, replaces=replaces,
                        **offer.event_fields())
            try:
                details = self.backend.launch(self.launch_spec(actor_id, offer))
            except CapacityError as exc:
                write_event(self.store, "unavailable", actor_id, reason=str(exc)[:500], **offer.event_fields())
                log.warning("offer %s/%s in %s unavailable (%s); trying the next", offer.provider,
                            offer.instance_type, offer.region, exc)
                continue
            # the local ledger's bill starts here: "launch" opens the billing row (fleet/costs.py)
            write_event(self.store, "launch", actor_id, backend=self.backend.name, **offer.event_fields(), **details)
            self.slots.append(_Slot(index, actor_id, offer, crashes))
            self._budget_logged = False
            return True
        return False

    def _retire(self, slot: _Slot) -> None:
        try:
            self.backend.terminate(slot.actor_id)
            write_event(self.store, "terminated", slot.actor_id, **slot.offer.event_fields())
        except Exception as exc:  # the store or the provider may be why we are stopping
            log.warning("could not record the stop of %s: %s", slot.actor_id, exc)


def make_fleet(config: FleetConfig, store: ObjectStore, *, store_options: dict, log_dir: Path,
               run_key: Ed25519PrivateKey, seed: int = 0, actor_command: list[str] | None = None) -> FleetManager:
    """The configured backend behind a manager. ``actor_command`` replaces ``python -m echo2.cli
    actor`` (the overlap benchmark's timing workload); ``--run``, ``--actor-id`` and
    ``--parent-pid`` are appended to it."""
    from echo2.fleet.local import LocalBackend

    backend = LocalBackend(config.local, log_dir, seed=seed + config.local.seed)
    command = actor_command or [sys.executable, "-m", "echo2.cli", "actor"]
    # the actor gets the relay secret, never the learner's signing key; secrets go through the
    # backend's secret channel (for local processes: their environment), never argv or the store
    secret = {RELAY_SECRET_ENV: relay_secret(run_key)}

    def launch_spec(actor_id: str, offer: Offer) -> ActorLaunch:
        return ActorLaunch(actor_id=actor_id, run_url=store.url,
                           command=[*command, "--run", store.url, "--actor-id", actor_id, "--parent-pid", str(os.getpid())],
                           env={"ECHO2_STORE_OPTIONS": json.dumps(store_options)}, secrets=secret, offer=offer)

    return FleetManager(backend, config, store, launch_spec=launch_spec)
