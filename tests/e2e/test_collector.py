"""The staleness filter, FIFO selection and quarantine of malformed rollout files."""

import pytest
from helpers import commit_rollouts, ledger_audit, make_rollouts, put_glacier, rollout_bytes

from echo2.data import layout
from echo2.data.ledger import ConsumedIndex
from echo2.data.rollouts import RolloutLimits
from echo2.data.store import open_store
from echo2.learner.collector import RolloutCollector, is_fresh

LIMITS = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                       reward_range=(0.0, 1.0))


def test_bound_is_inclusive():
    assert is_fresh(5, 3, 2) and not is_fresh(5, 2, 2)
    assert is_fresh(4, 4, 0) and not is_fresh(4, 3, 0)


def _collector(store, **kw):
    args = dict(run_id="run", staleness=1, groups_per_step=4, limits=LIMITS)
    args.update(kw)
    return RolloutCollector(store, **args)


def test_stale_files_are_dropped_and_counted_fresh_ones_used_oldest_first(tmp_path):
    store = open_store(str(tmp_path))
    keys = {v: commit_rollouts(store, v, 0) for v in range(4)}  # 2 groups each
    extra = commit_rollouts(store, 3, 1)
    sel = _collector(store).collect(step=4, learner_version=3, timeout_s=5)
    # t=3, S=1: v0 (lag 3) and v1 (lag 2) are too stale; v2 and v3 give the 4 groups
    assert [d["key"] for d in sel.dropped] == [keys[0], keys[1]]
    assert all("stale" in d["reason"] for d in sel.dropped)
    assert [(u["key"], u["lag"]) for u in sel.used] == [(keys[2], 1), (keys[3], 0)]
    assert sel.groups == 4
    record = store.get_json(layout.consumed_key(4))
    assert record["learner_version"] == 3 and len(record["used"]) == 2 and len(record["dropped"]) == 2
    # the unused fresh file stays for the next step; the ledger view agrees
    assert extra not in ConsumedIndex(store).refresh()
    assert set(ConsumedIndex(store).refresh()) == set(keys.values())


def test_malformed_files_are_quarantined_with_reason_and_the_step_goes_on(tmp_path):
    store = open_store(str(tmp_path))
    garbage = commit_rollouts(store, 2, 0, data=b"\x00not arrow")
    foreign = commit_rollouts(store, 2, 1, run_id="someone-else")
    rows = make_rollouts()
    rows[0].completion_token_ids = [4, 5, 999]
    bad_vocab = commit_rollouts(store, 2, 2, data=rollout_bytes(2, rollouts=rows))
    good = [commit_rollouts(store, 2, 3, actor="b"), commit_rollouts(store, 2, 4, actor="b")]  # an honest actor's
    sel = _collector(store).collect(step=3, learner_version=2, timeout_s=5)
    assert [u["key"] for u in sel.used] == good
    assert {q["key"] for q in sel.quarantined} == {garbage, foreign, bad_vocab}
    for key in (garbage, foreign, bad_vocab):
        assert not store.exists(key)
        assert store.exists(layout.quarantine_key(key))  # the bytes are kept
        reason = store.get_json(layout.quarantine_key(key) + ".json")["reason"]
        assert reason
    assert "vocabulary" in store.get_json(layout.quarantine_key(bad_vocab) + ".json")["reason"]
    assert "run" in store.get_json(layout.quarantine_key(foreign) + ".json")["reason"]


def test_waits_then_times_out_with_a_clear_message(tmp_path):
    store = open_store(str(tmp_path))
    commit_rollouts(store, 0, 0)
    with pytest.raises(TimeoutError, match="no usable rollouts"):
        _collector(store).collect(step=1, learner_version=0, timeout_s=0.5, poll_s=0.1)


def test_settled_files_are_never_used_twice(tmp_path):
    store = open_store(str(tmp_path))
    k1, k2 = commit_rollouts(store, 0, 0), commit_rollouts(store, 0, 1)
    col = _collector(store, groups_per_step=2)
    assert [u["key"] for u in col.collect(step=1, learner_version=0, timeout_s=5).used] == [k1]
    assert [u["key"] for u in col.collect(step=2, learner_version=1, timeout_s=5).used] == [k2]


def _task_rollouts(tokenizer, task, problems, *, completion="7", reward=None, salt=0):
    from echo2.data.rollouts import Rollout
    from echo2.tasks import prompt_token_ids

    out = []
    for g, problem in enumerate(problems):
        prompt = prompt_token_ids(tokenizer, problem)
        for s in range(2):
            text = completion if s == 0 else str(problem.answer)
            ids = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
            r = task.reward(problem, text)[0] if reward is None else reward
            out.append(Rollout(prompt_id=problem.id, group_id=f"g{g}", sample_index=s, prompt_token_ids=prompt,
                               completion_token_ids=ids, behavior_logprobs=[-1.0 - salt] * len(ids), reward=r,
                               finish_reason="stop"))
    return out


def _verifying_collector(store, tiny_model):
    from transformers import AutoTokenizer

    from echo2.learner.verify import TaskVerifier
    from echo2.tasks.arithmetic import ArithmeticTask

    tok = AutoTokenizer.from_pretrained(tiny_model)
    task = ArithmeticTask(digits=1, eval_size=10)
    limits = LIMITS.__class__(vocab_size=len(tok), group_size=2, max_completion_tokens=8, max_prompt_tokens=64,
                              reward_range=(0.0, 1.0))
    col = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=2, limits=limits,
                           verifier=TaskVerifier(task, tok, max_new_tokens=8))
    return col, tok, task


def test_prompts_are_re_derived_and_rewards_re_scored(tmp_path, tiny_model):
    """An actor cannot train the policy on text of its choosing, on the held-out set, or with made-up rewards."""
    import dataclasses

    store = open_store(str(tmp_path))
    col, tok, task = _verifying_collector(store, tiny_model)
    train = task.sample_train(__import__("random").Random(0), 2)
    honest = _task_rollouts(tok, task, train)
    forged_prompt = [dataclasses.replace(r, prompt_token_ids=tok("ignore the task")["input_ids"]) for r in honest]
    held_out = _task_rollouts(tok, task, task.eval_set()[:2])
    lying = _task_rollouts(tok, task, train, completion="nonsense", reward=1.0, salt=1)
    # one actor per file: a dishonest file bans its actor, so an honest actor must be another one
    # (named so the honest file is listed last, as the collector takes files in key order)
    actors = {"prompt": "a1-prompt", "held": "a2-held", "reward": "a3-reward", "honest": "a4-honest"}
    keys = {name: commit_rollouts(store, 1, 0, actor=actors[name], data=rollout_bytes(1, rollouts=rows,
                                                                                       actor=actors[name]))
            for name, rows in [("prompt", forged_prompt), ("held", held_out), ("reward", lying), ("honest", honest)]}
    sel = col.collect(step=2, learner_version=1, timeout_s=5)
    assert [u["key"] for u in sel.used] == [keys["honest"]]
    reasons = {q["key"]: q["reason"] for q in sel.quarantined}
    assert "prompt tokens are not those the task issues" in reasons[keys["prompt"]]
    assert "held-out" in reasons[keys["held"]]
    assert "the task scores the completion 0" in reasons[keys["reward"]]
    assert set(col.banned) == {"a1-prompt", "a2-held", "a3-reward"}
    # a later file of a banned actor is never judged, however honest it looks: its ban record in the ledger stands
    # for it and the janitor deletes it, off the collection's path
    col.settle(sel)
    later = commit_rollouts(store, 2, 1, actor="a3-reward",
                            data=rollout_bytes(2, rollouts=_task_rollouts(tok, task, train, salt=2), actor="a3-reward"))
    commit_rollouts(store, 2, 1, actor="a4-honest",
                    data=rollout_bytes(2, rollouts=_task_rollouts(tok, task, train, salt=3), actor="a4-honest"))
    sel = col.collect(step=3, learner_version=2, timeout_s=5)
    assert later not in sel.keys and sel.banned == ["a1-prompt", "a2-held", "a3-reward"]
    col.janitor.drain()
    assert not store.exists(later)
    assert "the task scores the completion 0" in store.get_json(layout.ban_key("a3-reward"))["reason"]


def test_the_same_content_under_two_names_is_used_once(tmp_path):
    store = open_store(str(tmp_path))
    data = rollout_bytes(1)
    first = commit_rollouts(store, 1, 0, data=data)
    copy = commit_rollouts(store, 1, 1, data=data)
    later_copy = commit_rollouts(store, 1, 2, data=data)
    fresh = commit_rollouts(store, 1, 3)
    col = _collector(store, groups_per_step=2)
    sel = col.collect(step=2, learner_version=1, timeout_s=5)
    col.settle(sel)
    assert [u["key"] for u in sel.used] == [first]
    sel = col.collect(step=3, learner_version=2, timeout_s=5)  # a copy of a file a completed step used
    assert [u["key"] for u in sel.used] == [fresh]
    assert [(d["key"], d["reason"].split(":")[0]) for d in sel.dropped] == [(copy, "duplicate"),
                                                                           (later_copy, "duplicate")]
    assert store.get_json(layout.consumed_key(2))["used"][0]["sha256"] == sel.dropped[0]["sha256"]


def test_a_poll_lists_only_the_version_folders_a_step_can_use(tmp_path):
    """Collect time must not grow with the files older versions hold (chaos issue, load scenario)."""
    from echo2.learner.collector import FULL_SWEEP_EVERY

    class Counting:  # the real store, with every listing's prefix counted
        def __init__(self, store):
            self.store, self.prefixes = store, []

        def list(self, prefix=""):
            self.prefixes.append(prefix)
            return self.store.list(prefix)

        def __getattr__(self, name):
            return getattr(self.store, name)

    store = open_store(str(tmp_path))
    for v in range(6):  # versions 0..5 hold 10 files each; the run is at version 8 with S = 1
        for seq in range(10):
            commit_rollouts(store, v, seq)
    counting = Counting(store)
    collector = _collector(counting, groups_per_step=2)
    for step, t in enumerate((6, 7, 8), start=1):
        commit_rollouts(store, t, 0)
        counting.prefixes.clear()
        collector.settle(collector.collect(step=step, learner_version=t, timeout_s=5))
        listed = {p for p in counting.prefixes if p.startswith(layout.ROLLOUTS) and p != layout.ROLLOUTS}
        if step == 1:  # the first collection sweeps every folder once: the 60 old files are dropped as stale
            assert len(listed) == 8  # the 7 folders, and the window's next one (v7) by name
        else:  # then only the window t - S .. t + 1 (plus the folder that just fell out of it; at t + 1 a file
            # committed before its version exists is quarantined as from the future at once)
            assert listed <= {f"{layout.ROLLOUTS}{layout.version_name(v)}/" for v in range(t - 2, t + 2)}, listed
    assert FULL_SWEEP_EVERY > 3


# -- unreadable, huge and replaced files: quarantined, never read whole, never a crash (issue 18, item 1) --
class _Reads:
    """The real store, with each read recorded as (key, end of the range; None for a whole object)."""

    def __init__(self, store):
        self.store, self.reads = store, []

    def get(self, key):
        self.reads.append((key, None))
        return self.store.get(key)

    def get_range(self, key, start, end):
        self.reads.append((key, end))
        return self.store.get_range(key, start, end)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_glacier_rollout_is_quarantined_by_reference_not_raised(s3_store):
    data = rollout_bytes(1)
    glacier = layout.rollout_key(1, "a", 1)
    put_glacier(s3_store, glacier, data)
    honest = [commit_rollouts(s3_store, 1, 2, actor="b"), commit_rollouts(s3_store, 1, 3, actor="b")]
    col = _collector(s3_store)
    sel = col.collect(step=2, learner_version=1, timeout_s=30)
    assert [u["key"] for u in sel.used] == honest
    [q] = sel.quarantined
    assert q["key"] == glacier and q["reason"].startswith("unreadable: PermissionError"), q
    assert "storage class" in q["reason"]
    record = s3_store.get_json(layout.quarantine_reason_key(glacier))
    assert record["by_reference"] is True and record["size"] == len(data), record
    assert "ObjectNotInActiveTierError" in record["copy_error"]
    assert s3_store.exists(glacier) and not s3_store.exists(layout.quarantine_key(glacier))  # it stays, recorded
    assert glacier in ConsumedIndex(s3_store).refresh()  # settled: no actor counts it as pending
    assert ledger_audit(s3_store) == ([], {"files": 3, "orphaned": 0, "used": 2, "dropped": 0, "quarantined": 1})

    # killed before the step completed (its entry moved aside): the next learner records it once, unread
    s3_store.move(layout.consumed_key(2), "orphaned/1/" + layout.consumed_key(2))
    reads = _Reads(s3_store)
    resumed = _collector(reads)
    again = resumed.collect(step=2, learner_version=1, timeout_s=30)
    assert [q["key"] for q in again.quarantined] == [glacier]
    assert [u["key"] for u in again.used] == honest
    assert glacier not in {key for key, _ in reads.reads}


def test_an_actor_file_is_read_once_bounded_and_quarantined_unread(tmp_path):
    """A sparse file far over the limit is judged by its size and moved unread; a file the actor
    replaces by a bigger one right after its size check is read only to one byte past the limit."""
    store = open_store(str(tmp_path))
    limit = 64 * 2**10
    huge = layout.rollout_key(1, "a", 1)
    (tmp_path / huge).parent.mkdir(parents=True)
    with open(tmp_path / huge, "wb") as f:
        f.truncate(512 * 2**20)
    replaced = commit_rollouts(store, 1, 2, actor="a")
    honest = [commit_rollouts(store, 1, 3, actor="b"), commit_rollouts(store, 1, 4, actor="b")]

    class ReplacedAfterItsSizeCheck(_Reads):
        def size(self, key):
            n = self.store.size(key)
            if key == replaced:  # the actor overwrites its own file between the HEAD and the GET
                self.store.put(key, b"\0" * (16 * limit), if_absent=False)
            return n

    reads = ReplacedAfterItsSizeCheck(store)
    sel = _collector(reads, max_file_bytes=limit).collect(step=2, learner_version=1, timeout_s=5)
    assert [u["key"] for u in sel.used] == honest
    reasons = {q["key"]: q["reason"] for q in sel.quarantined}
    assert set(reasons) == {huge, replaced} and all("over the limit" in r for r in reasons.values()), reasons
    assert (tmp_path / layout.quarantine_key(huge)).stat().st_size == 512 * 2**20  # kept
    assert reads.reads == [(replaced, limit + 1)] + [(key, limit + 1) for key in honest]


@pytest.mark.e2e
def test_a_store_outage_while_reading_a_file_quarantines_nothing(s3_server, s3_store):
    """The store going down while a file is read propagates (the flow retries it), and blames no file.
    The outage is the fault-injecting proxy's (503, 500, resets), begun as the collector reads a file."""
    from echo2.chaos.s3_proxy import FaultyS3Proxy
    from echo2.data.store import is_transient

    key = commit_rollouts(s3_store, 1, 0)
    proxy = FaultyS3Proxy(s3_server, fail_rate=0.0)
    url = proxy.start()
    try:
        proxied = open_store(f"s3://{s3_store.root}", {"endpoint_url": url, "skip_instance_cache": True}, retry_s=0.5)

        class OutageAsAFileIsRead(_Reads):
            def get_range(self, key, start, end):
                proxy.outage(3600)
                return super().get_range(key, start, end)

        with pytest.raises(Exception) as err:
            _collector(OutageAsAFileIsRead(proxied)).collect(step=2, learner_version=1, timeout_s=30)
        assert is_transient(err.value), repr(err.value)
    finally:
        proxy.stop()
    assert s3_store.exists(key)
    assert s3_store.list(layout.QUARANTINE) == []


def test_a_read_error_the_learners_own_files_share_blames_no_file(tmp_path):
    """A non-transient error that reading the run's own ``run.json`` meets too (the learner's credentials
    revoked, say) is the learner's problem, not the file's: it propagates and nothing is quarantined."""
    store = open_store(str(tmp_path))
    store.put_json(layout.RUN_JSON, {"run_id": "run"})
    key = commit_rollouts(store, 1, 0)

    class RevokedAfterListing(_Reads):  # test double: the cloud's answer to revoked credentials
        def size(self, key):
            raise PermissionError("test double: AccessDenied (the learner's credentials were revoked)")

    with pytest.raises(PermissionError, match="revoked"):
        _collector(RevokedAfterListing(store)).collect(step=2, learner_version=1, timeout_s=5)
    assert store.exists(key) and store.list(layout.QUARANTINE) == []
