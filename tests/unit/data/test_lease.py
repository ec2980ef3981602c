"""One learner incarnation writes a run at a time (``data/lease.py``): the lease taken by create-if-absent, a
heartbeat a taker watches by its own clock, a fence before every commit, and incarnation numbers actors honour.
A holder on another machine is a record this test writes (no second machine is reachable); the taker's clock and
sleep are test doubles, so nothing waits."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from echo2.data import layout
from echo2.data.lease import FencedStore, Incarnation, LeaseHeld, LeaseLost, beat_key, record_key, take
from echo2.data.store import open_store
from echo2.rollout.actor import Actor


class _Clock:
    """The taker's clock; each sleep moves it, and may let the holder beat (``beats``)."""

    def __init__(self, store, beats: bool):
        self.now, self.store, self.beats, self.count = 0.0, store, beats, 0

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.beats:
            self.count += 1
            self.store.put(beat_key(1), json.dumps({"count": 100 + self.count}).encode(), if_absent=False)


def _elsewhere(store, *, released: bool = False) -> None:
    """Incarnation 1, held by a learner on another machine."""
    store.put(record_key(1), json.dumps({"incarnation": 1, "host": "other-host", "boot_id": "b", "pid": 4242}).encode())
    store.put(beat_key(1), json.dumps({"count": 100, "released": released}).encode())


def test_a_live_holder_elsewhere_is_never_taken_over_and_a_dead_one_is(tmp_path):
    store = open_store(str(tmp_path / "run"))
    _elsewhere(store)
    live = _Clock(store, beats=True)
    with pytest.raises(LeaseHeld, match="heartbeat moves"):
        take(store, wait_s=60, clock=live.time, sleep=live.sleep)
    dead = _Clock(store, beats=False)
    lease = take(store, wait_s=60, clock=dead.time, sleep=dead.sleep)
    assert lease.incarnation == 2 and dead.now >= 60  # it watched the whole time before it took the run


def test_a_released_lease_or_a_dead_local_process_is_taken_at_once(tmp_path):
    store = open_store(str(tmp_path / "run"))
    _elsewhere(store, released=True)
    never = _Clock(store, beats=False)
    assert take(store, wait_s=60, clock=never.time, sleep=never.sleep).incarnation == 2 and never.now == 0
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    record = json.loads(store.get(record_key(2)))
    store.put(record_key(3), json.dumps({**record, "incarnation": 3, "pid": gone.pid}).encode())
    assert take(store, wait_s=60, clock=never.time, sleep=never.sleep).incarnation == 4 and never.now == 0


def test_the_older_incarnation_is_fenced_before_every_commit(tmp_path):
    store = open_store(str(tmp_path / "run"))
    old = take(store)
    fenced = FencedStore(store, old)
    fenced.put(layout.manifest_key(layout.policy_dir(1)), b"{}")  # it holds the run: commits go through
    new = take(store)  # this process again (a new run object): no wait
    assert (old.incarnation, new.incarnation) == (1, 2)
    for commit in (lambda: fenced.put(layout.manifest_key(layout.checkpoint_dir(2)), b"{}"),
                   lambda: fenced.put_pointer(layout.LATEST, b'{"version": 2}'),
                   lambda: fenced.put_json(layout.consumed_key(2), {"used": []}),
                   lambda: fenced.put(layout.SUMMARY, b"{}")):
        with pytest.raises(LeaseLost, match="incarnation 2"):
            commit()
    fenced.put(layout.checkpoint_dir(2) + "/dcp-0_0.distcp", b"shard")  # not a commit: only a manifest commits
    assert not store.exists(layout.LATEST) and not store.exists(layout.consumed_key(2))


def test_an_actor_never_loads_a_version_of_an_older_incarnation_than_it_has_seen():
    actor = Actor.__new__(Actor)
    actor.engine = SimpleNamespace(native_lora=False, load_weights=lambda items: None)
    actor.version, actor.incarnation, actor.policy_digest, actor._ready = None, Incarnation(), None, None

    def ready(version: int, incarnation: int):
        return SimpleNamespace(version=version, weights={}, adapter=None, route="full", fetch_seconds=0.0,
                               received_at=0.0, rebuild_seconds=0.0,
                               manifest={"version": version, "incarnation": incarnation, "created_at": 0.0})

    offered = []
    actor.source = SimpleNamespace(poll=lambda native_lora: offered.pop(0))
    offered.append(ready(5, 2))
    assert actor._follow_policy() and actor.version == 5
    offered.append(ready(6, 1))  # a version a replaced learner published
    assert not actor._follow_policy() and actor.version == 5
    offered.append(ready(3, 3))  # a newer incarnation's, whatever its number (a resumed timeline)
    assert actor._follow_policy() and actor.version == 3
