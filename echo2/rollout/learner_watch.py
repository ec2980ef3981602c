"""Whether the learner is still there, as an actor can tell from the store alone.

A learner that died cannot stop its actors, and on a cloud an actor that keeps running keeps billing
(SkyPilot's autodown waits for the actor's job to end). Every step the learner writes a ledger entry
(``ledger/consumed/``, and ``collecting.json`` while it collects) and every publish moves
``policy/LATEST``; an actor that has seen none of these change for ``fleet.learner_silence_s`` stops.

The store is asked at most every ``check_s`` (a listing of ``ledger/consumed/`` and two small reads),
whatever the actor's loop does, and always before silence is concluded.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from echo2.data import layout
from echo2.data.store import NotFound, ObjectStore, StoreError

log = logging.getLogger("echo2.actor")


class LearnerWatch:
    def __init__(self, store: ObjectStore, silence_s: float, *, clock: Callable[[], float] = time.time):
        self.store = store
        self.silence_s = silence_s
        self.check_s = min(60.0, silence_s / 10)
        self.clock = clock
        self._sign: tuple | None = None
        self.last_sign_of_life = clock()
        """When the learner's marks in the store last changed (or this watch started)."""
        self._checked_at: float | None = None

    def _read(self, key: str) -> bytes | None:
        try:
            return self.store.get(key)
        except NotFound:
            return None

    def _current_sign(self) -> tuple:
        return (self._read(layout.LATEST), tuple(sorted(self.store.list(layout.LEDGER_CONSUMED))),
                self._read(layout.COLLECTING))

    def silent(self) -> bool:
        """Whether the learner has left no new mark for ``silence_s`` (checked at most every ``check_s``)."""
        now = self.clock()
        quiet_for = now - self.last_sign_of_life
        if self._checked_at is not None and now - self._checked_at < self.check_s and quiet_for < self.silence_s:
            return False  # asked recently; silence is only ever concluded from a fresh look
        self._checked_at = now
        try:
            sign = self._current_sign()
        except (StoreError, OSError) as exc:  # the store failing is not the learner's silence: judged at the next check
            log.warning("could not look for the learner's marks in the store: %s", exc)
            return False
        if sign != self._sign:
            self._sign, self.last_sign_of_life = sign, now
        return now - self.last_sign_of_life >= self.silence_s
