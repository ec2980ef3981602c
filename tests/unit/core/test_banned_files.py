"""What junk costs the learner inside a collection: the files of a banned actor no store write at all (its ban, one
ledger record written the moment it happens, stands for them, and the janitor deletes them on a thread of its
own), an actor over its quota of waiting files is banned at the listing, and the sweep of folders outside the
poll's window spends a bounded share per collection. A real local store, with every write counted."""

from __future__ import annotations

import threading

import pytest
from helpers import commit_rollouts, ledger_audit

from echo2.data import layout
from echo2.data.ledger import ConsumedIndex, write_final
from echo2.data.rollouts import RolloutLimits
from echo2.data.store import open_store
from echo2.learner.collector import NoRollouts, RolloutCollector

LIMITS = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                       reward_range=(0.0, 1.0), max_groups=2)
WRITES = ("put", "put_pointer", "put_json", "copy", "move", "delete", "delete_prefix")


class Counting:
    """The real store; every write recorded with the thread that made it, every read by key."""

    def __init__(self, store):
        self.store, self.writes, self.read, self.listed = store, [], [], []

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if name in WRITES:
            def write(key, *args, **kw):
                self.writes.append((name, key, threading.current_thread().name))
                return attr(key, *args, **kw)
            return write
        return attr

    def get_range(self, key, start, end):
        self.read.append(key)
        return self.store.get_range(key, start, end)

    def list(self, prefix=""):
        self.listed.append(prefix)
        return self.store.list(prefix)

    def on_this_thread(self) -> list[tuple[str, str]]:
        me = threading.current_thread().name
        return [(op, key) for op, key, thread in self.writes if thread == me]


def _collector(store, **kw):
    return RolloutCollector(store, **{"run_id": "run", "staleness": 1, "groups_per_step": 2, "limits": LIMITS, **kw})


def test_a_banned_actors_files_cost_no_store_write_inside_the_collection(tmp_path):
    """Before, each of them was quarantined (a copy, a delete and a reason record: three writes a file)."""
    store = open_store(str(tmp_path))
    flood = [commit_rollouts(store, 1, seq, actor="evil", data=b"") for seq in range(300)]
    flood += [commit_rollouts(store, 900 + seq // 50, seq, actor="evil", data=b"") for seq in range(300)]
    honest = commit_rollouts(store, 1, 0, actor="honest")
    counting = Counting(store)
    col = _collector(counting, banned={"evil": "caught lying earlier"})
    sel = col.collect(step=2, learner_version=1, timeout_s=30)
    assert [u["key"] for u in sel.used] == [honest] and not set(flood) & sel.keys
    writes = counting.on_this_thread()
    assert len(writes) <= 3, writes[:10]  # the step's entry (and what the collection tells the actors)
    assert not set(flood) & set(counting.read)
    assert store.get_json(layout.consumed_key(2))["banned"] == ["evil"]  # the entry names the ban, not the files
    index = ConsumedIndex(store)
    index.refresh()
    assert index.junk == {"evil": True, "honest": False}  # the other actors' flow control counts none of its files
    col.janitor.drain()  # off the collection's path: deleted by the janitor
    assert not any(store.exists(k) for k in flood)
    assert {key for op, key, thread in counting.writes if op == "delete"} == set(flood)


def test_a_ban_is_in_the_ledger_the_moment_it_happens(tmp_path):
    """A ban lived only in the trainer state a checkpoint saves: one found after the last checkpoint was lost to
    a resume. Here the collection that bans fails (no usable file) and nothing is checkpointed: the ban is kept."""
    store = open_store(str(tmp_path))
    for seq in range(3):
        commit_rollouts(store, 1, seq, actor="evil", data=b"garbage %d" % seq)
    with pytest.raises(NoRollouts):
        _collector(store).collect(step=2, learner_version=1, timeout_s=0.5, poll_s=0.1)
    record = store.get_json("ledger/bans/evil.json")
    assert record["actor_id"] == "evil" and "3 invalid or future-version files" in record["reason"]
    assert record["step"] == 2


def test_an_actor_over_its_quota_of_waiting_files_is_banned_at_the_listing_unread(tmp_path):
    """More files of one actor waiting in the store than any honest backlog: banned when a listing shows them,
    before any is read or moved (it was read, found malformed three times, and then each was quarantined)."""
    store = open_store(str(tmp_path))
    flood = [commit_rollouts(store, 1, seq, actor="flood", data=b"") for seq in range(1100)]
    honest = commit_rollouts(store, 1, 0, actor="honest")
    counting = Counting(store)
    col = _collector(counting)
    sel = col.collect(step=2, learner_version=1, timeout_s=30)
    assert [u["key"] for u in sel.used] == [honest]
    assert "1100 of its files wait in the store" in col.banned["flood"]
    assert not set(flood) & set(counting.read) and len(counting.on_this_thread()) <= 4
    col.settle(sel)
    col.janitor.close()  # stops where it is: what it left is in the final entry, dropped by the ban
    unused, quarantined, dropped = col.final_leftovers(1)
    write_final(store, 2, unused, quarantined, dropped)
    assert not quarantined and {d["key"] for d in dropped} == {k for k in flood if store.exists(k)}
    assert all(d["reason"].startswith("banned: actor flood") for d in dropped)
    problems, counts = ledger_audit(store)
    assert not problems and counts["used"] == 1, problems[:5]


def test_the_sweep_spends_a_bounded_share_of_each_collection(tmp_path):
    """Two hundred far future folders, one junk file each under two hundred names (no ban can spare the work):
    a collection lists at most 64 of them and quarantines at most 64 files, the rest in the next collections."""
    store = open_store(str(tmp_path))
    far = [commit_rollouts(store, 1000 + n, 0, actor=f"j{n:03d}", data=b"") for n in range(200)]
    counting = Counting(store)
    col = _collector(counting)
    judged = set()
    for step in range(2, 6):
        commit_rollouts(store, step - 1, 0, actor="honest")
        counting.listed.clear()
        sel = col.collect(step=step, learner_version=step - 1, timeout_s=30)
        col.settle(sel)
        far_listed = [p for p in counting.listed if (layout.parse_version_dir(p.split("/")[1]) or 0) >= 1000]
        now = {q["key"] for q in sel.quarantined} & set(far)
        assert len(far_listed) <= 64 and len(now) <= 64, (step, len(far_listed), len(now))  # sweep.SWEEP_FOLDERS
        judged |= now
    assert judged == set(far)  # all of it within four collections
