"""Resuming a run, the steps that read the dead learner's traces: the newest checkpoint its key signed, the actors
revoked at once, and the lost timeline's boundary recorded before anything of it moves.

``LearnerRun._resume`` runs them in this order (the module docstring of ``run.py`` says why): restore the
checkpoint (``restore_newest``), decide whose tokens die now (``revoked_at_resume``), then record the boundary and
move what the dead learner wrote after the checkpoint to ``orphaned/`` (``set_lost_timeline_aside``); re-pointing
``LATEST`` or publishing the checkpoint's version again is the run's.
"""

from __future__ import annotations

import json
import random
import socket

import torch

from echo2.data import layout
from echo2.data.ledger import read_bans, read_events, write_event
from echo2.data.rollouts import policy_digest
from echo2.data.run_folder import orphan_after
from echo2.data.store import NotFound, ObjectStore, is_transient
from echo2.fleet.adoption import revoked_on_resume
from echo2.learner.checkpoint import Checkpoint, newest_checkpoint
from echo2.learner.timelines import LostTimeline
from echo2.learner.timelines import from_events as timelines_from_events


def lost_timelines(events: list[dict]) -> list[LostTimeline]:
    """Per ``resume`` event of the ledger, what it lost (``timelines.LostTimeline``): the step it resumed from, the
    actors launched before it, whose files in later version folders may be of the timeline it lost, the newest
    version that timeline published (``lost_latest``; None in a ledger from before it was recorded) and its
    manifests' digests (``lost_digests``). Two events of one step (a resume interrupted after its boundary) are one."""
    return timelines_from_events(events)


def restore_newest(store: ObjectStore, public_key, learner) -> tuple[int, dict | None]:
    """Restore the newest checkpoint this run's key signed into ``learner`` (newer folders that fail verification
    are logged and skipped: ``checkpoint.py``), and the random states; returns its step and its state (0 and None
    without a checkpoint)."""
    def restore(ckpt: Checkpoint) -> None:  # every rank reads its shards, each file verified first
        learner.load_sharded(store, ckpt.prefix, ckpt.entries)

    ckpt = newest_checkpoint(store, public_key, restore)
    step = ckpt.step if ckpt is not None else 0
    state = None
    if ckpt is not None:
        torch.set_rng_state(ckpt.rng["torch_rng"])
        random.setstate(_as_random_state(ckpt.rng["py_rng"]))
        state = ckpt.state
    learner.version = step
    return step, state


def revoked_at_resume(store: ObjectStore, *, adopt: bool) -> set[str]:
    """The dead learner's actors whose tokens die now: those the ledger saw end (the live ones are the fleet's to
    adopt, their tokens staying good, or to stop and revoke: ``fleet/adoption.py``); without adoption, all of
    them. Every actor banned by any learner of the run too: never adopted, never trusted."""
    events = read_events(store)
    revoked = (revoked_on_resume(events) if adopt
               else {str(e["actor_id"]) for e in events if e.get("kind") == "launch"})
    return revoked | set(read_bans(store))


def run_revocations(store: ObjectStore) -> set[str]:
    """Every actor a version of this run revoked, any timeline (the ledger's ``revoked`` events)."""
    return {str(a) for e in read_events(store) if e.get("kind") == "revoked"
            for a in (e.get("actors") if isinstance(e.get("actors"), list) else [])}


def set_lost_timeline_aside(store: ObjectStore, step: int, *, market: str) -> tuple[int, list]:
    """Record the lost timeline's boundary in the ledger's ``resume`` event, then move what the dead learner wrote
    after ``step`` to ``orphaned/`` (rollout files stay: the boundary judges them); returns the newest version it
    published and what was moved. The boundary first, before anything moves or ``LATEST`` is re-pointed: a resume
    interrupted after that would read ``LATEST`` at the checkpoint and lose the newest version the dead learner
    published."""
    lost_latest, digests = _lost_boundary(store, step)
    write_event(store, "resume", "learner", step=step, lost_latest=lost_latest, lost_digests=digests,
                orphaned_rollouts=[], market=market, host=socket.gethostname())
    return lost_latest, orphan_after(store, step, rollouts=False)


def _published_latest(store: ObjectStore, step: int) -> int:
    """The newest version the dead learner pointed LATEST at (at least ``step``): its actors may hold versions up
    to it, never beyond, so a file of theirs from a newer version is from the future, not of the lost timeline."""
    try:
        version = json.loads(store.get(layout.LATEST))["version"]
    except (NotFound, ValueError, KeyError, TypeError):
        return step
    return max(step, version) if isinstance(version, int) and not isinstance(version, bool) else step


def _lost_boundary(store: ObjectStore, step: int) -> tuple[int, dict[str, str]]:
    """The newest version the dead learner published (``LATEST``, or a version folder past ``step``) and the
    digest of each signed manifest it left past ``step`` (``rollouts.policy_digest``): what a file of its
    timeline may name. Only the learner writes ``policy/``; a manifest that cannot be read names nothing."""
    lost_latest, digests = _published_latest(store, step), {}
    for name in store.list_folders(layout.POLICY):
        version = layout.parse_version_dir(name)
        if version is None or version <= step:
            continue
        lost_latest = max(lost_latest, version)
        try:
            digests[str(version)] = policy_digest(store.get_json(layout.manifest_key(layout.policy_dir(version))))
        except Exception as exc:  # never committed, or planted unreadable: nothing to name (the store down: stop)
            if is_transient(exc):
                raise
    return lost_latest, digests


def _as_random_state(state) -> tuple:
    """``random.setstate`` wants tuples; a checkpoint loaded with weights_only may give lists."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
