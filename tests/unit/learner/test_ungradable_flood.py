"""Issue 18, items 4 and 9 together: a file the task could not grade the same way everywhere (one reply
that timed out on the learner's grader) is set aside without blaming its actor, yet each costs the
learner up to a file's grading budget; an actor sending one such file after another must be banned
once its ungradable files are more than an honest actor's accidents ever are, and an honest actor's
occasional one must never ban it.

The verifier is the real ``TaskVerifier`` on a real store; the task under it is a test double of the
math grader (``HangingGrader``): the real one needs ``grade_timeout_s`` of wall clock per hanging
reply, and what it raises on a timeout, ``Ungradable``, is all the collector sees of it."""

from __future__ import annotations

from helpers import commit_rollouts

from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.rollouts import RolloutLimits
from echo2.data.store import open_store
from echo2.learner.collector import RolloutCollector
from echo2.learner.verify import TaskVerifier
from echo2.tasks.base import Problem, Ungradable

LIMITS = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                       reward_range=(0.0, 1.0), max_groups=2)
HANG = "-hang"
"""In a file's prompt ids (``commit_rollouts``' salt): the file holds a reply that hangs the grader."""


class HangingGrader:
    """Test double of a verifiable task (the math grader): issues the prompt the rollout builders use,
    accepts the claimed rewards, and raises ``Ungradable`` for a file holding a reply that hangs, as
    the math task does when one reply runs past ``grade_timeout_s``. Counts the files it grades."""

    verifiable = True
    rescore_fraction, rescore_max_rows = 1.0, None  # re-scores every row, as ``tasks.base.Task`` does by default

    def __init__(self):
        self.graded: list[str] = []

    def problem(self, prompt_id: str) -> Problem:
        return Problem(id=prompt_id, messages=(), answer=None)

    def prompt_tokens(self, tokenizer, problem: Problem) -> list[int]:
        return [1, 2, 3]

    def score_episodes(self, tokenizer, problems, completions, masks, max_new_tokens, claimed=None):
        self.graded.append(problems[0].id)
        if any(HANG in p.id for p in problems):
            raise Ungradable("math-verify ran past grade_timeout_s=5s on a reply; the grader was replaced")
        return list(claimed)


def collector(store, grader, **kw):
    return RolloutCollector(store, run_id="run", staleness=1, limits=LIMITS,
                            verifier=TaskVerifier(grader, None, max_new_tokens=8), **kw)


def test_an_actor_whose_files_keep_hanging_the_grader_is_banned(tmp_path):
    store = open_store(str(tmp_path))
    grader = HangingGrader()
    col = collector(store, grader, groups_per_step=2, max_ungradable_files=5, max_ungradable_fraction=0.25)
    hanging = [commit_rollouts(store, 1, seq, actor="evil", salt=f"{HANG}-{seq}") for seq in range(9)]
    good = commit_rollouts(store, 1, 0, actor="honest")
    sel = col.collect(step=2, learner_version=1, timeout_s=5)  # evil's files sort first: all judged before honest's
    assert [u["key"] for u in sel.used] == [good]
    reasons = {q["key"]: q["reason"] for q in sel.quarantined}
    assert set(reasons) == set(hanging[:6])
    assert all("ungradable, set aside" in reasons[k] for k in hanging[:6])
    assert "6 of its files could not be graded, against 0 novel files" in col.banned["evil"]  # the sixth bans
    assert not set(hanging[6:]) & sel.keys  # never judged: the ban stands for them, the janitor deletes them
    assert sum(HANG in g for g in grader.graded) == 6  # the learner paid for six, not nine
    assert store.exists(layout.quarantine_key(hanging[0]))


def test_an_honest_actor_with_an_occasional_ungradable_file_is_not_banned(tmp_path):
    """Seven ungradable files, more than the count bound, but a small share of the actor's 40: one of
    every six, from its very first file on (an honest actor's accidents are far rarer still)."""
    store = open_store(str(tmp_path))
    col = collector(store, HangingGrader(), groups_per_step=2 * 33, max_ungradable_files=5,
                    max_ungradable_fraction=0.25)
    keys = [commit_rollouts(store, 1, seq, actor="honest", salt=f"{HANG if seq % 6 == 0 else ''}-{seq}")
            for seq in range(40)]
    sel = col.collect(step=2, learner_version=1, timeout_s=5)
    assert len(sel.quarantined) == 7 and len(sel.used) == 33 and sel.groups == 66
    assert all("ungradable, set aside" in q["reason"] for q in sel.quarantined)
    assert col.ungradable_files == {"honest": 7} and col.judged_files == {"honest": 40}
    assert not col.banned
    assert {u["key"] for u in sel.used} | {q["key"] for q in sel.quarantined} == set(keys)


def test_the_run_wires_the_ungradable_bounds_into_its_collector(tiny_model, tmp_path, monkeypatch):
    from echo2.learner.run import LearnerRun

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv("ECHO2_RUN_KEY", raising=False)
    defaults = config_from_dict({}).trust
    assert (defaults.max_ungradable_files_per_actor, defaults.max_ungradable_fraction) == (5, 0.25)
    config = config_from_dict({
        "run": {"id": "r1"}, "store": {"url": str(tmp_path)}, "model": {"name": str(tiny_model)},
        "trust": {"max_ungradable_files_per_actor": 9, "max_ungradable_fraction": 0.5, "spot_check_fraction": 0},
        "eval": {"before": False, "after": False}})
    run = LearnerRun(config, open_store(str(tmp_path)).child(layout.RUNS), resume=False)
    try:
        assert (run.collector.max_ungradable_files, run.collector.max_ungradable_fraction) == (9, 0.5)
    finally:
        run.sink.close()
