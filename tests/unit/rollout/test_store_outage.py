"""A store outage longer than ``store.retry_s`` neither crashes the actors nor ends the run through
``fleet.max_restarts`` (``rollout/actor.py``, ``fleet/manager.py``).

The actor is the real loop in this process with the timing workload's engine; the outage is a store whose calls
from the actor's own loop fail with "connection refused" (what the store raises once its retries ran out) for a
while, then answer again. The manager's crashes come from a test double of a cloud's API (``FakeCloud``) and a
clock the test moves."""

from __future__ import annotations

import errno
import threading

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fleet_shared import FakeCloud, manager

from echo2.bench.overlap_actor import TimingEngine
from echo2.config import Config
from echo2.data import layout
from echo2.data.relay_tokens import RELAY_TOKEN_ENV
from echo2.data.run_folder import create_run
from echo2.data.store import ObjectStore, open_store
from echo2.data.weights import publish_version
from echo2.fleet import manager as manager_module
from echo2.fleet.backends.base import ActorState, ActorStatus
from echo2.fleet.manager import FleetFailed
from echo2.rollout.actor import Actor


class _Outage(ObjectStore):
    """The run's store, where ``fail`` calls made from the main thread (the actor's loop) are refused as a store that
    is down refuses them; the receiver's own thread is left alone."""

    def __init__(self, inner: ObjectStore):
        self.inner, self.url, self.fail, self.refused = inner, inner.url, 0, 0
        self.on_put = lambda key: None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _call(self, name, *args, **kwargs):
        if self.fail and threading.current_thread() is threading.main_thread():
            self.fail -= 1
            self.refused += 1
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        return getattr(self.inner, name)(*args, **kwargs)

    def put(self, key, data, *, if_absent=True):
        self._call("put", key, data, if_absent=if_absent)
        self.on_put(key)

    def put_pointer(self, key, data):
        self._call("put_pointer", key, data)

    def get(self, key):
        return self._call("get", key)

    def get_range(self, key, start, end):
        return self._call("get_range", key, start, end)

    @property
    def can_stream(self):
        return self.inner.can_stream

    def stream_range(self, key, start, sizes):
        return self.inner.stream_range(key, start, sizes)

    def size(self, key):
        return self._call("size", key)

    def modified(self, key):
        return self._call("modified", key)

    def exists(self, key):
        return self._call("exists", key)

    def list(self, prefix=""):
        return self._call("list", prefix)

    def delete(self, key):
        self._call("delete", key)

    def child(self, prefix):
        return _Outage(self.inner.child(prefix))


def test_an_actor_waits_out_a_store_outage_and_carries_on(tmp_path, tiny_model, monkeypatch):
    """After its first file the store refuses the actor's next 6 calls: the actor pauses between tries (growing
    pauses, never a crash), then commits again; the run's summary then stops it cleanly."""
    inner = open_store(str(tmp_path / "store" / "runs" / "r1"))
    key = Ed25519PrivateKey.generate()
    config = Config.model_validate({
        "run": {"id": "r1"}, "fleet": {"learner_silence_s": 3600},
        "rollout": {"group_size": 2, "groups_per_batch": 1, "max_new_tokens": 4, "poll_seconds": 0.01,
                    "max_pending_batches": 10},
        "broadcast": {"mode": "store"},
    })
    create_run(inner, "r1", config.model_dump(mode="json"), key=key, echo2_version="test")
    aux = {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.is_file() and p.suffix != ".safetensors"}
    publish_version(inner, 0, {"w": torch.zeros(4)}, extra_files=aux, shard_mb=1, key=key)
    monkeypatch.setenv(RELAY_TOKEN_ENV, "e2rt1.not.checked-here")
    store = _Outage(inner)
    committed = []

    def on_put(key):
        if key.startswith(layout.ROLLOUTS):
            committed.append(key)
            if len(committed) == 1:
                store.fail = 6  # the store goes down right after the first commit
            elif len(committed) == 2:
                inner.put_json(layout.SUMMARY, {"done": True})  # the run is over: the actor stops

    store.on_put = on_put
    pauses: list[float] = []
    monkeypatch.setattr(Actor, "_pause", lambda self, seconds: pauses.append(seconds), raising=False)
    actor = Actor(store, "a0", engine_factory=lambda model_dir, tokenizer: TimingEngine(tokenizer, 0.0))
    actor.run()  # returns: no error escaped
    assert store.refused == 6 and len(pauses) == 6 and pauses == sorted(pauses), pauses
    assert len(committed) == 2, committed


class _Clock:
    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


def test_crashes_far_apart_do_not_add_up_to_the_end_of_the_run(tmp_path, monkeypatch):
    """``max_restarts: 1``: two crashes of one slot within the window (an hour) end the run (a broken actor), but a
    crash two hours after the last one is replaced like the first."""
    clock = _Clock(1_800_000_000.0)
    monkeypatch.setattr(manager_module, "time", clock)
    cloud = FakeCloud()
    fleet, _ = manager(tmp_path, cloud, actors=1, max_restarts=1)
    fleet.start()

    def crash():
        cloud.states[fleet.slots[0].actor_id] = ActorStatus(ActorState.CRASHED, "exit code 1")
        fleet.reconcile()

    crash()  # the first crash: replaced
    clock.now += 2 * 3600
    crash()  # two hours later: it no longer adds to the first
    assert len(fleet.slots) == 1 and fleet.slots[0].crashes == 1
    clock.now += 60
    with pytest.raises(FleetFailed):
        crash()  # two within the window: the slot is broken
