"""The flow's reconcile task talks to the fleet and the run through their methods (issue 20, item 4):
``fleet.autosize`` keeps its own bookkeeping of when it last sized the fleet, ``fleet.reconcile(expel=...)``
expels the learner's banned actors and returns every actor that left, and ``run.revoke`` hands them (and the
banned ones) to the next published version. A real ``FleetManager`` over a backend double (a cloud's launch
API is out of reach here), with ``LearnerRun``'s own ``banned`` and ``revoke``."""

from __future__ import annotations

from types import SimpleNamespace

import echo2.flows.train as train
from echo2.config import load_config
from echo2.data.ledger import read_events
from echo2.data.store import open_store
from echo2.fleet.backends.base import ActorLaunch, ActorState, ActorStatus, FleetBackend
from echo2.fleet.manager import FleetManager
from echo2.learner.run import LearnerRun


class _Backend(FleetBackend):
    """Every launch runs at once; the test ends actors by setting their state."""

    name = "double"

    def __init__(self):
        self.states: dict[str, ActorStatus] = {}
        self.terminated: list[str] = []

    def launch(self, spec):
        self.states[spec.actor_id] = ActorStatus(ActorState.RUNNING)
        return {}

    def poll(self, actor_id):
        return self.states[actor_id]

    def terminate(self, actor_id, grace_s=10.0):
        self.terminated.append(actor_id)


class _Run:
    """The part of ``LearnerRun`` the reconcile task uses, with ``LearnerRun``'s own ``banned`` and ``revoke``."""

    banned = LearnerRun.banned
    revoke = LearnerRun.revoke

    def __init__(self, config, store):
        self.config, self.store, self.history, self.step = config, store, [], 0
        self.collector = SimpleNamespace(banned={})
        self.revoked: set[str] = set()


def _fleet_and_run(tmp_path, settings):
    config = load_config(None, settings)
    store = open_store(str(tmp_path / "run"), {})
    backend = _Backend()
    fleet = FleetManager(backend, config.fleet, store,
                         launch_spec=lambda actor_id, offer: ActorLaunch(actor_id, store.url, ["echo2", "actor"],
                                                                         offer=offer))
    fleet.start()
    return fleet, backend, _Run(config, store)


def test_banned_and_ended_actors_leave_the_fleet_and_the_next_version_revokes_them(tmp_path):
    fleet, backend, run = _fleet_and_run(tmp_path, ["fleet.actors=3"])
    liar, ended, kept = (slot.actor_id for slot in fleet.slots)
    run.collector.banned[liar] = "behavior logprobs are 0.9 nats/token off"
    backend.states[ended] = ActorStatus(ActorState.EXITED)
    status = train.reconcile_fleet.fn(fleet, run)
    assert status["actors_alive"] == 3 and liar in backend.terminated and kept in {s.actor_id for s in fleet.slots}
    assert run.revoked == {liar, ended}
    launched = [e["actor_id"] for e in read_events(run.store) if e["kind"] == "launch"]
    assert len(launched) == 5  # three, then one replacement each
    train.reconcile_fleet.fn(fleet, run)  # banned still: expelled once, not again
    assert [e["kind"] for e in read_events(run.store)].count("expelled") == 1
    assert len([e for e in read_events(run.store) if e["kind"] == "launch"]) == 5


def test_auto_sizing_is_counted_only_when_the_model_could_tell(tmp_path, monkeypatch):
    fleet, _, run = _fleet_and_run(tmp_path, ["fleet.actors=auto", "fleet.min_actors=1", "fleet.max_actors=4"])
    asked, answers = [], {4: None, 5: (3, "capacity model"), 15: (2, "capacity model")}

    def size(config, store, history):
        asked.append(run.step)
        return answers[run.step]

    monkeypatch.setattr(train.autosize, "auto_fleet_size", size)
    for run.step in range(1, 16):
        train.reconcile_fleet.fn(fleet, run)
    # from step 4 (the first has the actors' start-up); step 4 could not tell, so step 5 asked again; then
    # every RESIZE_EVERY steps after the sizing that counted
    assert asked == [4, 5, 15] and fleet.desired == 2 and len(fleet.slots) == 2
    resizes = [(e["actors_from"], e["actors_to"]) for e in read_events(run.store) if e["kind"] == "resize"]
    assert resizes == [(1, 3), (3, 2)]


def test_a_fixed_fleet_is_never_sized(tmp_path, monkeypatch):
    fleet, _, run = _fleet_and_run(tmp_path, ["fleet.actors=2"])
    monkeypatch.setattr(train.autosize, "auto_fleet_size", lambda *a: (4, "never asked"))
    run.step = 4
    train.reconcile_fleet.fn(fleet, run)
    assert fleet.desired == 2 and not [e for e in read_events(run.store) if e["kind"] == "resize"]
