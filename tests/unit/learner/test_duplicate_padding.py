"""What one actor's copies and slow files can make the learner do in a collection: a byte-for-byte copy is dropped
before it is decoded or graded and held against its actor, copies dilute no share, an actor's reads in one
collection are bounded, and a pass through files that each cost grading time ends at ``train.rollout_timeout_s``
and keeps telling the actors it is alive.

The task under the collector is a test double of a verifiable task's verifier (``Grader``): the math grader needs
real seconds per hanging reply, and all the collector sees of it is ``check`` returning, or raising the
"ungradable" refusal. Grading time is a fake clock the double moves (``FakeTime``, in place of the collector's
``time``), so no test waits on real time."""

from __future__ import annotations

import pytest
from helpers import commit_rollouts, make_rollouts

from echo2.data import layout
from echo2.data.rollouts import InvalidRollouts, RolloutLimits, encode_rollouts
from echo2.data.store import open_store
from echo2.learner import collector as collector_module
from echo2.learner.collector import NoRollouts, RolloutCollector

LIMITS = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                       reward_range=(0.0, 1.0), max_groups=2)
HANG = "-hang"
"""In a file's prompt ids: the file holds a reply the grader cannot grade in time."""


class FakeTime:
    """The collector's clock: ``sleep`` and grading move it, nothing waits."""

    def __init__(self):
        self.now = 1_000.0

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Grader:
    """Test double of the task's verifier: records the prompt id of every file it grades, takes ``seconds`` of
    the fake clock for each, and refuses a file holding a hanging reply as the math task does (ungradable)."""

    def __init__(self, clock: FakeTime | None = None, seconds: float = 0.0):
        self.graded: list[str] = []
        self.clock, self.seconds = clock, seconds

    def verify_claims(self, table) -> None:
        prompt = table.column("prompt_id")[0].as_py()
        self.graded.append(prompt)
        if self.clock is not None:
            self.clock.now += self.seconds
        if HANG in prompt:
            raise InvalidRollouts("ungradable, set aside (not held against the actor): a reply ran past the limit")


def collector(store, grader, **kw) -> RolloutCollector:
    return RolloutCollector(store, run_id="run", staleness=1, limits=LIMITS, verifier=grader,
                            **{"groups_per_step": 2, **kw})


def encoded(salt: str, actor: str, *, version: int = 1, note: float = 0.0) -> bytes:
    """A file's bytes; ``note`` changes the bytes (a timing in its metadata) and not the rollouts."""
    return encode_rollouts(make_rollouts(salt=salt), run_id="run", actor_id=actor, policy_version=version,
                           task="arithmetic", measured={"fetch_seconds": note})


def test_a_byte_copy_is_dropped_before_it_is_decoded_or_graded_and_held_against_its_actor(tmp_path):
    store = open_store(str(tmp_path))
    grader = Grader()
    col = collector(store, grader)
    data = encoded("real", "a-pad")
    real = commit_rollouts(store, 1, 0, actor="a-pad", data=data)
    sel = col.collect(step=2, learner_version=1, timeout_s=5)
    col.settle(sel)
    assert [u["key"] for u in sel.used] == [real] and grader.graded == ["p0real"]

    copies = [commit_rollouts(store, 1, seq, actor="a-pad", data=data) for seq in (1, 2)]
    fresh = commit_rollouts(store, 1, 0, actor="b-honest")
    sel = col.collect(step=3, learner_version=1, timeout_s=5)  # a-pad's copies sort first
    assert [u["key"] for u in sel.used] == [fresh]
    dropped = {d["key"]: d["reason"] for d in sel.dropped}
    assert set(dropped) == set(copies) and all("byte-for-byte copy" in r for r in dropped.values()), dropped
    assert all(d["sha256"] == sel_used_sha(store, 2) for d in sel.dropped)  # the content they copy
    assert len(grader.graded) == 2  # the fresh file: the copies were never graded
    assert col.invalid_files == {"a-pad": 2}


def sel_used_sha(store, step: int) -> str:
    return store.get_json(layout.consumed_key(step))["used"][0]["sha256"]


def test_padding_each_hanging_file_with_copies_of_one_real_batch_bans_the_actor(tmp_path):
    """The attack: every hanging-reply file comes with one real batch and three copies of it, so the actor's
    ungradable files stay a fifth of its judged files and it was never banned, however long it went on."""
    store = open_store(str(tmp_path))
    grader = Grader()
    col = collector(store, grader, groups_per_step=4)  # the real batch and an honest actor's file make a step
    for n in range(8):
        version, seq = 1 + n, 10 * (n + 1)
        real = encoded(f"real{n}", "a-pad", version=version)
        commit_rollouts(store, version, seq, actor="a-pad", data=real)
        commit_rollouts(store, version, seq + 1, actor="a-pad", salt=f"{HANG}{n}")
        for k in (2, 3, 4):
            commit_rollouts(store, version, seq + k, actor="a-pad", data=real)
        for k in (0, 1):
            commit_rollouts(store, version, k, actor="b-honest", salt=f"honest{n}-{k}")
        sel = col.collect(step=1 + version, learner_version=version, timeout_s=5)
        assert any("/b-honest-" in u["key"] for u in sel.used)
        col.settle(sel)
    assert "a-pad" in col.banned and "byte-for-byte copy" in col.banned["a-pad"], col.banned
    assert sum(HANG in g for g in grader.graded) == 1  # banned in the first round: one hanging file graded


def test_the_ungradable_share_counts_only_the_novel_files_an_actor_had_used(tmp_path):
    """Twenty copies of one used batch in other bytes (dropped as duplicates) no longer make six hanging files a
    small share: they were 6 of 27 judged files, they are 6 against 1 novel file used."""
    store = open_store(str(tmp_path))
    col = collector(store, Grader(), max_ungradable_files=5, max_ungradable_fraction=0.25)
    commit_rollouts(store, 1, 0, actor="a-pad", data=encoded("real", "a-pad"))
    col.settle(col.collect(step=2, learner_version=1, timeout_s=5))
    copies = iter(range(1, 21))
    for step in range(3, 7):  # five copies a collection (an actor's reads in one collection are bounded)
        for _ in range(5):
            n = next(copies)
            commit_rollouts(store, 1, n, actor="a-pad", data=encoded("real", "a-pad", note=float(n)))
        commit_rollouts(store, 1, 0, actor=f"b-honest{step}")
        sel = col.collect(step=step, learner_version=1, timeout_s=5)
        assert sum(d["reason"].startswith("duplicate: the same rollouts") for d in sel.dropped) == 5
        col.settle(sel)
    assert not col.banned and col.invalid_files == {}  # copies in other bytes are not held against it
    for seq in range(6):
        commit_rollouts(store, 1, 100 + seq, actor="a-pad", salt=f"{HANG}{seq}")
    commit_rollouts(store, 1, 0, actor="b-honest9")
    col.collect(step=7, learner_version=1, timeout_s=5)
    assert "6 of its files could not be graded, against 1 novel files" in col.banned.get("a-pad", ""), col.banned


def test_an_actors_reads_in_one_collection_are_bounded(tmp_path):
    """Forty files of one actor that each must be read (copies of a used batch in other bytes): one collection
    reads at most its budget of them, the rest wait in the store for the next collections."""
    store = open_store(str(tmp_path))
    grader = Grader()
    col = collector(store, grader)
    commit_rollouts(store, 1, 0, actor="a-flood", data=encoded("real", "a-flood"))
    col.settle(col.collect(step=2, learner_version=1, timeout_s=5))
    flood = [commit_rollouts(store, 1, n, actor="a-flood", data=encoded("real", "a-flood", note=float(n)))
             for n in range(1, 41)]
    budget = 2 + 3 + 5  # groups_per_step + max_invalid_files + max_ungradable_files
    judged = set()
    for step in range(3, 8):
        commit_rollouts(store, 1, step, actor="b-honest")
        before = len(grader.graded)
        sel = col.collect(step=step, learner_version=1, timeout_s=5)
        assert [u["key"] for u in sel.used] == [layout.rollout_key(1, "b-honest", step)]
        now = {d["key"] for d in sel.dropped} & set(flood)
        assert len(now) <= budget and len(grader.graded) - before <= budget + 1, (step, len(now))
        judged |= now
        col.settle(sel)
    assert judged == set(flood)  # every one judged in the end, over five collections


def test_a_pass_through_slow_files_ends_at_the_deadline_not_after_them(tmp_path, monkeypatch):
    """Forty files of forty actors, each taking 1 s to find ungradable, and a timeout of 5 s: ``NoRollouts``
    after about five of them, not after all forty (the deadline was looked at between passes only)."""
    clock = FakeTime()
    monkeypatch.setattr(collector_module, "time", clock)
    store = open_store(str(tmp_path))
    grader = Grader(clock, seconds=1.0)
    col = collector(store, grader)
    for n in range(40):
        commit_rollouts(store, 1, 0, actor=f"j{n:02d}", salt=f"{HANG}{n}")
    with pytest.raises(NoRollouts, match="no usable rollouts for 5s"):
        col.collect(step=2, learner_version=1, timeout_s=5, poll_s=1.0)
    assert 5 <= len(grader.graded) <= 7, len(grader.graded)


def test_a_long_pass_keeps_telling_the_actors_it_is_alive(tmp_path, monkeypatch):
    """Thirty files that take 10 s each to grade before the step's file: ``collecting.json`` is rewritten at least
    every ``progress_every_s`` (30 s) meanwhile, so an actor never takes a learner busy judging for a dead one."""
    clock = FakeTime()
    monkeypatch.setattr(collector_module, "time", clock)
    store = open_store(str(tmp_path))
    written: list[float] = []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def put_pointer(self, key, data):
            if key == layout.COLLECTING:
                written.append(clock.now)
            return self.inner.put_pointer(key, data)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    col = collector(Recording(store), Grader(clock, seconds=10.0))
    for n in range(30):
        commit_rollouts(store, 1, 0, actor=f"j{n:02d}", salt=f"{HANG}{n}")
    commit_rollouts(store, 1, 0, actor="z-honest")
    started = clock.now
    sel = col.collect(step=2, learner_version=1, timeout_s=3600)
    assert [u["key"] for u in sel.used] == [layout.rollout_key(1, "z-honest", 0)] and clock.now - started >= 300
    gaps = [b - a for a, b in zip([started, *written], written)]
    assert len(written) >= 9 and max(gaps) <= 30 + 10, (written, gaps)
