"""Choosing the rollout files for one optimizer step: the staleness filter and validation.

At learner version t, a committed rollout file of policy version v is
- dropped if t - v > S (too stale), recorded in the ledger with the reason;
- dropped if the same content was already used under another name (content hash in the ledger);
- quarantined if it fails validation: moved to ``quarantine/<key>`` beside a ``.json`` reason.
  A file that cannot be read or decoded fails it too, whatever the error (a GLACIER object, one the
  store refuses, bytes that exhaust the decoder): only the store being down (``store.is_transient``),
  or an error that reading the learner's own ``run.json`` shares, propagates, so an outage never
  quarantines honest files. A file is read once, after its size check, and never past
  ``max_file_bytes`` (a bounded ranged read: a file replaced by a bigger one is not read whole).
  Quarantine never reads a file (``data/quarantine.py``): a server-side copy, then a delete; where the
  store cannot copy it either (S3 will not copy a GLACIER object), *by reference*: the file stays where
  it is, its reason record says so, and the ledger's ``quarantined`` section settles it like any other
  (no step reads it, no actor counts it as pending again; a resumed learner records it unread).
  Validation bounds everything the loss relies on (``data/rollouts.py``), re-derives every prompt
  from the task and re-scores verifiable rewards (``verify.py``), and spot-checks behavior logprobs
  (``behavior_audit.py``); a file whose claims are false (``Dishonest``) also bans its actor, whose
  later files are quarantined unread, and so do ``max_invalid_files`` (``train.max_invalid_files_per_actor``)
  malformed files (``Malformed``: unreadable, too large, failing validation, more groups than a batch)
  or files from the future, which no honest actor writes (a file the task could not grade the same
  way everywhere does not count there);
- quarantined if the task could not grade it the same way everywhere (``UngradableFile``: a reply that
  timed out on the learner's grader, a poker replay that parts from the file after a near tie). One
  such file is an honest accident, so it is not held against its actor; many are not: each costs the
  learner up to ``grade_file_max_timeouts`` x ``grade_timeout_s`` of grading (files of one hanging
  reply each would cost ``grade_timeout_s`` apiece, without end), so an actor is banned once its ungradable
  files are both more than ``max_ungradable_files`` (``train.max_ungradable_files_per_actor``) and
  more than ``max_ungradable_fraction`` of its files the learner judged. Honest actors stay far
  below: a timeout on an honest reply (about 2 ms of grading against a limit of seconds) or a replay
  parting at a near tie is rare, and is a small share of an actor's files however long the run. An
  actor that hides hanging files among good ones below that share is not banned, but it pays for them
  with real rollouts, and the cost it puts on the learner stays a bounded share of grading;
- quarantined unread if its version is from the future (t < v: no such policy exists yet; found by a
  poll up to t + 1, beyond by the periodic sweep or when the run finishes: ``final_leftovers``);
- otherwise used, oldest first, whole files at a time, until ``groups_per_step`` groups are in.

A poll lists only the version folders a step can still use (and, once, the ones that just fell out of
the window) and the next one (t + 1: a file there is from the future, judged at once), each by its name,
so no folder beyond t + 1 costs a poll anything however many an actor makes; those hold only junk and are
looked at in a periodic full sweep (which quarantines what they hold), every ``FULL_SWEEP_EVERY`` collections or, once
there are more version folders than that, every as many collections as there are folders: the sweep's
cost grows with the folders, its period too, so a step's share stays flat however long the run and
however many files older versions hold (the final entry sweeps everything anyway).

While a collection waits for more groups, ``layout.COLLECTING`` tells the actors what it has judged so
far (files dropped, or used by the step), and whose files it found junk, so their flow control never
waits on files the learner will not use (``ledger.ConsumedIndex.backlog``). It fails with ``NoRollouts``
after ``timeout_s`` without a usable file: junk judged meanwhile is no sign of a live fleet.

The ledger entry of a step is written when its files are chosen (before training), so actors see
at once that the backlog shrank. The files stay "in flight" until the step completes
(``settle``): the checkpoint records only what completed steps settled, so a learner killed
between choosing and training uses the same files again after resume (and resume moves the
step's ledger entry aside with the rest of the lost timeline, so the ledger shows them once).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import pyarrow as pa

from echo2.data import layout
from echo2.data.failpoints import failpoint
from echo2.data.ledger import collecting_record, pending_rollouts, used_measurements, write_consumed
from echo2.data.quarantine import quarantine
from echo2.data.rollouts import (
    InvalidRollouts,
    RolloutLimits,
    content_hash,
    decode_rollouts,
    file_policy_digest,
    policy_digest,
    validate_rollouts,
)
from echo2.data.store import NotFound, ObjectStore, is_transient
from echo2.learner.behavior_audit import Dishonest

log = logging.getLogger("echo2.learner")


FULL_SWEEP_EVERY = 16
"""Every this many collections, every version folder is listed again (late files into old folders)."""


class UngradableFile(InvalidRollouts):
    """The task could not score the file the same way on every machine (``tasks.base.Ungradable``, as the
    verifier reports it): set aside, not held against its actor unless it keeps happening (the module's
    docstring: ``max_ungradable_files``)."""


class NoRollouts(TimeoutError):
    """No usable rollouts arrived within ``train.rollout_timeout_s``: not a transient store error."""


class Malformed(InvalidRollouts):
    """The file itself is wrong, as no honest actor's file is (unreadable, over the size limit, undecodable,
    failing validation): counts toward its actor's expulsion (``max_invalid_files``). Not raised for a file
    the task's checks reject (``Dishonest`` bans at once; a file the task could not grade the same way on
    every machine is set aside without counting)."""


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
    list_seconds: float = 0.0
    """Time spent listing the backlog (what must not grow with the files older versions hold)."""

    @property
    def groups(self) -> int:
        return sum(u["groups"] for u in self.used)

    @property
    def keys(self) -> set[str]:
        return {item["key"] for section in (self.used, self.dropped, self.quarantined) for item in section}

    def ledger_record(self) -> dict:
        return {"learner_version": self.learner_version, "used": self.used, "dropped": self.dropped,
                "quarantined": self.quarantined}


class RolloutCollector:
    def __init__(self, store: ObjectStore, *, run_id: str, staleness: int, groups_per_step: int,
                 limits: RolloutLimits, verifier=None, max_file_bytes: int = 64 * 2**20,
                 settled: set[str] | None = None, used_hashes: set[str] | None = None, auditor=None,
                 banned: dict[str, str] | None = None, max_invalid_files: int = 3,
                 max_ungradable_files: int = 5, max_ungradable_fraction: float = 0.25,
                 lost_timelines: list[tuple[int, set[str], int | None]] | None = None):
        self.store = store
        self.lost_timelines = list(lost_timelines or ())
        """(step resumed from, actors launched before that resume, the newest version the lost timeline published or
        None), one per resume: a file such an actor
        commits in a folder after that step is of the timeline the resume lost (its weights were not the
        new timeline's of the same number), dropped with that reason, never used; unless it names this
        timeline's signed manifest of its version (``rollouts.POLICY_DIGEST_KEY``: an adopted actor that moved to
        the new timeline). A file of such an actor from a version the learner has not reached is dropped the
        same way (not quarantined as from the future: the actor was on the dead learner's newer versions), up to
        the newest version the lost timeline published: one beyond it is from the future (quarantined, counted)."""
        self._digests: dict[int, str] = {}
        self.run_id = run_id
        self.staleness = staleness
        self.groups_per_step = groups_per_step
        self.limits = limits
        self.verifier = verifier
        self.max_file_bytes = max_file_bytes
        self.auditor = auditor
        """``behavior_audit.BehaviorAuditor`` (or None): spot checks of the behavior logprobs."""
        self.banned: dict[str, str] = dict(banned or {})
        """Actors caught with a dishonest file, or with ``max_invalid_files`` malformed or future-version
        ones, and why: every later file of theirs is quarantined unread (and the flow expels and revokes them)."""
        self.max_invalid_files = max_invalid_files
        self.invalid_files: dict[str, int] = {}
        """Per actor: its files quarantined as ``Malformed`` or from the future (no honest actor writes one)."""
        self.max_ungradable_files = max_ungradable_files
        self.max_ungradable_fraction = max_ungradable_fraction
        self.ungradable_files: dict[str, int] = {}
        """Per actor: its files the task could not grade the same way everywhere (``UngradableFile``)."""
        self.judged_files: dict[str, int] = {}
        """Per actor: its files read and judged (used or quarantined after reading), the share's denominator."""
        self.settled: set[str] = set(settled or ())
        """Keys settled by completed steps (what a checkpoint records)."""
        self.used_hashes: set[str] = set(used_hashes or ())
        """Content hashes of the files completed steps used."""
        self.in_flight: set[str] = set()
        """Keys chosen by a step that has not completed yet (never chosen twice, not yet checkpointed)."""
        self._listed_from: int | None = None
        """The oldest version folder a poll still lists: folders older than the staleness window are swept
        once (their files dropped as stale), then left to the periodic full sweep (``FULL_SWEEP_EVERY``)."""
        self._since_sweep: int | None = None  # collections since the last full sweep (None: none yet)
        self._sweep_every = FULL_SWEEP_EVERY
        # files quarantined by a step that never completed (the learner was killed): their ledger
        # entry went to orphaned/, so the next entry records them again from quarantine/'s reasons
        self._unrecorded: list[dict] = self._quarantined_unsettled()
        # one quarantined by reference still lies among the rollouts: the next entry records it, unread
        self.in_flight |= {item["key"] for item in self._unrecorded}

    def _quarantined_unsettled(self) -> list[dict]:
        out = []
        for reason_key in self.store.list(layout.QUARANTINE):
            key = layout.quarantined_of_reason_key(reason_key)
            if key is None or key in self.settled:
                continue
            try:
                reason = str(self.store.get_json(reason_key).get("reason", "?"))
            except (NotFound, ValueError, AttributeError):
                reason = "?"
            out.append({"key": key, "reason": reason})
        return out

    def _quarantine(self, sel: Selection, key: str, reason: str) -> None:
        log.warning("quarantined %s: %s", key, reason)
        quarantine(self.store, key, reason)
        sel.quarantined.append({"key": key, "reason": reason})

    def _lost_after(self, version: int, actor_id: str, *, published: bool = False) -> int | None:
        """The step of the first resume after which a file of ``actor_id`` in ``version`` may be of a lost timeline
        (the actor was launched before that resume and ``version`` is past its checkpoint), else None; with
        ``published``, only where that timeline published ``version`` (a lost timeline has no versions beyond its
        newest: an actor cannot have generated with one)."""
        for step, actors, *rest in self.lost_timelines:
            newest = rest[0] if rest else None
            if version > step and actor_id in actors and not (published and newest is not None and version > newest):
                return step
        return None

    def _timeline_digest(self, version: int) -> str | None:
        """``rollouts.policy_digest`` of this timeline's manifest of ``version`` (None: none published). One
        learner's manifests are never replaced (only a resume does that, with a new collector): kept once read."""
        if version not in self._digests:
            try:
                self._digests[version] = policy_digest(self.store.get_json(
                    layout.manifest_key(layout.policy_dir(version))))
            except (NotFound, ValueError):
                return None
        return self._digests[version]

    def _check(self, key: str, version: int, actor_id: str, learner_version: int,
               data: bytes | None = None) -> pa.Table:
        """Download (unless ``data`` was) and validate one file; raises ``InvalidRollouts`` (or ``NotFound`` if it
        vanished)."""
        data = self._read(key) if data is None else data
        try:
            table = validate_rollouts(decode_rollouts(data), run_id=self.run_id, actor_id=actor_id,
                                      expected_version=version, learner_version=learner_version, limits=self.limits)
        except InvalidRollouts as exc:
            raise Malformed(str(exc)) from None
        except Exception as exc:  # a function of the actor's bytes alone (a MemoryError, say): the file's fault
            raise Malformed(f"undecodable: {type(exc).__name__}: {str(exc)[:200]}") from None
        if self.verifier is not None:
            try:
                self.verifier.check(table)
            except Dishonest:
                raise
            except InvalidRollouts as exc:  # the verifier's only other refusal: the task could not grade it
                raise UngradableFile(str(exc)) from None
        if self.auditor is not None and self.auditor.wants(actor_id):
            self.auditor.check(table, version, actor_id)
        return table

    def _read(self, key: str) -> bytes:
        """The bytes of an actor's file, at most ``max_file_bytes`` of them: the size first (a HEAD),
        then one ranged read that stops one byte past the limit. Errors: see the module docstring."""
        try:
            size = self.store.size(key)
            if size > self.max_file_bytes:
                raise Malformed(f"file of {size} bytes is over the limit of {self.max_file_bytes}")
            data = self.store.get_range(key, 0, self.max_file_bytes + 1) if size else b""
        except (InvalidRollouts, NotFound):
            raise
        except Exception as exc:
            if is_transient(exc) or not self._store_answers():
                raise
            raise Malformed(f"unreadable: {type(exc).__name__}: {str(exc)[:200]}") from None
        if len(data) > self.max_file_bytes:  # replaced by a bigger object between the size check and the read
            raise Malformed(f"file of more than {self.max_file_bytes} bytes is over the limit")
        return data

    def _store_answers(self) -> bool:
        """Whether the store still answers the learner about its own ``run.json`` (there or not): if it
        does not, a failed read of an actor's file says nothing about the file."""
        try:
            self.store.size(layout.RUN_JSON)
        except NotFound:
            pass
        except Exception:  # any failure: the caller raises the file's error instead of blaming the file
            return False
        return True

    def collect(self, step: int, learner_version: int, *, timeout_s: float, poll_s: float = 0.25,
                should_abort=lambda: None) -> Selection:
        """Block until enough fresh, valid groups are committed; write the step's ledger entry.

        The chosen files are in flight until ``settle``; on any error nothing is, so a retry sees the
        same files again (a file already moved to quarantine stays recorded for the next entry).
        """
        sel = Selection(step=step, learner_version=learner_version)
        sel.quarantined.extend(self._unrecorded)
        started = time.time()
        deadline = time.time() + timeout_s  # moved on by every usable file: junk judged meanwhile is no sign of life
        taken: set[str] = set()
        hashes: set[str] = set()
        # a file a slow actor commits late into an old folder is found by the next full sweep (or at the end);
        # a poll looks no further than the version after the learner's (a file there is from the future, judged
        # at once): no honest file lies beyond, so what does is junk, left to the sweep
        sweep = self._since_sweep is None or self._since_sweep >= self._sweep_every
        oldest, newest = (None, None) if sweep else (self._listed_from, learner_version + 1)
        shown = collecting_record(step, {})  # what the actors were last told of this collection
        while sel.groups < self.groups_per_step:
            progressed = False
            listed = time.time()
            pending = pending_rollouts(self.store, self.settled | self.in_flight | taken, oldest, newest)
            sel.list_seconds += time.time() - listed
            for version, key in [p for p in pending if p[0] > learner_version]:
                # no policy of a version from the future exists: judged at once by its key, unread (and never
                # left pending to be listed at every poll while honest files keep arriving)
                taken.add(key)
                lost = self._lost_after(version, layout.parse_rollout_key(key)[1], published=True)
                if lost is not None:  # an adopted actor still on the dead learner's newer versions: not junk
                    sel.dropped.append({"key": key, "policy_version": version, "reason": (
                        f"lost timeline: generated with v{version} of the timeline lost at the resume from "
                        f"step {lost}")})
                    continue
                reason = f"version {version} is from the future (the learner is at {learner_version})"
                self._quarantine(sel, key, reason)
                self._count_invalid(layout.parse_rollout_key(key)[1], reason)
            for version, key in [p for p in pending if p[0] <= learner_version]:
                if sel.groups >= self.groups_per_step:
                    break
                progressed = True
                taken.add(key)
                _, actor_id, _ = layout.parse_rollout_key(key)
                lost = self._lost_after(version, actor_id)
                data = None
                if lost is not None:
                    try:
                        data = self._read(key)
                    except NotFound:
                        taken.discard(key)
                        continue
                    except InvalidRollouts:
                        data = None
                    named = file_policy_digest(data) if data is not None else None
                    if named is None or named != self._timeline_digest(version):  # None: a file from before the field
                        sel.dropped.append({"key": key, "policy_version": version, "reason": (
                            f"lost timeline: actor {actor_id} generated it with a v{version} other than this "
                            f"timeline's (resume from step {lost})")})
                        continue
                if not is_fresh(learner_version, version, self.staleness):
                    lag = learner_version - version
                    sel.dropped.append({"key": key, "policy_version": version, "lag": lag,
                                        "reason": f"stale: lag {lag} > S={self.staleness}"})
                    continue
                if actor_id in self.banned:
                    self._quarantine(sel, key, f"actor {actor_id} is banned: {self.banned[actor_id]}")
                    continue
                try:
                    table = self._check(key, version, actor_id, learner_version, data)
                except NotFound:
                    taken.discard(key)
                    continue  # moved away meanwhile; gone from the next listing
                except InvalidRollouts as exc:
                    self.judged_files[actor_id] = self.judged_files.get(actor_id, 0) + 1
                    if isinstance(exc, Dishonest):
                        log.error("banning actor %s: %s", actor_id, exc)
                        self.banned[actor_id] = str(exc)
                    self._quarantine(sel, key, str(exc))
                    if isinstance(exc, Malformed):
                        self._count_invalid(actor_id, str(exc))
                    if isinstance(exc, UngradableFile):
                        self._count_ungradable(actor_id, str(exc))
                    continue
                self.judged_files[actor_id] = self.judged_files.get(actor_id, 0) + 1
                digest = content_hash(table)
                if digest in self.used_hashes or digest in hashes:
                    sel.dropped.append({"key": key, "policy_version": version, "sha256": digest,
                                        "reason": "duplicate: the same rollouts were already used under another name"})
                    continue
                hashes.add(digest)
                sel.tables.append(table)
                sel.used.append({"key": key, "policy_version": version, "lag": learner_version - version,
                                 "groups": len(table.column("group_id").unique()), "rows": table.num_rows,
                                 "sha256": digest, "measured": used_measurements(table)})
                deadline = time.time() + timeout_s
            if sel.groups >= self.groups_per_step:
                break
            shown = self._show_progress(sel, shown)
            should_abort()
            if time.time() > deadline:
                raise NoRollouts(
                    f"no usable rollouts for {timeout_s:.0f}s at step {step} (have {sel.groups}/"
                    f"{self.groups_per_step} groups): are the actors alive? see the run's logs/"
                )
            if not progressed:
                time.sleep(poll_s)
        write_consumed(self.store, step, sel.ledger_record())
        self._listed_from = max(0, learner_version - self.staleness)  # what is older was swept by this collection
        if sweep:
            self._since_sweep = 0
            self._sweep_every = max(FULL_SWEEP_EVERY, learner_version + 1)  # about the number of version folders
        self._since_sweep += 1
        failpoint("step")
        self._unrecorded = []
        sel.waited_s = time.time() - started
        self.in_flight |= sel.keys
        return sel

    def _count_invalid(self, actor_id: str, reason: str) -> None:
        """One more malformed or future-version file of ``actor_id``: at ``max_invalid_files`` the actor is
        banned (like a dishonest one: the flow expels it and the next version revokes its token)."""
        if actor_id in self.banned:
            return
        n = self.invalid_files[actor_id] = self.invalid_files.get(actor_id, 0) + 1
        if n >= self.max_invalid_files:
            why = f"{n} invalid or future-version files (the last: {reason[:300]})"
            log.error("banning actor %s: %s", actor_id, why)
            self.banned[actor_id] = why

    def _count_ungradable(self, actor_id: str, reason: str) -> None:
        """One more ungradable file of ``actor_id``: banned once they are more than ``max_ungradable_files``
        and more than ``max_ungradable_fraction`` of its judged files (the module's docstring says why)."""
        if actor_id in self.banned:
            return
        n = self.ungradable_files[actor_id] = self.ungradable_files.get(actor_id, 0) + 1
        judged = self.judged_files.get(actor_id, n)
        if n > self.max_ungradable_files and n > self.max_ungradable_fraction * judged:
            why = (f"{n} of its {judged} files could not be graded, more than an honest actor's accidents "
                   f"(the last: {reason[:300]})")
            log.error("banning actor %s: %s", actor_id, why)
            self.banned[actor_id] = why

    def _show_progress(self, sel: Selection, shown: dict) -> dict:
        """Tell the actors what this collection has judged so far while it waits (``layout.COLLECTING``):
        their flow control must not count files judged here (dropped, or used by a step still short of
        groups) as a backlog, nor wait for the files of an actor found sending junk, or junk a step never
        uses would stop the very actors the step waits for. Written only when it changed."""
        record = collecting_record(sel.step, sel.ledger_record())
        if record != shown:
            self.store.put_pointer(layout.COLLECTING, json.dumps(record).encode())
        return record

    def settle(self, selection: Selection) -> None:
        """The step that used ``selection`` completed: its files are settled for good."""
        self.settled |= selection.keys
        self.used_hashes |= {u["sha256"] for u in selection.used}
        self.in_flight -= selection.keys

    def final_leftovers(self, learner_version: int) -> tuple[list[str], list[dict]]:
        """What the run leaves when it finishes, for the final ledger entry: the committed files no step
        settled, unused, but those of versions beyond the learner's last one quarantined as from the future
        (no honest actor wrote them; a poll never looks beyond t + 1, so the periodic sweep may not have
        come round to them). Returns (unused keys, quarantined items)."""
        sel = Selection(step=0, learner_version=learner_version)
        unused = []
        for version, key in pending_rollouts(self.store, self.settled):
            if version <= learner_version:
                unused.append(key)
                continue
            reason = f"version {version} is from the future (the run finished at {learner_version})"
            try:
                self._quarantine(sel, key, reason)
            except NotFound:
                continue  # moved away meanwhile
            self._count_invalid(layout.parse_rollout_key(key)[1], reason)
        return unused, sel.quarantined
