"""Notable ledger events, also sent as Prefect events, so that a Prefect Automation can act on them (a message when
an actor is banned, or when the budget stops the fleet growing). The ledger stays the record: this is a notification,
and one that fails is logged once and forgotten (``echo2.data.ledger.event_listeners`` guards every listener).

Each event's resource is the run (``echo2.run.<run id>``), its related resource the actor or learner it is about
(role ``actor`` or ``learner``), its payload the ledger record's fields (JSON-safe, long strings and lists cut).
Emitted inside the flow run, Prefect also relates the event to the flow run. Names (``EVENT_NAMES``):

    echo2.actor.reclaimed  a spot actor taken back by its provider (the fleet replaces it)
    echo2.actor.crashed    an actor that ended with an error (replaced, until fleet.max_restarts)
    echo2.actor.banned     an actor whose files the learner caught lying (none of its files is used again)
    echo2.actor.expelled   a banned actor the fleet stopped
    echo2.fleet.budget     another actor would exceed fleet.max_usd_per_hour: the fleet stops growing
    echo2.learner.notice   a spot learner's preemption notice
    echo2.learner.left     that learner checkpointed and left, its fleet still running
"""

from __future__ import annotations

import datetime
import logging
import math
from contextlib import contextmanager
from typing import Any, Iterator

from prefect.events import emit_event

from echo2.data import ledger

log = logging.getLogger("echo2.flows")

EVENT_NAMES = {
    "reclaimed": "echo2.actor.reclaimed",
    "crashed": "echo2.actor.crashed",
    "banned": "echo2.actor.banned",
    "expelled": "echo2.actor.expelled",
    "budget": "echo2.fleet.budget",
    "learner_notice": "echo2.learner.notice",
    "learner_left": "echo2.learner.left",
}
"""Ledger kind -> Prefect event name. Other kinds (launch, running, resize, ...) are routine: the ledger has them."""

MAX_TEXT = 500
"""Characters kept of a string in a payload: an actor's crash detail can be long, a Prefect event is bounded."""
MAX_ITEMS = 50
"""Items kept of a list or mapping in a payload (a revoked list can name the whole fleet)."""


def json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON can carry it: long strings and containers cut, non-finite numbers and other objects as text."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + "..."
    if depth < 4 and isinstance(value, dict):
        return {str(k)[:MAX_TEXT]: json_safe(v, depth + 1) for k, v in list(value.items())[:MAX_ITEMS]}
    if depth < 4 and isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v, depth + 1) for v in list(value)[:MAX_ITEMS]]
    return json_safe(str(value), depth)


def prefect_event(run_id: str, record: dict[str, Any]) -> dict[str, Any] | None:
    """The keyword arguments of ``emit_event`` for a ledger record, or None for a routine kind."""
    name = EVENT_NAMES.get(str(record.get("kind")))
    if name is None:
        return None
    actor = str(record.get("actor_id", ""))
    related = []
    if actor and actor != "fleet":
        role = "learner" if actor == "learner" else "actor"
        related.append({"prefect.resource.id": f"echo2.run.{run_id}.{role}.{actor}",
                        "prefect.resource.role": role, "prefect.resource.name": actor})
    ts = record.get("ts")
    occurred = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc) if isinstance(ts, (int, float)) else None
    return {"event": name, "resource": {"prefect.resource.id": f"echo2.run.{run_id}", "prefect.resource.name": run_id},
            "related": related, "payload": json_safe(record), "occurred": occurred}


@contextmanager
def forward_run_events(run_id: str) -> Iterator[None]:
    """While inside, every notable ledger event written in this process is also a Prefect event of run ``run_id``."""
    def forward(record: dict[str, Any]) -> None:
        event = prefect_event(run_id, record)
        if event is not None:
            emit_event(**event)

    forward.__qualname__ = f"forward_run_events({run_id!r})"  # what the ledger's one warning names
    ledger.event_listeners.append(forward)
    try:
        yield
    finally:
        ledger.event_listeners.remove(forward)
