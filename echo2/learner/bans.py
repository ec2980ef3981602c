"""What the learner holds against each actor, and the bans it leads to (the collector's, ``collector.py``).

An actor is banned for a dishonest file (at once), for ``max_invalid_files`` malformed, copied or future-version
files (no honest actor writes one), for more ungradable files than ``max_ungradable_files`` that are also more
than ``max_ungradable_fraction`` of its novel used files (each costs up to a file's grading budget; an honest
actor's grading timeouts and near ties are rare, and copies and drops are no cover), or for more files waiting
in one listing than ``max_pending_files`` (``pending_quota``: no honest actor's backlog comes near it). A ban is
written to the ledger the moment it happens (``ledger.write_ban``): a learner resumed from a checkpoint older
than the ban bans the actor again, and the record stands for every later file of it.
"""

from __future__ import annotations

import logging

from echo2.data.ledger import write_ban

log = logging.getLogger("echo2.learner")


def pending_quota(*, files_per_step: int, backlog: int, checkpoint_every: int, staleness: int) -> int:
    """``max_pending_files`` for a run: four times the most files an honest actor could have waiting in one listing
    (a backlog, plus after a resume every file of the steps and versions it went back over), at least 256."""
    return max(256, 4 * (backlog + 2 * (checkpoint_every + staleness + 1) * files_per_step))


class ActorRecord:
    """The collector's verdicts on actors; uses its ``store``, ``banned``, ``invalid_files``, ``ungradable_files``,
    ``used_files``, the bounds, ``_counted``, ``_unwritten_bans`` and ``_step``."""

    def _ban(self, actor_id: str, why: str) -> None:
        """Ban ``actor_id`` and record it in the ledger at once (a resumed learner bans it again)."""
        if actor_id in self.banned:
            return
        log.error("banning actor %s: %s", actor_id, why)
        self.banned[actor_id] = why
        self._unwritten_bans[actor_id] = why
        self._write_bans()

    def _write_bans(self) -> None:
        for actor_id, why in list(self._unwritten_bans.items()):
            write_ban(self.store, actor_id, why, self._step)
            del self._unwritten_bans[actor_id]

    def _count_invalid(self, actor_id: str, reason: str, key: str | None = None) -> None:
        """One more malformed, copied or future-version file of ``actor_id``: at ``max_invalid_files`` the actor
        is banned (like a dishonest one: the flow expels it and the next version revokes its token)."""
        if actor_id in self.banned or key in self._counted:
            return
        if key is not None:
            self._counted.add(key)
        n = self.invalid_files[actor_id] = self.invalid_files.get(actor_id, 0) + 1
        if n >= self.max_invalid_files:
            self._ban(actor_id, f"{n} invalid or future-version files (the last: {reason[:300]})")

    def _count_ungradable(self, actor_id: str, reason: str) -> None:
        """One more ungradable file of ``actor_id``: banned once they are more than ``max_ungradable_files``
        and more than ``max_ungradable_fraction`` of its novel used files (the module's docstring says why)."""
        if actor_id in self.banned:
            return
        n = self.ungradable_files[actor_id] = self.ungradable_files.get(actor_id, 0) + 1
        used = self.used_files.get(actor_id, 0)
        if n > self.max_ungradable_files and n > self.max_ungradable_fraction * used:
            self._ban(actor_id, f"{n} of its files could not be graded, against {used} novel files of it used: more "
                                f"than an honest actor's accidents (the last: {reason[:300]})")
