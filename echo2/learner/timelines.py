"""What a resume lost, as the collector judges files by it: one ``LostTimeline`` per ``resume`` event.

A resumed learner publishes the version numbers after its checkpoint c again, with other weights. Actors the
dead learner launched may still commit files of its versions c+1 .. ``newest`` (its ``LATEST`` when it died):
those are of the lost timeline, dropped with that reason, never used, unless the file names this timeline's
signed manifest of its version (``rollouts.POLICY_DIGEST_KEY``: an adopted actor that moved on). The resume
records this boundary in its ledger event *before* it moves anything or re-points ``LATEST``
(``LearnerRun._resume``), so a resume interrupted half-way still leaves the right boundary for the next one,
and it moves no rollout file: the boundary is enough to judge each file when the collector meets it.

A drop as "lost timeline" costs the actor nothing, so it is earned, not granted by the folder: the file must
be well formed (read, decoded, within the schema's bounds: a file that is not is malformed whatever its
timeline) and name the lost timeline's own manifest of its version (``digests``, read at the resume) or no
manifest at all (a file from before the field); and each actor gets at most ``allowance`` such drops per lost
timeline: the files it could have made while that timeline lived (one step's files per version it published,
and a backlog). A file beyond the allowance, or naming a manifest no timeline signed, counts against its actor
like any malformed file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LostTimeline:
    step: int
    """The checkpoint the resume went back to: versions after it are the lost timeline's."""
    actors: frozenset[str]
    """The actors launched before that resume (only their files may be of the lost timeline)."""
    newest: int | None = None
    """The newest version the lost timeline published (None: a ledger from before it was recorded)."""
    digests: Mapping[int, str] = field(default_factory=dict)
    """version -> ``rollouts.policy_digest`` of the lost timeline's signed manifest of it, read at the resume."""

    @classmethod
    def of(cls, item: LostTimeline | tuple) -> LostTimeline:
        """``item`` itself, or one from the older tuple form (step, actors[, newest])."""
        if isinstance(item, LostTimeline):
            return item
        step, actors, *rest = item
        return cls(step, frozenset(actors), rest[0] if rest else None)

    def claims(self, version: int, actor_id: str, *, published: bool = False) -> bool:
        """Whether a file of ``actor_id`` in ``version`` may be of this timeline: the actor was launched before
        the resume and ``version`` is past its checkpoint; with ``published``, only up to the newest version the
        timeline published (none beyond it existed for an actor to generate with)."""
        return (version > self.step and actor_id in self.actors
                and not (published and self.newest is not None and version > self.newest))

    def names_it(self, version: int, digest: str | None) -> bool:
        """Whether a file of ``version`` naming ``digest`` (None: none) may be of this timeline: it names no
        manifest, or the lost timeline's own of that version (any, where the resume could not read them)."""
        return digest is None or not self.digests or self.digests.get(version) == digest

    def allowance(self, files_per_step: int, backlog: int, staleness: int) -> int:
        """The most files one actor could have had of this timeline: a step's files per version it published
        (``staleness`` + 1 where that is unknown) and a full backlog."""
        span = self.newest - self.step if self.newest is not None else staleness + 1
        return max(1, span) * files_per_step + backlog


def from_events(events: Iterable[dict]) -> list[LostTimeline]:
    """One per ``resume`` event, oldest first. Two events of one step (a resume interrupted after recording its
    boundary, then run again) are one timeline: the newest version either saw and every digest either read."""
    events = sorted(events, key=lambda e: e.get("ts", 0))
    out: list[LostTimeline] = []
    for i, e in enumerate(events):
        if e.get("kind") != "resume" or not _is_int(e.get("step")):
            continue
        newest = e.get("lost_latest") if _is_int(e.get("lost_latest")) else None
        digests = {int(v): str(d) for v, d in (e.get("lost_digests") or {}).items()
                   if str(v).isdigit() and isinstance(d, str)} if isinstance(e.get("lost_digests"), dict) else {}
        actors = frozenset(str(x["actor_id"]) for x in events[:i] if x.get("kind") == "launch")
        if out and out[-1].step == e["step"]:
            last = out.pop()
            newest = max((n for n in (last.newest, newest) if n is not None), default=None)
            digests = {**last.digests, **digests}
        out.append(LostTimeline(e["step"], actors, newest, digests))
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
