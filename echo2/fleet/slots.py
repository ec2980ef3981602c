"""The fleet's slots: one actor at a time each, and the crashes that count against the slot.

A slot outlives its actors: a replacement takes the slot of the actor it replaces (its index, ``actor3-...``) and
the slot's recent crashes, so ``fleet.max_restarts`` bounds the crashes of one slot within ``CRASH_WINDOW_S``
(``manager.py`` raises ``FleetFailed`` beyond it). A resumed run's first slots are the actors it adopts
(``adoption.py``), each in the slot its id names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from echo2.fleet import adoption
from echo2.fleet.backends import ActorOffer

CRASH_WINDOW_S = 3600.0
"""A crash counts against ``fleet.max_restarts`` for this long: a slot whose actors crash that often is broken."""


def recent(crash_times: tuple[float, ...], now: float) -> tuple[float, ...]:
    """The crashes that still count at ``now``."""
    return tuple(t for t in crash_times if now - t < CRASH_WINDOW_S)


@dataclass
class Slot:
    index: int
    actor_id: str
    offer: ActorOffer
    crash_times: tuple[float, ...] = ()
    """When the actors of this slot crashed (``CRASH_WINDOW_S``: the older ones no longer count)."""
    running_seen: bool = False
    expires_at: float | None = None
    planned: ActorOffer | None = None
    """The offer of the chooser's mix this actor was launched for (``offer`` may be an alternative it landed on)."""

    @property
    def crashes(self) -> int:
        """Crashes of this slot that still count against ``fleet.max_restarts``."""
        return len(recent(self.crash_times, time.time()))


def adopted_slots(adopted: list[tuple[dict, ActorOffer]], events: list[dict],
                  next_index: int) -> tuple[list[Slot], int]:
    """The slots of the actors a resume adopted (``adoption.take_over``: each one's launch event and offer), each
    with its id, offer and credentials' expiry, in the slot its id names; and the next free slot index."""
    slots = []
    for event, offer in adopted:
        actor_id = str(event["actor_id"])
        index = adoption.slot_index(actor_id)
        index = index if index is not None else next_index
        next_index = max(next_index, index + 1)
        expires = event.get("expires_at")
        running = any(e.get("kind") == "running" and e.get("actor_id") == actor_id for e in events)
        slots.append(Slot(index, actor_id, offer, running_seen=running, planned=offer,
                          expires_at=float(expires) if isinstance(expires, (int, float)) else None))
    return slots, next_index
