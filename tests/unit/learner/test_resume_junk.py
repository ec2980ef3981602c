"""A resume against a hostile store: ten thousand empty files in future folders do not stall it or its first
collection (the resume moves no rollout file, the collection writes nothing per junk file), a resume interrupted
after it re-pointed ``LATEST`` still leaves the lost timeline's newest version for the next one, and a ban found
after the last checkpoint holds after the resume.

A real learner (``LearnerRun``, the tiny model, a local store); the store is wrapped only to count writes, or to
stop the first resume where a kill would."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import commit_rollouts, rollout_bytes

from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.ledger import read_events, write_event
from echo2.data.rollouts import decode_rollouts
from echo2.data.run_key import KEY_ENV
from echo2.data.store import open_store
from echo2.learner.resume import lost_timelines
from echo2.learner.run import LearnerRun

RUN = "r1"
WRITES = ("put", "put_pointer", "put_json", "copy", "move", "delete", "delete_prefix")


@pytest.fixture(autouse=True)
def key_here(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv(KEY_ENV, raising=False)


class Watched:
    """A run's store (and the run folder's ``child``), every write counted with its thread; ``stop_after``: the
    write after which the process "dies" (raises), as a SIGKILL there would leave the store."""

    def __init__(self, store, writes: list, stop_after=None):
        self.store, self.writes, self.stop_after = store, writes, stop_after

    def child(self, prefix):
        return Watched(self.store.child(prefix), self.writes, self.stop_after)

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if name not in WRITES:
            return attr

        def write(key, *args, **kw):
            self.writes.append((name, key, threading.current_thread().name))
            out = attr(key, *args, **kw)
            if self.stop_after is not None and self.stop_after(name, key):
                raise KeyboardInterrupt(f"killed after {name} {key}")
            return out
        return write


def learner_run(tiny_model, tmp_path, *, resume: bool, runs=None) -> LearnerRun:
    config = config_from_dict({
        "run": {"id": RUN}, "store": {"url": str(tmp_path / "store")}, "model": {"name": str(tiny_model)},
        "rollout": {"group_size": 2, "groups_per_batch": 1, "max_new_tokens": 4},
        "train": {"max_steps": 10, "checkpoint_every": 2, "groups_per_step": 1, "staleness": 2},
        "trust": {"spot_check_fraction": 0}, "learner": {"num_threads": 1},
        "eval": {"before": False, "after": False}, "fleet": {"actors": 1},
    })
    runs = runs if runs is not None else open_store(str(tmp_path / "store")).child(layout.RUNS)
    return LearnerRun(config, runs, resume=resume)


def step(run: LearnerRun) -> None:
    """One optimizer step on a fixed file and the publish of its version, as ``update`` would."""
    run.learner.train_step([decode_rollouts(rollout_bytes(0, salt=str(run.step)))])
    run.publish()


def honest_file(store, version: int, seq: int = 0) -> str:
    """A file the run can use (its verifier, a test double's business here, is left out of the run)."""
    return commit_rollouts(store, version, seq, actor="honest", run_id=RUN, n_groups=1)


def dead_learner(tiny_model, tmp_path) -> LearnerRun:
    """A learner that checkpointed step 2, then published v3 and v4 and died: the lost timeline is v3..v4."""
    run = learner_run(tiny_model, tmp_path, resume=False)
    step(run)
    step(run)
    run.checkpoint()
    step(run)
    step(run)
    write_event(run.store, "launch", "adopted0")  # one of its actors
    run.sink.close()
    return run


def test_the_first_collection_after_a_resume_with_ten_thousand_empty_future_files_returns_at_once(tiny_model,
                                                                                                 tmp_path):
    """Before, the resume copied and deleted each of them (orphaned/) before the run could go on: twenty
    thousand store writes on the critical path. Now the resume records a boundary and the first collection's
    sweep bans their writer at its listing; the janitor deletes them on its own thread."""
    dead = dead_learner(tiny_model, tmp_path)
    store = dead.store
    for n in range(10_000):
        store.put(layout.rollout_key(100_000 + n // 100, "flood", n), b"")
    usable = honest_file(store, 2)
    writes: list = []
    started = time.monotonic()
    resumed = learner_run(tiny_model, tmp_path, resume=True,
                          runs=Watched(open_store(str(tmp_path / "store")), writes).child(layout.RUNS))
    resumed.collector.verifier = None
    sel = resumed.collect()
    elapsed = time.monotonic() - started
    assert [u["key"] for u in sel.used] == [usable]
    here = [(op, key) for op, key, thread in writes if thread == threading.current_thread().name]
    assert not [k for _, k in here if k.startswith(layout.ROLLOUTS + "v1")], "a junk file was written or moved"
    assert len(here) < 100, here[:20]
    assert "flood" in resumed.collector.banned
    assert elapsed < 60, elapsed  # a failure bound only (the writes above are the measure)
    resumed.collector.janitor.drain()
    assert sum(1 for op, key, thread in writes if op == "delete" and "/flood-" in key) > 0
    resumed.sink.close()


def test_a_resume_killed_after_it_re_pointed_latest_leaves_the_lost_timelines_newest_version(tiny_model, tmp_path):
    """The dead learner published up to v4 after checkpoint 2. A first resume dies right after it re-points LATEST
    at v2; before, its boundary was written after that (so never), and the second resume, reading LATEST = 2,
    recorded v2 as the lost timeline's newest: the adopted actor's files of v3 and v4 became "from the future"."""
    dead_learner(tiny_model, tmp_path)
    writes: list = []
    with pytest.raises(KeyboardInterrupt):
        learner_run(tiny_model, tmp_path, resume=True, runs=Watched(
            open_store(str(tmp_path / "store")), writes,
            stop_after=lambda op, key: op == "put_pointer" and key == layout.LATEST).child(layout.RUNS))
    store = open_store(str(tmp_path / "store")).child(layout.RUNS).child(RUN)
    assert store.get_json(layout.LATEST) == {"version": 2}
    resumed = learner_run(tiny_model, tmp_path, resume=True)
    recorded = [e.get("lost_latest") for e in read_events(store) if e.get("kind") == "resume"]
    assert 4 in recorded, recorded
    [lost] = lost_timelines(read_events(store))  # both resumes' events: one lost timeline
    assert lost.step == 2 and lost.newest == 4 and set(lost.digests) == {3, 4}
    assert resumed.collector.lost_timelines == [lost]
    resumed.sink.close()


def test_a_ban_found_after_the_last_checkpoint_holds_after_the_resume(tiny_model, tmp_path):
    run = learner_run(tiny_model, tmp_path, resume=False)
    step(run)
    step(run)
    run.checkpoint()
    run.collector.verifier = None
    store = run.store
    for seq in range(3):
        commit_rollouts(store, 2, seq, actor="evil", run_id=RUN, data=b"garbage %d" % seq)
    honest_file(store, 2)
    run.collect()  # step 3's files: evil banned, nothing checkpointed after it
    assert "evil" in run.banned
    run.sink.close()
    resumed = learner_run(tiny_model, tmp_path, resume=True)
    assert "3 invalid or future-version files" in resumed.banned.get("evil", "")  # what the fleet expels
    assert "evil" in resumed.revoked  # and what the next version revokes
    resumed.sink.close()
