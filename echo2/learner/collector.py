"""Choosing the rollout files for one optimizer step: the staleness filter and validation.

At learner version t, a committed rollout file of policy version v is
- dropped if t - v > S (too stale), recorded in the ledger with the reason, unread;
- dropped, and held against its actor, if its bytes are a copy of a file the learner already read under
  another name (their sha256, taken before anything decodes, validates or grades them): no honest actor commits
  one batch twice, so a byte-for-byte copy (padding, a flood of copies) costs one bounded read and counts
  toward ``max_invalid_files``; a file whose rollouts were used already in other bytes is dropped uncounted;
- quarantined if it fails validation (``file_checks.py``: unreadable or undecodable whatever the error, over
  ``max_file_bytes``, out of the schema's bounds, prompts or rewards the task disowns, behavior logprobs the
  spot check disproves): moved to ``quarantine/<key>`` beside a ``.json`` reason, server-side and unread
  (``data/quarantine.py``), or *by reference* where the store cannot copy it (a GLACIER object stays where it
  is; its reason record and the ledger settle it). A dishonest file (``Dishonest``) bans its actor, and so do
  ``max_invalid_files`` malformed files (``Malformed``, a byte copy included) or files from the future;
- quarantined if the task could not grade it the same way everywhere (``UngradableFile``). One such file
  is an honest accident, not held against its actor; an actor is banned once its ungradable files are more
  than ``max_ungradable_files`` and more than ``max_ungradable_fraction`` of its *novel used* files (copies
  and drops are no cover: each hanging file costs up to a file's grading budget);
- quarantined unread if its version is from the future (t < v: no such policy exists yet), found by a poll
  up to t + 1, beyond by the sweep (``sweep.py``) or when the run finishes (``final_leftovers``);
- judged by the timeline it may belong to if a resume lost its version (``timelines.py``): a well-formed file
  of an actor the dead learner launched, naming the lost timeline's manifest (or none), is dropped as "lost
  timeline", within an allowance per actor; any other is judged as a file of this run;
- otherwise used, oldest first, whole files at a time, until ``groups_per_step`` groups are in.

What one actor can make the learner do is bounded. Once it is banned (``bans.py``: recorded in the ledger at
once, and at a listing that shows more of its files than ``max_pending_files``) none of its files is judged, moved
or recorded one by one: the janitor deletes them off the collection's path (``sweep.Janitor``). One collection
reads at most ``max_judged_per_actor`` files of an actor, and the sweep's files cost it at most ``sweep_files``
reads or quarantines (the rest wait for the next). ``NoRollouts`` is raised after ``timeout_s``
without a usable file, checked after every file judged, so a pass through junk cannot outlast it; and while a
collection waits or judges, ``layout.COLLECTING`` tells the actors what it has judged so far and whose files it
found junk (``ledger.ConsumedIndex.backlog``), rewritten at least every ``progress_every_s`` as a sign of life.

The ledger entry of a step is written when its files are chosen (before training), so actors see
at once that the backlog shrank. The files stay "in flight" until the step completes
(``settle``): the checkpoint records only what completed steps settled, so a learner killed
between choosing and training uses the same files again after resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa

from echo2.data import layout
from echo2.data.failpoints import failpoint
from echo2.data.ledger import collecting_record, pending_rollouts, used_measurements, write_consumed
from echo2.data.quarantine import quarantine
from echo2.data.rollouts import InvalidRollouts, RolloutLimits, content_hash, file_policy_digest
from echo2.data.store import NotFound, ObjectStore
from echo2.learner.bans import ActorRecord, pending_quota
from echo2.learner.file_checks import FileChecks, Malformed, UngradableFile
from echo2.learner.spot_check import Dishonest
from echo2.learner.sweep import FULL_SWEEP_EVERY, Janitor, Sweep
from echo2.learner.timelines import LostTimeline

log = logging.getLogger("echo2.learner")

__all__ = ["FULL_SWEEP_EVERY", "Malformed", "NoRollouts", "RolloutCollector", "Selection", "UngradableFile",
           "is_fresh", "pending_quota", "quarantine"]

SWEEP_FILES = 64
"""Reads or quarantines the sweep's files may cost in one collection; the rest wait for the next."""
PROGRESS_EVERY_S = 30.0
MAX_PENDING_FILES = 1024
BYTES_PREFIX = "bytes:"
"""Marks, in ``used_hashes``, the sha256 of a used file's bytes (beside the hashes of its rollouts)."""


class NoRollouts(TimeoutError):
    """No usable rollouts arrived within ``train.rollout_timeout_s``: not a transient store error."""


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
    banned: list[str] = field(default_factory=list)
    """Every actor banned when the entry was written (their later files are in no entry: ``sweep.Janitor``)."""
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
                "quarantined": self.quarantined, **({"banned": self.banned} if self.banned else {})}


@dataclass
class _Pass:
    """One collection's bookkeeping."""
    deadline: float
    shown: dict
    shown_at: float
    taken: set[str] = field(default_factory=set)
    deferred: set[str] = field(default_factory=set)
    """Files left for the next collection (their actor's reads, or the sweep's, are spent for this one)."""
    judged: Counter = field(default_factory=Counter)
    hashes: set[str] = field(default_factory=set)
    sweep_cost: int = 0


class RolloutCollector(FileChecks, ActorRecord):
    def __init__(self, store: ObjectStore, *, run_id: str, staleness: int, groups_per_step: int,
                 limits: RolloutLimits, verifier=None, max_file_bytes: int = 64 * 2**20,
                 settled: set[str] | None = None, used_hashes: set[str] | None = None,
                 spot_checker=None, banned: dict[str, str] | None = None,
                 max_invalid_files: int = 3, max_ungradable_files: int = 5, max_ungradable_fraction: float = 0.25,
                 lost_timelines: list[LostTimeline | tuple] | None = None, max_judged_per_actor: int | None = None,
                 max_pending_files: int = MAX_PENDING_FILES, backlog_batches: int = 2,
                 progress_every_s: float = PROGRESS_EVERY_S, sweep_files: int = SWEEP_FILES):
        self.store = store
        self.run_id, self.staleness, self.groups_per_step, self.limits = run_id, staleness, groups_per_step, limits
        self.verifier = verifier
        self.max_file_bytes = max_file_bytes
        self.spot_checker = spot_checker
        """``spot_check.SpotChecker`` (or None): spot checks of the behavior logprobs."""
        self.lost_timelines = [LostTimeline.of(t) for t in lost_timelines or ()]
        self.banned: dict[str, str] = dict(banned or {})
        """Actors banned, and why: none of their later files is judged (and the flow expels and revokes them)."""
        self.max_invalid_files = max_invalid_files
        self.invalid_files: dict[str, int] = {}
        """Per actor: its files quarantined as ``Malformed``, from the future, or byte copies."""
        self.max_ungradable_files = max_ungradable_files
        self.max_ungradable_fraction = max_ungradable_fraction
        self.ungradable_files: dict[str, int] = {}
        self.judged_files: dict[str, int] = {}
        """Per actor: its files read and judged."""
        self.used_files: dict[str, int] = {}
        """Per actor: its files used whose rollouts were new (the ungradable share's denominator)."""
        per_file = self.limits.max_groups or 1
        self.files_per_step = -(-groups_per_step // per_file)
        self.max_judged_per_actor = max_judged_per_actor or (groups_per_step + max_invalid_files
                                                             + max_ungradable_files)
        self.max_pending_files = max_pending_files
        self.backlog_batches = backlog_batches
        self.progress_every_s = progress_every_s
        self.sweep_files = sweep_files
        self.settled: set[str] = set(settled or ())
        """Keys settled by completed steps (what a checkpoint records)."""
        self.used_hashes: set[str] = set(used_hashes or ())
        """Content hashes of the files completed steps used, and the sha256 of their bytes (``BYTES_PREFIX``): what a
        checkpoint records, so a resumed learner knows a copy of them too."""
        self.used_bytes: dict[str, str | None] = {h[len(BYTES_PREFIX):]: None for h in self.used_hashes
                                                  if h.startswith(BYTES_PREFIX)}
        """sha256 of the bytes of each file completed steps used -> its content hash (None: restored, not known)."""
        self.in_flight: set[str] = set()
        """Keys chosen by a step that has not completed yet (never chosen twice, not yet checkpointed)."""
        self._seen: dict[str, tuple[str, str | None]] = {}  # bytes' sha256 -> (first key read, content hash if used)
        self._counted: set[str] = set()  # keys held against their actor already (a retried collection)
        self._lost_drops: Counter = Counter()  # (resume step, actor) -> files dropped as of that lost timeline
        self._digests: dict[int, str] = {}
        self._listed_from: int | None = None
        """The oldest version folder a poll still lists: older ones are the sweep's, once swept this once."""
        self.sweep = Sweep(store)
        self._sweep_backlog: list[tuple[int, str]] = []
        self.janitor = Janitor(store)
        self._unwritten_bans: dict[str, str] = {}
        self._step = 0
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

    def _lost(self, version: int, actor_id: str, *, published: bool = False) -> LostTimeline | None:
        """The first lost timeline a file of ``actor_id`` in ``version`` may be of (``LostTimeline.claims``)."""
        return next((t for t in self.lost_timelines if t.claims(version, actor_id, published=published)), None)

    def _judge(self, sel: Selection, p: _Pass, version: int, key: str, actor_id: str, learner_version: int,
               lost: LostTimeline | None) -> None:
        """Read one file and judge it: a byte copy, a file of a lost timeline, or a file of this one."""
        p.judged[actor_id] += 1
        self.judged_files[actor_id] = self.judged_files.get(actor_id, 0) + 1
        try:
            data = self._read(key)
            raw = hashlib.sha256(data).hexdigest()
            first, content = self._seen.get(raw, (key, None))
            if raw in self.used_bytes or first != key:
                sel.dropped.append({"key": key, "policy_version": version, "bytes_sha256": raw,
                                    "sha256": self.used_bytes.get(raw) or content or raw, "reason": (
                                        f"duplicate: a byte-for-byte copy of {first if first != key else 'a used file'}"
                                        ", which no honest actor commits")})
                self._count_invalid(actor_id, f"a byte-for-byte copy of {first}", key)
                return
            self._seen[raw] = (key, None)
            if lost is not None:
                named = file_policy_digest(data)
                if version > learner_version or named is None or named != self._timeline_digest(version):
                    self._judge_lost(sel, version, key, actor_id, data, lost, named)
                    return
            table = self._check(data, version, actor_id, learner_version)
        except NotFound:
            p.taken.discard(key)  # moved away meanwhile; gone from the next listing
            return
        except InvalidRollouts as exc:
            self._reject(sel, key, actor_id, exc)
            return
        digest = content_hash(table)
        if digest in self.used_hashes or digest in p.hashes:
            sel.dropped.append({"key": key, "policy_version": version, "sha256": digest,
                                "reason": "duplicate: the same rollouts were already used under another name"})
            return
        p.hashes.add(digest)
        self._seen[raw] = (key, digest)
        self.used_files[actor_id] = self.used_files.get(actor_id, 0) + 1
        sel.tables.append(table)
        sel.used.append({"key": key, "policy_version": version, "lag": learner_version - version,
                         "groups": len(table.column("group_id").unique()), "rows": table.num_rows,
                         "sha256": digest, "bytes_sha256": raw, "measured": used_measurements(table)})
        p.deadline = time.time() + self._timeout_s

    def _judge_lost(self, sel: Selection, version: int, key: str, actor_id: str, data: bytes, lost: LostTimeline,
                    named: str | None) -> None:
        """A file that may be of the timeline ``lost``: dropped if it earns it (``timelines.py``); else raises
        ``Malformed``."""
        self._decode(data, actor_id, version, max(version, lost.step))
        if not lost.names_it(version, named):
            raise Malformed(f"it names a v{version} manifest ({named}) that neither this timeline nor the one lost at "
                            f"the resume from step {lost.step} signed")
        allowance = lost.allowance(self.files_per_step, self.backlog_batches, self.staleness)
        self._lost_drops[lost.step, actor_id] += 1
        if self._lost_drops[lost.step, actor_id] > allowance:
            raise Malformed(f"more files of the timeline lost at the resume from step {lost.step} than actor "
                            f"{actor_id} could have made ({allowance})")
        sel.dropped.append({"key": key, "policy_version": version, "reason": (
            f"lost timeline: actor {actor_id} generated it with a v{version} other than this timeline's "
            f"(resume from step {lost.step})")})

    def _reject(self, sel: Selection, key: str, actor_id: str, exc: InvalidRollouts) -> None:
        if isinstance(exc, Dishonest):
            self._ban(actor_id, str(exc))
        self._quarantine(sel, key, str(exc))
        if isinstance(exc, Malformed):
            self._count_invalid(actor_id, str(exc), key)
        if isinstance(exc, UngradableFile):
            self._count_ungradable(actor_id, str(exc))

    def _judge_future(self, sel: Selection, p: _Pass, version: int, key: str, actor_id: str,
                      learner_version: int) -> None:
        """A file of a version the learner has not reached: of a lost timeline (read and judged as such), else
        junk, quarantined unread (no such policy exists yet)."""
        lost = self._lost(version, actor_id, published=True)
        if lost is not None:
            self._judge(sel, p, version, key, actor_id, learner_version, lost)
            return
        reason = f"version {version} is from the future (the learner is at {learner_version})"
        try:
            self._quarantine(sel, key, reason)
        except NotFound:
            p.taken.discard(key)
            return
        self._count_invalid(actor_id, reason, key)

    # -- a collection ---------------------------------------------------------------------------
    def collect(self, step: int, learner_version: int, *, timeout_s: float, poll_s: float = 0.25,
                should_abort=lambda: None) -> Selection:
        """Block until enough fresh, valid groups are committed; write the step's ledger entry.

        The chosen files are in flight until ``settle``; on any error nothing is, so a retry sees the
        same files again (a file already moved to quarantine stays recorded for the next entry).
        """
        sel = Selection(step=step, learner_version=learner_version)
        sel.quarantined.extend(self._unrecorded)
        started = time.time()
        self._timeout_s, self._step = timeout_s, step
        p = _Pass(deadline=started + timeout_s, shown=collecting_record(step, {}), shown_at=started)
        oldest = max(0, learner_version - self.staleness) if self._listed_from is None else self._listed_from
        window = range(oldest, learner_version + 2)
        first = True
        try:
            while sel.groups < self.groups_per_step:
                listed = time.time()
                pending = pending_rollouts(self.store, self.settled | self.in_flight | p.taken | p.deferred,
                                           window.start, window.stop - 1)
                swept = self._sweep_items(window) if first else []
                sel.list_seconds += time.time() - listed
                first = False
                pending, swept = self._screen(p, pending), self._screen(p, swept)
                for version, key in swept:
                    self._judge_swept(sel, p, version, key, learner_version, should_abort)
                progressed = self._poll(sel, p, pending, learner_version, should_abort)
                if sel.groups >= self.groups_per_step:
                    break
                self._show_progress(sel, p)
                self._on_time(sel, p, should_abort)
                if not progressed:
                    time.sleep(poll_s)
            self._write_bans()
            sel.banned = sorted(self.banned)
            write_consumed(self.store, step, sel.ledger_record())
        except BaseException:
            self._unrecorded = list(sel.quarantined)  # moved already: the next entry records them
            self.in_flight |= {item["key"] for item in self._unrecorded}
            raise
        self._listed_from = max(0, learner_version - self.staleness)  # what is older was swept by this collection
        self.sweep.collected()
        failpoint("step")
        self._unrecorded = []
        sel.waited_s = time.time() - started
        self.in_flight |= sel.keys
        return sel

    def _sweep_items(self, window: range) -> list[tuple[int, str]]:
        items, self._sweep_backlog = self._sweep_backlog, []
        if self.sweep.due:
            items += self.sweep.chunk(window)
        return [(v, k) for v, k in items if v not in window and k not in self.settled and k not in self.in_flight]

    def _screen(self, p: _Pass, pending: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """``pending`` without the files of banned actors (handed to the janitor), after banning any actor with
        more than ``max_pending_files`` of them (its own quota: no honest actor's backlog comes near it)."""
        per_actor = Counter(layout.parse_rollout_key(key)[1] for _, key in pending)
        for actor, n in per_actor.items():
            if n > self.max_pending_files and actor not in self.banned:
                self._ban(actor, f"{n} of its files wait in the store, more than any honest actor's backlog "
                                 f"(max_pending_files {self.max_pending_files})")
        out = []
        for version, key in pending:
            if layout.parse_rollout_key(key)[1] in self.banned:
                self.janitor.clear(key)
                p.taken.add(key)
            else:
                out.append((version, key))
        return out

    def _judge_swept(self, sel: Selection, p: _Pass, version: int, key: str, learner_version: int,
                     should_abort) -> None:
        """One file of a folder outside the poll's window: stale (dropped unread), or from the future."""
        actor_id = layout.parse_rollout_key(key)[1]
        if key in p.taken:
            return
        if actor_id in self.banned:
            self.janitor.clear(key)
            return
        if version <= learner_version:
            p.taken.add(key)
            self._drop_stale(sel, version, key, learner_version)
            return
        if p.sweep_cost >= self.sweep_files or (self._lost(version, actor_id, published=True)
                                                and p.judged[actor_id] >= self.max_judged_per_actor):
            self._sweep_backlog.append((version, key))
            return
        p.sweep_cost += 1
        p.taken.add(key)
        self._judge_future(sel, p, version, key, actor_id, learner_version)
        self._on_time(sel, p, should_abort)

    def _poll(self, sel: Selection, p: _Pass, pending: list[tuple[int, str]], learner_version: int,
              should_abort) -> bool:
        """Judge what one listing of the window found; whether a file was read."""
        progressed = False
        for version, key in sorted(pending, key=lambda item: (item[0] <= learner_version, item)):
            actor_id = layout.parse_rollout_key(key)[1]
            if actor_id in self.banned:  # banned during this pass
                self.janitor.clear(key)
                p.taken.add(key)
                continue
            if version > learner_version:  # listed first: judged whatever the step still needs
                if self._lost(version, actor_id, published=True) and p.judged[actor_id] >= self.max_judged_per_actor:
                    p.deferred.add(key)  # to be read as of a lost timeline, and this actor's reads are spent
                    continue
                p.taken.add(key)
                self._judge_future(sel, p, version, key, actor_id, learner_version)
                self._on_time(sel, p, should_abort)
                continue
            if sel.groups >= self.groups_per_step:
                break
            if not is_fresh(learner_version, version, self.staleness):
                progressed = True
                p.taken.add(key)
                self._drop_stale(sel, version, key, learner_version)
                continue
            if p.judged[actor_id] >= self.max_judged_per_actor:
                p.deferred.add(key)  # this actor's reads are spent for this collection: the next one judges it
                continue
            progressed = True
            p.taken.add(key)
            self._judge(sel, p, version, key, actor_id, learner_version, self._lost(version, actor_id))
            self._on_time(sel, p, should_abort)
        return progressed

    def _drop_stale(self, sel: Selection, version: int, key: str, learner_version: int) -> None:
        lag = learner_version - version
        sel.dropped.append({"key": key, "policy_version": version, "lag": lag,
                            "reason": f"stale: lag {lag} > S={self.staleness}"})

    def _on_time(self, sel: Selection, p: _Pass, should_abort) -> None:
        """After each file and each poll: a notice may stop the collection, the deadline ends it, and the
        actors hear from it at least every ``progress_every_s``."""
        should_abort()
        if time.time() > p.deadline:
            raise NoRollouts(
                f"no usable rollouts for {self._timeout_s:.0f}s at step {sel.step} (have {sel.groups}/"
                f"{self.groups_per_step} groups): are the actors alive? see the run's logs/")
        if time.time() - p.shown_at >= self.progress_every_s:
            self._show_progress(sel, p, beat=True)

    def _show_progress(self, sel: Selection, p: _Pass, *, beat: bool = False) -> None:
        """Tell the actors what this collection has judged so far while it waits (``layout.COLLECTING``):
        their flow control must not count files judged here (dropped, or used by a step still short of
        groups) as a backlog, nor wait for the files of an actor found sending junk, or junk a step never
        uses would stop the very actors the step waits for. Written when it changed between two polls, and
        with the time (``beat``) at least every ``progress_every_s`` (inside a long pass too): an actor takes a
        learner whose marks do not change for ``fleet.learner_silence_s`` for dead."""
        sel.banned = sorted(self.banned)
        record = collecting_record(sel.step, sel.ledger_record())
        now = time.time()
        if record != p.shown or beat or now - p.shown_at >= self.progress_every_s:
            self.store.put_pointer(layout.COLLECTING, json.dumps({**record, "at": now}).encode())
            p.shown, p.shown_at = record, now

    def settle(self, selection: Selection) -> None:
        """The step that used ``selection`` completed: its files are settled for good."""
        self.settled |= selection.keys
        self.used_hashes |= {u["sha256"] for u in selection.used}
        self.used_hashes |= {BYTES_PREFIX + u["bytes_sha256"] for u in selection.used if "bytes_sha256" in u}
        self.used_bytes.update({u["bytes_sha256"]: u["sha256"] for u in selection.used if "bytes_sha256" in u})
        self.in_flight -= selection.keys

    def final_leftovers(self, learner_version: int) -> tuple[list[str], list[dict], list[dict]]:
        """What the run leaves when it finishes, for the final ledger entry: the committed files no step
        settled, unused; those of banned actors the janitor has not deleted (it stops first), dropped by their
        ban; those of versions a lost timeline published, of its actors, dropped unread; those of other versions
        beyond the learner's last, quarantined as from the future (a poll never looks beyond t + 1, and the
        sweep may not have come round to them). Returns (unused keys, quarantined items, dropped items)."""
        self.janitor.close()
        sel = Selection(step=0, learner_version=learner_version)
        unused = []
        for version, key in pending_rollouts(self.store, self.settled):
            actor_id = layout.parse_rollout_key(key)[1]
            lost = self._lost(version, actor_id, published=True)
            if actor_id in self.banned:
                sel.dropped.append({"key": key, "reason": f"banned: actor {actor_id} ({self.banned[actor_id][:200]})"})
            elif version <= learner_version:
                unused.append(key)
            elif lost is not None:
                sel.dropped.append({"key": key, "policy_version": version, "reason": (
                    f"lost timeline: of a version the timeline lost at the resume from step {lost.step} published")})
            else:
                reason = f"version {version} is from the future (the run finished at {learner_version})"
                try:
                    self._quarantine(sel, key, reason)
                except NotFound:
                    continue  # moved away meanwhile
                self._count_invalid(actor_id, reason, key)
        self._write_bans()
        return unused, sel.quarantined, sel.dropped
