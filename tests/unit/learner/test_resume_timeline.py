"""A resumed learner's new timeline publishes the version numbers of the lost one again (issue 18, item 7):
an actor holding a number the resume orphaned fetches the new version of that number; files the old
timeline's actors commit after the resume are accounted for in the ledger, never used as the new timeline's
and never deleted unseen."""

from __future__ import annotations

import time

import torch
from relay_helpers import KEY, PUBLIC, RUN_ID, TOKEN

from echo2.broadcast.receiver import PolicyReceiver
from echo2.config import BroadcastConfig
from echo2.data import layout
from echo2.data.run_folder import orphan_after
from echo2.data.store import open_store
from echo2.data.weights import publish_version


def poll_until(receiver, what, limit_s=30.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = receiver.poll()
        if got is not None:
            return got
        time.sleep(0.02)
    raise AssertionError(f"no {what}")


def test_an_actor_holding_an_orphaned_number_fetches_the_new_timelines_version(tmp_path):
    store = open_store(str(tmp_path / "runs" / RUN_ID))
    publish_version(store, 0, {"w": torch.zeros(4)}, extra_files={}, shard_mb=1, key=KEY)
    publish_version(store, 1, {"w": torch.full((4,), 1.0)}, extra_files={}, shard_mb=1, key=KEY)  # lost timeline
    receiver = PolicyReceiver(store, "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=2, run_id=RUN_ID)
    receiver.identity_check_s = 0.0  # look at every poll here
    try:
        old = poll_until(receiver, "v1 of the lost timeline")
        assert old.version == 1 and receiver.current == 1
        # the learner dies and resumes from checkpoint 0: v1 goes to orphaned/, and the new timeline publishes
        # its own v1 before this actor polls again (it was busy generating)
        orphan_after(store, 0)
        publish_version(store, 1, {"w": torch.full((4,), 2.0)}, extra_files={}, shard_mb=1, key=KEY)
        new = poll_until(receiver, "v1 of the new timeline")
        assert new.version == 1 and new.manifest["signature"] != old.manifest["signature"]
        for _ in range(3):  # and it is not fetched again and again
            assert receiver.poll() is None
    finally:
        receiver.close()


def test_files_the_lost_timelines_actors_commit_after_the_resume_are_accounted_for(tmp_path):
    from helpers import commit_rollouts

    from echo2.data.ledger import read_events, write_event
    from echo2.data.rollouts import RolloutLimits
    from echo2.data.store.fsspec_store import FsspecStore
    from echo2.learner.collector import RolloutCollector
    from echo2.learner.resume import lost_timelines

    class ActorCommitsDuringTheMove(FsspecStore):
        """The run's store; an actor of the dead learner commits a file while the resume moves the folder."""
        raced = None

        def delete(self, key):  # the move's last step: the file is at its new place, its folder here empty
            super().delete(key)
            if self.raced is None and key.startswith(layout.ROLLOUTS):
                self.raced = commit_rollouts(self, 1, 1, actor="old0")

    store = ActorCommitsDuringTheMove(str(tmp_path / "runs" / "run"), {})
    write_event(store, "launch", "old0")
    commit_rollouts(store, 0, 0, actor="old0")  # v0: the same weights in both timelines
    orphaned = commit_rollouts(store, 1, 0, actor="old0")  # v1 of the lost timeline
    moved = orphan_after(store, 0)  # the resume from checkpoint 0
    assert orphaned in moved and store.raced is not None
    assert store.exists(store.raced), "a file committed during the resume was deleted unseen"
    write_event(store, "resume", "learner", step=0)
    write_event(store, "launch", "resumed0")
    late = commit_rollouts(store, 1, 2, actor="old0")  # committed after the resume, before its cluster is down
    fresh = commit_rollouts(store, 1, 0, actor="resumed0")  # the new timeline's v1
    limits = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                           reward_range=(0.0, 1.0))
    collector = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=4, limits=limits,
                                 lost_timelines=lost_timelines(read_events(store)))
    sel = collector.collect(step=2, learner_version=1, timeout_s=30)
    assert {u["key"] for u in sel.used} == {fresh, layout.rollout_key(0, "old0", 0)}
    dropped = {d["key"]: d["reason"] for d in sel.dropped}
    assert set(dropped) == {store.raced, late}
    assert all(r.startswith("lost timeline: actor old0") for r in dropped.values())
    record = store.get_json(layout.consumed_key(2))  # in the ledger, with the reason
    assert {d["key"] for d in record["dropped"]} == {store.raced, late}


def test_lost_timelines_are_read_from_every_resume_of_the_ledger():
    from echo2.learner.resume import lost_timelines
    from echo2.learner.timelines import LostTimeline

    events = [{"ts": 1, "kind": "launch", "actor_id": "a"},
              {"ts": 2, "kind": "resume", "actor_id": "learner", "step": 4},
              {"ts": 3, "kind": "launch", "actor_id": "b"},
              {"ts": 4, "kind": "resume", "actor_id": "learner", "step": 9, "lost_latest": 11,
               "lost_digests": {"10": "d10", "11": "d11", "x": "junk"}},
              # the same resume run again after it was interrupted past its boundary (LATEST re-pointed at 9)
              {"ts": 5, "kind": "resume", "actor_id": "learner", "step": 9, "lost_latest": 9, "lost_digests": {}}]
    assert lost_timelines(events) == [LostTimeline(4, frozenset({"a"}), None),
                                      LostTimeline(9, frozenset({"a", "b"}), 11, {10: "d10", 11: "d11"})]

