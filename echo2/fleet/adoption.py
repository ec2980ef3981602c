"""Adoption: a resumed learner takes over the run's actors that are still running.

A learner on a spot machine can be reclaimed; its actors keep their weights, stop at the backlog bound, keep
their relay up and wait (``fleet.learner_silence_s`` is how long), and the learner relaunched with ``--resume``
adopts them instead of launching new ones. The model:

    candidates   the ledger's ``launch`` events of actors that have no end event (``ENDED_KINDS``, ``expelled``,
                 ``adopt_failed``): the previous learners launched them and never saw them end
    reach        the backend says whether each is this run's actor and alive (``FleetBackend.adopt``: a local
                 process by pid, boot id and command line; a SkyPilot cluster of its name, UP, labelled with the
                 run, its job live); yes: one ``adopt`` event {step, backend, how, resigned} and a slot in the
                 fleet, the actor keeping its id, offer and bill; no (``AdoptError``, or any other error):
                 ``adopt_failed`` {reason}, then stopped (``terminated``) and its token revoked
    tokens       an adopted actor keeps the relay token, certificate and scoped credentials it was launched
                 with: no channel reaches a running actor's secrets, so nothing is re-signed (``resigned``:
                 false); the manager replaces it before they expire, as any actor (its launch event's
                 ``expires_at``). Local tokens live ``LOCAL_TOKEN_S`` (30 days), SkyPilot's
                 ``fleet.credentials_hours`` (6 h by default): both span a recovery of minutes.
    revocation   the resumed learner revokes only actors the ledger saw end (``revoked_on_resume``); the fleet
                 adds those it could not adopt (``FleetManager.revoked``), which the next version revokes

Assumptions: the ledger's launch events are the truth about which actors a run started (every launch writes one
before the actor can do anything); an actor's id is ``actor<slot>-<hex>`` (``FleetManager._launch``).
"""

from __future__ import annotations

import logging
import re

from echo2.data.ledger import write_event
from echo2.data.store import ObjectStore
from echo2.fleet.backends.base import ActorOffer, FleetBackend, LaunchContext

log = logging.getLogger("echo2.fleet")

ENDED_KINDS = frozenset({"exited", "crashed", "reclaimed", "unavailable", "terminated"})
"""Ledger events after which an actor runs no more (``bill/ledger.py`` closes its bill at them)."""
GONE_KINDS = ENDED_KINDS | {"expelled", "adopt_failed"}
"""... and the events after which no learner may adopt it."""

_SLOT = re.compile(r"^actor(\d+)-[0-9a-f]+$")


def candidates(events: list[dict]) -> list[dict]:
    """The launch events of actors launched and never seen to end, oldest first (one per actor: its last)."""
    events = sorted(events, key=lambda e: e.get("ts", 0))
    gone = {str(e.get("actor_id")) for e in events if e.get("kind") in GONE_KINDS}
    last: dict[str, dict] = {}
    for e in events:
        if e.get("kind") == "launch" and str(e.get("actor_id")) not in gone:
            last[str(e["actor_id"])] = e
    return list(last.values())


def revoked_on_resume(events: list[dict]) -> set[str]:
    """The actors whose relay tokens a resumed learner revokes at once: every actor launched before that the
    ledger saw end, be expelled or fail adoption. The live ones are the fleet's to adopt or stop (and revoke)."""
    launched = {str(e["actor_id"]) for e in events if e.get("kind") == "launch"}
    return launched - {str(e["actor_id"]) for e in candidates(events)}


def slot_index(actor_id: str) -> int | None:
    """The fleet slot an actor id names (``actor3-1a2b3c`` -> 3), or None."""
    m = _SLOT.match(actor_id)
    return int(m.group(1)) if m else None


def offer_of(event: dict, offers: list[ActorOffer]) -> ActorOffer:
    """The offer an event names: the fleet's own (with its catalog row and speed) where it has it."""
    offer = ActorOffer.from_event(event)
    return next((o for o in offers if o.name == offer.name and o.usd_per_hour == offer.usd_per_hour), offer)


def take_over(backend: FleetBackend, store: ObjectStore, events: list[dict], launch: LaunchContext | None,
              offers: list[ActorOffer], *, enabled: bool = True) -> tuple[list[tuple[dict, ActorOffer]], list[str]]:
    """Adopt every candidate the backend reaches (an ``adopt`` event each); the launch events and offers of those
    adopted, and the ids of those left to stop (an ``adopt_failed`` event each, unless adoption is off). A provider
    that keeps failing (``FleetApiError``, after the backend's retries) counts as unreachable: the actor is stopped
    and replaced rather than left running unmanaged (nobody would stop it: its learner is back, so it never falls
    silent)."""
    step = max((e["step"] for e in events if e.get("kind") == "resume" and isinstance(e.get("step"), int)),
               default=None)
    adopted, left = [], []
    for event in candidates(events):
        actor_id = str(event["actor_id"])
        if not enabled:
            left.append(actor_id)
            continue
        offer = offer_of(event, offers)
        try:
            how = backend.adopt(actor_id, event, launch, offer)
        except Exception as exc:  # AdoptError, a provider that kept failing (FleetApiError), anything: not adopted
            write_event(store, "adopt_failed", actor_id, reason=str(exc)[:500], backend=backend.name)
            left.append(actor_id)
            continue
        write_event(store, "adopt", actor_id, step=step, backend=backend.name, how=how, resigned=False,
                    **offer.event_fields())
        adopted.append((event, offer))
    if adopted:
        log.info("fleet: adopted %d actors the previous learner left running: %s", len(adopted),
                 ", ".join(str(e["actor_id"]) for e, _ in adopted))
    return adopted, left
