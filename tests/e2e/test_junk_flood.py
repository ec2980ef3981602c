"""Issue 18, item 5: junk must not starve the fleet.

An actor holding its own scoped credentials may write any number of files under its own name, in any
version folder: garbage, files from the future, copies of used files. The actors' flow control counts
only files the learner has not judged, each other actor's at most its share and a junk producer's not at
all; nobody lists the folders beyond the next version at every poll; an actor whose files are malformed
or from the future a few times is banned (and so expelled and revoked by the flow); and one file
brings at most one batch of groups into a step.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from actor_helpers import make_run
from helpers import commit_rollouts, rollout_bytes, wait_until
from transformers import AutoModelForCausalLM

from echo2.data import layout
from echo2.data.ledger import ConsumedIndex, write_consumed
from echo2.data.relay_tokens import RELAY_TOKEN_ENV, mint
from echo2.data.rollouts import RolloutLimits
from echo2.data.store import open_store
from echo2.data.weights import unique_state_dict
from echo2.learner.collector import RolloutCollector

LIMITS = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                       reward_range=(0.0, 1.0), max_groups=2)
FAR = 500
"""A version folder far beyond anything the learner published."""


class Counting:
    """The real store, with every listing counted: ``list`` by prefix, ``list_folders``, and reads by key."""

    def __init__(self, store):
        self.store, self.listed, self.folder_listings, self.read = store, [], 0, []

    def list(self, prefix=""):
        self.listed.append(prefix)
        return self.store.list(prefix)

    def list_folders(self, prefix):
        self.folder_listings += 1
        return self.store.list_folders(prefix)

    def get(self, key):
        self.read.append(key)
        return self.store.get(key)

    def get_range(self, key, start, end):
        self.read.append(key)
        return self.store.get_range(key, start, end)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _collector(store, **kw):
    args = dict(run_id="run", staleness=1, groups_per_step=2, limits=LIMITS)
    return RolloutCollector(store, **{**args, **kw})


# -- flow control ---------------------------------------------------------------------------------

def test_junk_from_one_actor_does_not_stop_another_actors_flow_control(tiny_model, tmp_path, monkeypatch):
    """A real actor's flow control (``Actor._has_capacity``) beside a flood: 40 garbage files in the
    current folder and 20 in a folder far in the future, all in the hostile actor's name."""
    from echo2.config import backlog_bound
    from echo2.rollout.actor import Actor, per_actor_cap

    tensors = unique_state_dict(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    config = {"rollout": {"group_size": 2, "groups_per_batch": 2, "max_pending_batches": 2},
              "train": {"groups_per_step": 2, "staleness": 1}, "fleet": {"actors": 2}}
    store, key, _ = make_run(tmp_path, tiny_model, tensors, config, monkeypatch)
    monkeypatch.setenv(RELAY_TOKEN_ENV, mint(key, "r1", "honest", time.time() + 3600))  # as the fleet hands it
    for seq in range(40):
        commit_rollouts(store, 0, seq, actor="evil", data=b"junk")
    for seq in range(20):
        commit_rollouts(store, FAR, seq, actor="evil", data=b"junk")
    counting = Counting(store)
    actor = Actor(counting, "honest")
    try:
        r = actor.config.rollout
        assert backlog_bound(r.max_pending_batches, actor.config.train.groups_per_step, r.groups_per_batch) == 2
        assert per_actor_cap(actor.config) == 1
        actor.version = 0
        assert actor._has_capacity()  # the flood counts as one batch of its share, not 60
        assert not any(layout.version_name(FAR) in p for p in counting.listed), counting.listed
        assert counting.folder_listings == 0  # folders are listed by name: the far one costs nothing
        # an actor's own files all count against itself: it never outruns its own backlog
        commit_rollouts(store, 0, 0, actor="honest")
        assert not actor._has_capacity()
        # once the learner found the flood junk (a quarantine in the ledger), none of it counts
        write_consumed(store, 1, {"learner_version": 0, "used": [], "dropped": [],
                                  "quarantined": [{"key": layout.rollout_key(0, "evil", 0), "reason": "not arrow"}]})
        actor.version = 1  # the learner is at version 1 now: the window is v0..v1
        assert actor._has_capacity()
    finally:
        actor.source.close()


def test_files_the_collection_in_progress_judged_do_not_hold_the_fleet_back(tmp_path):
    """The fuzz scenario's deadlock: copies of a used file under other actors' names are dropped as
    duplicates, yet stay in rollouts/ until the step's entry; with them counted as a backlog the honest
    actor waited for a step that waited for it."""
    store = open_store(str(tmp_path))
    data = rollout_bytes(0)
    used = commit_rollouts(store, 0, 0, data=data)
    collector = _collector(store, staleness=2)
    collector.settle(collector.collect(step=1, learner_version=0, timeout_s=5))
    copies = [commit_rollouts(store, 0, 0, actor=f"copy{i}", data=rollout_bytes(0, actor=f"copy{i}"))
              for i in range(5)]
    assert used not in copies
    index = ConsumedIndex(store)
    index.refresh()
    assert index.backlog("honest", 0, 1, cap=1) == 5  # five actors' files wait: what the actor saw before

    result = {}
    thread = threading.Thread(target=lambda: result.update(sel=collector.collect(step=2, learner_version=1,
                                                                                 timeout_s=60, poll_s=0.05)))
    thread.start()
    try:
        def judged():
            index.refresh()
            return index.backlog("honest", 0, 1, cap=1) == 0
        wait_until(judged, 30, "the actors to see that the collection judged the copies")
        assert set(copies) <= index.judging and {f"copy{i}" for i in range(5)} <= index.judging_junk
    finally:
        fresh = commit_rollouts(store, 1, 0, actor="honest")  # what the honest actor now generates
        thread.join(60)
    sel = result["sel"]
    assert [u["key"] for u in sel.used] == [fresh]
    assert sorted(d["key"] for d in sel.dropped) == sorted(copies)
    assert all(d["reason"].startswith("duplicate") for d in sel.dropped)


# -- folders beyond the next version ---------------------------------------------------------------

def test_folders_beyond_the_next_version_are_listed_only_by_the_periodic_sweep(tmp_path):
    from echo2.learner.collector import FULL_SWEEP_EVERY

    store = open_store(str(tmp_path))
    counting = Counting(store)
    collector = _collector(counting, max_invalid_files=10**6)
    far = commit_rollouts(store, FAR, 0, actor="evil")
    steps = FULL_SWEEP_EVERY + 2
    sweeps = []
    for step in range(1, steps + 1):
        t = step - 1
        commit_rollouts(store, t, 0, actor="honest")
        if step == 3:
            late_far = commit_rollouts(store, FAR, 1, actor="evil")  # after the first sweep
        counting.listed.clear()
        counting.folder_listings = 0
        sel = collector.collect(step=step, learner_version=t, timeout_s=5)
        collector.settle(sel)
        if counting.folder_listings:
            sweeps.append(step)
        far_listed = any(p.startswith(f"{layout.ROLLOUTS}{layout.version_name(FAR)}") for p in counting.listed)
        assert far_listed == bool(counting.folder_listings), (step, counting.listed)
        quarantined = {q["key"] for q in sel.quarantined}
        if step == 1:
            assert far in quarantined and "future" in sel.quarantined[0]["reason"]
    assert sweeps == [1, FULL_SWEEP_EVERY + 1]  # the first collection and the periodic sweep, nothing between
    assert store.exists(layout.quarantine_key(late_far)) and not store.exists(late_far)


def test_files_beyond_the_last_version_are_quarantined_when_the_run_finishes(tmp_path):
    """A short run may end before the periodic sweep comes round: its final entry sets them aside (the
    chaos suite's fuzzed files from the future were recorded as merely unused)."""
    from echo2.data.ledger import write_final

    store = open_store(str(tmp_path))
    collector = _collector(store)
    for step in (1, 2):
        commit_rollouts(store, step - 1, 0, actor="honest")
        collector.settle(collector.collect(step=step, learner_version=step - 1, timeout_s=5))
    far = commit_rollouts(store, FAR, 0, actor="evil")  # after the first collection's sweep
    left = commit_rollouts(store, 2, 0, actor="honest")  # made with the last version, never used
    write_final(store, 2, *collector.final_leftovers(2))
    final = store.get_json(layout.FINAL_CONSUMED)
    assert [d["key"] for d in final["dropped"]] == [left]
    assert [q["key"] for q in final["quarantined"]] == [far] and "future" in final["quarantined"][0]["reason"]
    assert store.exists(layout.quarantine_key(far)) and collector.invalid_files == {"evil": 1}


# -- expulsion after a few invalid files ------------------------------------------------------------

def test_an_actor_with_a_few_invalid_or_future_files_is_banned_and_later_files_never_judged(tmp_path):
    store = open_store(str(tmp_path))
    counting = Counting(store)
    collector = _collector(counting, max_invalid_files=3)
    bad = [commit_rollouts(store, 1, 0, actor="evil", data=b"garbage"),
           commit_rollouts(store, 1, 1, actor="evil", run_id="another-run"),
           commit_rollouts(store, 2, 0, actor="evil")]  # from the future: the learner is at version 1
    good = commit_rollouts(store, 1, 0, actor="honest")
    sel = collector.collect(step=2, learner_version=1, timeout_s=5)
    assert [u["key"] for u in sel.used] == [good]
    assert {q["key"] for q in sel.quarantined} == set(bad)
    assert set(collector.banned) == {"evil"}
    assert "3 invalid or future-version files" in collector.banned["evil"]
    collector.settle(sel)

    later = commit_rollouts(store, 2, 1, actor="evil")  # a well-formed file: never judged, nor moved one by one
    commit_rollouts(store, 2, 0, actor="honest")
    counting.read.clear()
    sel = collector.collect(step=3, learner_version=2, timeout_s=5)
    assert later not in sel.keys and sel.banned == ["evil"]  # the entry names the ban, not the file
    assert later not in counting.read
    collector.janitor.drain()
    assert not store.exists(later)  # deleted off the collection's path
    assert "3 invalid or future-version files" in store.get_json(layout.ban_key("evil"))["reason"]
    assert "evil" in collector.banned  # what the flow expels and the next version revokes


def test_two_invalid_files_do_not_ban(tmp_path):
    store = open_store(str(tmp_path))
    collector = _collector(store, max_invalid_files=3)
    commit_rollouts(store, 1, 0, actor="clumsy", data=b"garbage")
    commit_rollouts(store, 1, 1, actor="clumsy", data=b"other garbage")  # (the same bytes twice would be a copy)
    commit_rollouts(store, 1, 2, actor="clumsy")
    sel = collector.collect(step=2, learner_version=1, timeout_s=5)
    assert len(sel.quarantined) == 2 and len(sel.used) == 1 and not collector.banned
    assert collector.invalid_files == {"clumsy": 2}


# -- one file, one batch ------------------------------------------------------------------------------

def test_a_file_with_more_groups_than_a_batch_is_quarantined(tmp_path):
    store = open_store(str(tmp_path))
    huge = commit_rollouts(store, 1, 0, actor="greedy", n_groups=3)  # groups_per_batch is 2
    honest = commit_rollouts(store, 1, 0, actor="honest", n_groups=2)
    sel = _collector(store).collect(step=2, learner_version=1, timeout_s=5)
    assert [u["key"] for u in sel.used] == [honest] and sel.groups == 2
    [q] = sel.quarantined
    assert q["key"] == huge and "3 groups, more than a batch's 2" in q["reason"]
    assert store.exists(layout.quarantine_key(huge))


def test_the_learner_caps_a_file_at_its_batch_and_bans_after_the_configured_count(tiny_model, tmp_path, monkeypatch):
    """The run wires ``rollout.groups_per_batch`` and ``trust.max_invalid_files_per_actor`` into its collector."""
    from echo2.config import config_from_dict
    from echo2.learner.run import LearnerRun

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv("ECHO2_RUN_KEY", raising=False)
    config = config_from_dict({
        "run": {"id": "r1"}, "store": {"url": str(tmp_path)}, "model": {"name": str(tiny_model)},
        "rollout": {"group_size": 2, "groups_per_batch": 3}, "train": {"groups_per_step": 3},
        "trust": {"max_invalid_files_per_actor": 5, "spot_check_fraction": 0},
        "eval": {"before": False, "after": False}})
    run = LearnerRun(config, open_store(str(tmp_path)).child(layout.RUNS), resume=False)
    try:
        assert run.collector.limits.max_groups == 3 and run.collector.max_invalid_files == 5
    finally:
        run.sink.close()


@pytest.mark.e2e
def test_a_dead_fleet_still_ends_the_run_though_junk_keeps_arriving(tmp_path):
    """Junk judged at every poll is no sign of life: with no usable file, NoRollouts as before (a guard
    on the timeout, which now runs from the last usable file rather than from the collection's start)."""
    from echo2.learner.collector import NoRollouts

    store = open_store(str(tmp_path))
    stop = threading.Event()

    def flood():
        seq = 0
        while not stop.is_set():
            commit_rollouts(store, 0, seq, actor=f"junk{seq}", data=b"junk")
            seq += 1
            stop.wait(0.02)

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        with pytest.raises(NoRollouts, match="no usable rollouts"):
            _collector(store).collect(step=1, learner_version=0, timeout_s=1.0, poll_s=0.05)
    finally:
        stop.set()
        thread.join()
