"""Issue 23, item 3: a spot learner's actors outlive it, and the resumed learner adopts them.

Local backend: an actor of a ``learner.market: spot`` learner runs in its own session without the parent-death
signal or ``--parent-pid``, survives a SIGKILL of the learner's whole process tree, and a new learner's fleet
adopts it (one ``adopt`` event, no launch) after checking its pid, boot id and command line; a pid that is
another process now is not adopted. Collector: with adoption, a file of version v > c is lost only when the
signed manifest it names is not this timeline's v (``rollouts.POLICY_DIGEST_KEY``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import commit_rollouts, make_rollouts

from echo2.config import LocalFleetConfig
from echo2.data import layout
from echo2.data.ledger import read_events, write_event
from echo2.data.rollouts import RolloutLimits, encode_rollouts, file_policy_digest, policy_digest
from echo2.data.run_key import run_key
from echo2.data.store import open_store
from echo2.fleet import adoption
from echo2.fleet.backends.base import AdoptError, LaunchContext, RelaySecrets
from echo2.fleet.backends.local import LocalBackend
from echo2.fleet.make import make_fleet

SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.2)"]
"""A stand-in for ``echo2 actor`` (the ``actor_command`` seam): a process that runs until it is stopped."""


def events(store, kind):
    return [e for e in read_events(store) if e.get("kind") == kind]


def wait_for(predicate, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def spot_run(tmp_path):
    store = open_store(str(tmp_path / "runs" / "r"))
    store.put(layout.RUN_JSON, json.dumps({"run_id": "r", "config": {"learner": {"market": "spot"}}}).encode())
    return store


LEARNER = textwrap.dedent("""
    import json, sys, time
    from echo2.config import LocalFleetConfig
    from echo2.data.run_key import run_key
    from echo2.data.store import open_store
    from echo2.fleet.make import make_fleet
    store = open_store(sys.argv[1])
    fleet = make_fleet(LocalFleetConfig(actors=2), store, store_options={}, log_dir=__import__("pathlib").Path(
        sys.argv[2]), run_key=run_key("r", create=True), run_id="r", actor_command=json.loads(sys.argv[3]))
    fleet.start()
    print(json.dumps([s.actor_id for s in fleet.slots]), flush=True)
    time.sleep(600)
""")


@pytest.mark.e2e
def test_a_spot_learners_local_actors_outlive_its_killed_process_tree_and_are_adopted(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    store = spot_run(tmp_path)
    learner = subprocess.Popen([sys.executable, "-c", LEARNER, store.url, str(tmp_path / "logs"), json.dumps(SLEEPER)],
                               stdout=subprocess.PIPE, text=True, start_new_session=True, env=dict(os.environ))
    try:
        ids = json.loads(learner.stdout.readline())
        launches = {e["actor_id"]: e for e in events(store, "launch")}
        assert sorted(launches) == sorted(ids)
        for e in launches.values():  # what adoption needs, recorded at launch
            assert e["outlives_learner"] is True and e["boot_id"] and e["host"] and e["marker"][-1] == e["actor_id"]
        pids = [launches[a]["pid"] for a in ids]
        for pid in pids:  # no parent-pid watch, own session
            argv = open(f"/proc/{pid}/cmdline").read().split("\0")
            assert "--parent-pid" not in argv and os.getsid(pid) != os.getsid(learner.pid)
        os.killpg(learner.pid, signal.SIGKILL)  # the learner's whole process tree
        learner.wait()
        os.kill(pids[1], signal.SIGKILL)  # one actor dies during the gap: it cannot be adopted
        wait_for(lambda: not alive(pids[1]), "the second actor to die")
        write_event(store, "resume", "learner", step=0)
        fleet = make_fleet(LocalFleetConfig(actors=2), store, store_options={}, log_dir=tmp_path / "logs",
                           run_key=run_key("r"), run_id="r", actor_command=SLEEPER)
        fleet.start()
        adopted = events(store, "adopt")
        assert [(e["actor_id"], e["how"], e["backend"], e["resigned"]) for e in adopted] == [
            (ids[0], "pid", "local", False)]
        assert [e["actor_id"] for e in events(store, "adopt_failed")] == [ids[1]]
        assert ids[1] in fleet.revoked and ids[0] not in fleet.revoked
        assert len(events(store, "launch")) == 3  # only the unreachable one replaced
        assert fleet.reconcile()["actors_alive"] == 2
        assert fleet.backend.poll(ids[0]).state.value == "running" and alive(pids[0])  # outlived the learner
        fleet.stop()  # the adopted actor is stopped by its pid
        assert not alive(pids[0])
        assert ids[0] in [e["actor_id"] for e in events(store, "terminated")]
    finally:
        for e in events(store, "launch"):
            try:
                os.kill(e["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(learner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_an_on_demand_learners_local_actors_still_watch_their_parent(tmp_path):
    context = LaunchContext(store_url="file:///x", store_options={}, relay_secrets=RelaySecrets(_key(), "r"),
                            run_id="r")
    spec = LocalBackend(LocalFleetConfig(), tmp_path).launch_spec("actor0-abcdef", _offer(), context)
    assert spec.command[-2:] == ["--parent-pid", str(os.getpid())]


def _key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate()


def _offer():
    from echo2.fleet.backends.base import ActorOffer

    return ActorOffer()


def test_a_pid_that_is_another_process_or_another_boot_is_never_adopted(tmp_path):
    other = subprocess.Popen(SLEEPER + ["--run", "file:///x", "--actor-id", "actor0-aaaaaa"])
    try:
        backend = LocalBackend(LocalFleetConfig(), tmp_path)
        context = LaunchContext(store_url="file:///x", store_options={}, relay_secrets=RelaySecrets(_key(), "r"),
                                run_id="r")
        from echo2.fleet.backends.local import boot_id

        event = {"pid": other.pid, "boot_id": boot_id(), "log": str(tmp_path / "a.log")}
        with pytest.raises(AdoptError, match="another process"):
            backend.adopt("actor0-bbbbbb", event, context, _offer())  # its pid, another actor's command line
        with pytest.raises(AdoptError, match="another process"):
            backend.adopt("actor0-aaaaaa", event, LaunchContext(
                store_url="file:///y", store_options={}, relay_secrets=RelaySecrets(_key(), "r"), run_id="r"), _offer())
        with pytest.raises(AdoptError, match="another machine or boot"):
            backend.adopt("actor0-aaaaaa", {**event, "boot_id": "0000"}, context, _offer())
        assert backend.adopt("actor0-aaaaaa", event, context, _offer()) == "pid"
        backend.terminate("actor0-aaaaaa", grace_s=5)
        assert other.wait(5) == -signal.SIGTERM
        with pytest.raises(AdoptError, match="gone"):
            LocalBackend(LocalFleetConfig(), tmp_path).adopt("actor0-aaaaaa", event, context, _offer())
    finally:
        other.kill()
        other.wait()


def test_the_ledger_names_the_candidates_and_what_a_resume_revokes_at_once():
    evs = [{"ts": 1, "kind": "launch", "actor_id": "actor0-aa"}, {"ts": 2, "kind": "launch", "actor_id": "actor1-bb"},
           {"ts": 3, "kind": "reclaimed", "actor_id": "actor1-bb"},
           {"ts": 4, "kind": "launch", "actor_id": "actor2-cc"},
           {"ts": 5, "kind": "adopt_failed", "actor_id": "actor2-cc"}, {"ts": 6, "kind": "launch", "actor_id": "x"}]
    assert [e["actor_id"] for e in adoption.candidates(evs)] == ["actor0-aa", "x"]
    assert adoption.revoked_on_resume(evs) == {"actor1-bb", "actor2-cc"}
    assert adoption.slot_index("actor12-0a1b2c") == 12 and adoption.slot_index("x") is None


# -- the collector: a file of the new timeline from an adopted actor is used ---------------------------------

def test_an_adopted_actors_files_are_judged_by_the_manifest_they_name(tmp_path):
    from echo2.learner.collector import RolloutCollector
    from echo2.learner.resume import lost_timelines

    store = open_store(str(tmp_path / "runs" / "run"))
    old_v1 = {"version": 1, "signature": "old"}
    new_v1 = {"version": 1, "signature": "new"}
    store.put(layout.manifest_key(layout.policy_dir(1)), json.dumps(new_v1).encode())  # this timeline's v1
    write_event(store, "launch", "adopted0")
    write_event(store, "resume", "learner", step=0)

    def commit(version, seq, manifest):
        data = encode_rollouts(make_rollouts(salt=f"{version}-{seq}"), run_id="run", actor_id="adopted0",
                               policy_version=version, task="arithmetic",
                               policy_digest=policy_digest(manifest) if manifest else None)
        assert file_policy_digest(data) == (policy_digest(manifest) if manifest else None)
        return commit_rollouts(store, version, seq, actor="adopted0", data=data)

    good = commit(1, 0, new_v1)
    good2 = commit(1, 7, new_v1)  # after the garbage: the step fills with it
    stale_timeline = commit(1, 1, old_v1)
    no_field = commit(1, 2, None)
    future = commit(3, 4, {"version": 3})  # still on the dead learner's v3 when it committed
    garbage = commit_rollouts(store, 1, 5, actor="adopted0", data=b"not an arrow file")
    torn = commit_rollouts(store, 3, 6, actor="adopted0", data=commit_bytes(store, good)[:200])
    limits = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                           reward_range=(0.0, 1.0))
    collector = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=4, limits=limits,
                                 lost_timelines=lost_timelines(read_events(store)))
    sel = collector.collect(step=2, learner_version=1, timeout_s=30)
    assert {u["key"] for u in sel.used} == {good, good2}
    dropped = {d["key"]: d["reason"] for d in sel.dropped}
    assert set(dropped) == {stale_timeline, no_field, future}, dropped
    assert all(r.startswith("lost timeline") for r in dropped.values())
    # well-formed files of the lost timeline are no mark against the actor; a file that does not even decode is
    # malformed whatever its timeline (it was dropped as "lost timeline", uncounted: a free junk channel)
    assert {q["key"] for q in sel.quarantined} == {garbage, torn}, sel.quarantined
    assert collector.invalid_files == {"adopted0": 2}


def commit_bytes(store, key: str) -> bytes:
    return store.get(key)


def test_only_a_file_naming_the_lost_timelines_manifest_earns_the_drop_and_only_so_many(tmp_path):
    """The resume recorded the lost timeline's manifests: a well-formed file naming a manifest neither timeline
    signed is malformed; and an actor gets as many free drops as files it could have made while that timeline
    lived (here one version, a step of four single-group files, and a backlog of two), no more."""
    from echo2.learner.collector import RolloutCollector
    from echo2.learner.resume import lost_timelines

    store = open_store(str(tmp_path / "runs" / "run"))
    lost_v1 = {"version": 1, "signature": "lost"}
    write_event(store, "launch", "adopted0")
    write_event(store, "resume", "learner", step=0, lost_latest=1, lost_digests={"1": policy_digest(lost_v1)})

    def commit(seq, manifest, actor="adopted0"):
        data = encode_rollouts(make_rollouts(n_groups=1, salt=f"{actor}-{seq}"), run_id="run", actor_id=actor,
                               policy_version=1, task="arithmetic",
                               policy_digest=policy_digest(manifest) if manifest else None)
        return commit_rollouts(store, 1, seq, actor=actor, data=data)

    forged = commit(0, {"version": 1, "signature": "neither timeline's"})
    lost = [commit(seq, lost_v1 if seq % 2 else None) for seq in range(1, 31)]
    fresh = [commit(seq, None, actor="b") for seq in range(4)]
    limits = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                           reward_range=(0.0, 1.0), max_groups=1)
    collector = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=4, limits=limits,
                                 lost_timelines=lost_timelines(read_events(store)))
    sel = collector.collect(step=2, learner_version=1, timeout_s=30)
    assert {u["key"] for u in sel.used} == set(fresh)
    reasons = {q["key"]: q["reason"] for q in sel.quarantined}
    assert "that neither this timeline nor the one lost at the resume from step 0 signed" in reasons[forged]
    allowance = 1 * 4 + 2
    assert [d["key"] for d in sel.dropped] == lost[:allowance]
    assert all("than actor adopted0 could have made (6)" in reasons[k] for k in lost[allowance:allowance + 2])
    assert "adopted0" in collector.banned and not set(lost[allowance + 2:]) & sel.keys  # the rest: its ban


def test_a_file_beyond_the_lost_timelines_newest_version_is_from_the_future(tmp_path):
    """An actor of the lost timeline held versions up to the dead learner's LATEST at most: a file it claims from a
    newer one is junk (quarantined, counted against it), not a free drop as "lost timeline" (which would let an
    actor holding one pre-resume credential flood the learner with files that cost it nothing)."""
    from echo2.learner.collector import RolloutCollector
    from echo2.learner.resume import lost_timelines

    store = open_store(str(tmp_path / "runs" / "run"))
    write_event(store, "launch", "adopted0")
    write_event(store, "resume", "learner", step=0, lost_latest=3)

    def commit(version, seq):
        data = encode_rollouts(make_rollouts(salt=f"{version}-{seq}"), run_id="run", actor_id="adopted0",
                               policy_version=version, task="arithmetic", policy_digest=None)
        return commit_rollouts(store, version, seq, actor="adopted0", data=data)

    held = commit(3, 0)  # the dead learner published v3: the actor may well have generated with it
    beyond = commit(9, 1)  # nobody ever published v9
    fresh = {commit_rollouts(store, 0, seq, actor="b", salt=f"b{seq}") for seq in (2, 3)}  # the step's groups
    limits = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                           reward_range=(0.0, 1.0))
    collector = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=4, limits=limits,
                                 lost_timelines=lost_timelines(read_events(store)))
    sel = collector.collect(step=1, learner_version=0, timeout_s=30)
    assert {u["key"] for u in sel.used} == fresh
    assert [d["key"] for d in sel.dropped] == [held] and sel.dropped[0]["reason"].startswith("lost timeline")
    assert [q["key"] for q in sel.quarantined] == [beyond] and "from the future" in sel.quarantined[0]["reason"]
    assert collector.invalid_files.get("adopted0") == 1


# -- the actor's view of the ledger after a resume -----------------------------------------------------------

def test_an_adopted_actor_reads_the_ledger_anew_once_a_resume_rewrote_it(tmp_path):
    """The resume moves the entries after its checkpoint aside and the new timeline writes the same step numbers
    again: the actor's flow control must count what the new entries settled, or every actor would wait for the
    learner while it waits for them (seen in the learner-reclaim scenario before this)."""
    from types import SimpleNamespace

    from echo2.data.ledger import ConsumedIndex, write_consumed
    from echo2.data.run_folder import orphan_after
    from echo2.rollout.actor import Actor

    store = open_store(str(tmp_path / "runs" / "run"))
    a = commit_rollouts(store, 0, 0, actor="a")
    b = commit_rollouts(store, 1, 1, actor="a")
    write_consumed(store, 1, {"learner_version": 0, "used": [{"key": a}], "dropped": [], "quarantined": []})
    write_consumed(store, 2, {"learner_version": 1, "used": [], "dropped": [], "quarantined": []})
    actor = SimpleNamespace(store=store, consumed=ConsumedIndex(store), _newest_entry=None)
    actor._entry_mark = lambda step: Actor._entry_mark(actor, step)
    Actor._refresh_consumed(actor)
    assert actor.consumed.latest_step == 2 and b not in actor.consumed.settled
    time.sleep(0.01)  # a later modification time for the rewritten entry (the resume comes seconds later in life)
    orphan_after(store, 1)  # the resume from checkpoint 1: entry 2 moved aside (and v1's file with it)
    c = commit_rollouts(store, 1, 2, actor="a")  # the adopted actor's file of the new timeline's v1
    write_consumed(store, 2, {"learner_version": 1, "used": [{"key": c}], "dropped": [], "quarantined": []})
    Actor._refresh_consumed(actor)
    assert c in actor.consumed.settled, "the rewritten entry of step 2 was not read again"
    assert actor.consumed.backlog("a", 0, 2, cap=4) == 1  # b alone waits (a stale index counted c too)
    Actor._refresh_consumed(actor)  # nothing changed: the same index goes on
    assert actor._newest_entry[0] == 2
