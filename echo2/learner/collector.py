"""Choosing the rollout files for one optimizer step: the staleness filter and validation.

At learner version t, a committed rollout file of policy version v is
- dropped if t - v > S (too stale), recorded in the ledger with the reason;
- quarantined if it fails validation: moved to ``quarantine/<key>`` beside a ``.json`` reason;
- otherwise used, oldest first, whole files at a time, until ``groups_per_step`` groups are in.

Every file is settled exactly once: the set of settled keys is part of the checkpoint, and the
ledger entry of a step is written when its files are chosen (before training), so actors see at
once that the backlog shrank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import pyarrow as pa

from echo2.data import layout
from echo2.data.ledger import write_consumed
from echo2.data.rollouts import InvalidRollouts, decode_rollouts, validate_rollouts
from echo2.data.store import NotFound, ObjectStore

log = logging.getLogger("echo2.learner")


def is_fresh(learner_version: int, rollout_version: int, staleness: int) -> bool:
    """The bounded-staleness rule: usable iff t - v <= S."""
    return learner_version - rollout_version <= staleness


@dataclass
class Selection:
    step: int
    learner_version: int
    tables: list[pa.Table] = field(default_factory=list)
    used: list[dict] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)
    quarantined: list[dict] = field(default_factory=list)
    waited_s: float = 0.0

    @property
    def groups(self) -> int:
        return sum(u["groups"] for u in self.used)

    def ledger_record(self) -> dict:
        return {"learner_version": self.learner_version, "used": self.used, "dropped": self.dropped,
                "quarantined": self.quarantined}


class RolloutCollector:
    def __init__(self, store: ObjectStore, *, run_id: str, staleness: int, groups_per_step: int,
                 group_size: int, vocab_size: int, settled: set[str] | None = None):
        self.store = store
        self.run_id = run_id
        self.staleness = staleness
        self.groups_per_step = groups_per_step
        self.group_size = group_size
        self.vocab_size = vocab_size
        self.settled: set[str] = set(settled or ())

    def _candidates(self) -> list[tuple[int, str]]:
        out = []
        for key in self.store.list("rollouts/"):
            if key in self.settled:
                continue
            v = layout.version_of_rollout_key(key)
            if v is None:
                continue
            out.append((v, key))
        return sorted(out)  # oldest version first; within a version, by actor and sequence

    def _quarantine(self, sel: Selection, key: str, reason: str) -> None:
        log.warning("quarantined %s: %s", key, reason)
        self.store.put_json(layout.quarantine_key(key) + ".json", {"key": key, "reason": reason, "at": time.time()},
                            if_absent=False)
        self.store.move(key, layout.quarantine_key(key))
        sel.quarantined.append({"key": key, "reason": reason})
        self.settled.add(key)

    def collect(self, step: int, learner_version: int, *, timeout_s: float, poll_s: float = 0.25,
                should_abort=lambda: None) -> Selection:
        """Block until enough fresh, valid groups are committed; write the step's ledger entry.

        On any error nothing is settled, so a retry sees the same files again.
        """
        settled_before = set(self.settled)
        try:
            return self._collect(step, learner_version, timeout_s=timeout_s, poll_s=poll_s, should_abort=should_abort)
        except BaseException:
            self.settled = settled_before
            raise

    def _collect(self, step: int, learner_version: int, *, timeout_s: float, poll_s: float, should_abort) -> Selection:
        sel = Selection(step=step, learner_version=learner_version)
        started = time.time()
        deadline = time.time() + timeout_s
        while sel.groups < self.groups_per_step:
            progressed = False
            for version, key in self._candidates():
                if sel.groups >= self.groups_per_step:
                    break
                progressed = True
                if not is_fresh(learner_version, version, self.staleness):
                    lag = learner_version - version
                    sel.dropped.append({"key": key, "policy_version": version, "lag": lag,
                                        "reason": f"stale: lag {lag} > S={self.staleness}"})
                    self.settled.add(key)
                    continue
                try:
                    data = self.store.get(key)
                except NotFound:
                    continue  # moved away by a concurrent quarantine; gone from the next listing
                try:
                    table = decode_rollouts(data)
                    validate_rollouts(table, run_id=self.run_id, expected_version=version,
                                      learner_version=learner_version, vocab_size=self.vocab_size,
                                      group_size=self.group_size)
                except InvalidRollouts as exc:
                    self._quarantine(sel, key, str(exc))
                    continue
                groups = len(set(table.column("group_id").to_pylist()))
                sel.tables.append(table)
                sel.used.append({"key": key, "policy_version": version, "lag": learner_version - version,
                                 "groups": groups, "rows": table.num_rows})
                self.settled.add(key)
            if sel.groups >= self.groups_per_step:
                break
            should_abort()
            if time.time() > deadline:
                raise TimeoutError(
                    f"no usable rollouts for {timeout_s:.0f}s at step {step} (have {sel.groups}/"
                    f"{self.groups_per_step} groups): are the actors alive? see the run's logs/"
                )
            if not progressed:
                time.sleep(poll_s)
        write_consumed(self.store, step, sel.ledger_record())
        sel.waited_s = time.time() - started
        return sel
