"""The math task: answer extraction, math-verify on tricky cases, the grader's time limit, datasets and
the offline generator. The fixtures under tests/fixtures/ were written for this project."""

import json
import random
import re
import sys
from pathlib import Path

import pytest
from helpers import commit_rollouts, rollout_bytes

from echo2.config import ConfigError, load_config
from echo2.data.rollouts import Rollout, RolloutLimits
from echo2.data.store import open_store
from echo2.learner.collector import RolloutCollector
from echo2.learner.verify import TaskVerifier
from echo2.tasks import UnknownProblem, make_task
from echo2.tasks.base import GradingBudgetExceeded
from echo2.tasks.math_data import MathDataError, gold_answer, last_boxed, load_rows
from echo2.tasks.math_grader import Grade, MathGrader, reply_expression
from echo2.tasks.word_problems import word_problem

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(scope="module")
def grader():
    g = MathGrader(timeout_s=10)
    yield g
    g.close()


def test_gold_answers_are_cut_out_of_gsm8k_and_math_solutions():
    assert gold_answer("so 72 - 50 = 22.\n#### 22", "auto") == "22"
    assert gold_answer("A quarter of 1,200 ...\n#### 1,500", "gsm8k") == "1500"
    assert gold_answer("hence $\\boxed{\\frac{1}{2}}$.", "auto") == "\\boxed{\\frac{1}{2}}"
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{\\sqrt{2}}{2}} done") == "\\frac{\\sqrt{2}}{2}"
    assert last_boxed("\\boxed{unclosed") is None
    assert gold_answer("  42 ", "plain") == "42"
    with pytest.raises(MathDataError, match="####"):
        gold_answer("no marker", "gsm8k")


def test_reply_extraction_honours_gsm8k_markers():
    assert reply_expression("work 17\n#### 42\nnote 17") == " 42"
    assert reply_expression("the answer is 5") == "the answer is 5"


TRICKY = [  # (gold, reply, correct)
    ("\\boxed{\\frac{1}{2}}", "So we get \\boxed{0.5}.", True),
    ("0.5", "the answer is \\boxed{\\frac{1}{2}}", True),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", True),  # equal expressions
    ("50\\%", "0.5", True),
    ("3", "so x=3", True),
    ("1500", "#### 1,500", True),
    ("10", "\\boxed{10}\\text{ cm}", True),
    ("42", "It is 17, then 42", True),  # the last number wins without an anchor
    ("42", "#### 42\nnote 17", True),  # GSM8K's marker: the rest of its line
    ("42", "42.000001", False),
    ("0.7071", "\\boxed{\\frac{\\sqrt{2}}{2}}", False),  # 6 decimals: 0.7071 is not sqrt(2)/2
    ("5", "I do not know", False),
    ("1", "\\boxed{9^{9^{9^{9^{9}}}}}", False),  # a tower math-verify must give up on, not compute
]


@pytest.mark.e2e
def test_math_verify_on_tricky_cases(grader):
    grades = grader.grade([(gold, reply) for gold, reply, _ in TRICKY])
    assert [g.correct for g in grades] == [c for _, _, c in TRICKY], [
        (gold, reply, g) for (gold, reply, c), g in zip(TRICKY, grades) if g.correct != c]
    assert grades[0].boxed and not grades[3].boxed
    assert grades[11].extracted is None


TOWER = "\\boxed{9^{9^{9^{9^{9}}}}}"
"""A reply that keeps math-verify busy until its own 2 s alarm: it hangs a grader with a shorter limit."""


@pytest.mark.e2e
def test_a_hanging_reply_is_cut_at_the_limit_and_the_warm_spare_takes_over():
    """The real worker and a real hanging reply: no start-up allowance is patched away, none is needed."""
    g = MathGrader(timeout_s=1.0)
    try:
        assert g.grade([("1", "\\boxed{1}")])[0].correct
        g.await_spare()  # started beside the first worker: it has been importing since
        first, spare = g.worker_pid, g.spare_pid
        grades = g.grade([("1", TOWER), ("2", "\\boxed{2}")])
        assert grades == [Grade(False, None, True, "timeout"), Grade(True, "2", True)]
        assert grades[0].ungraded and not grades[1].ungraded
        assert g.replaced == 1 and g.worker_pid == spare  # the spare graded the next reply...
        assert g.waited_for_spare == 0  # ...at once: it was up before the worker it replaced was killed
        assert g.spare_pid not in (None, first, spare)  # and a new spare is starting
    finally:
        g.close()
    assert g.worker_pid is None and g.spare_pid is None


_WORKER_WITH = """import os, sys
import echo2.tasks.math_grader as m
graded = m.grade_reply
def grade_reply(gold, reply):
{body}
    return graded(gold, reply)
m.grade_reply = grade_reply
m._serve()
"""


def test_a_stray_print_in_the_worker_does_not_reach_the_grades():
    """The worker as shipped, with a library that prints (and writes raw bytes to fd 1) on every reply."""
    g = MathGrader(timeout_s=10)
    g.command = [sys.executable, "-c", _WORKER_WITH.format(body="    print('sympy: hello', flush=True)\n"
                                                                 "    os.write(1, b'{not json\\n')")]
    try:
        grades = g.grade([("1", "\\boxed{1}"), ("2", "3"), ("1/2", "0.5")])
        assert [gr.correct for gr in grades] == [True, False, True] and [gr.status for gr in grades] == ["ok"] * 3
        assert g.replaced == 0
    finally:
        g.close()


def test_an_answer_that_is_not_a_grade_frame_is_a_worker_fault_not_a_crash():
    """A worker that writes a malformed answer on the answer pipe: that reply is ungraded, the worker replaced."""
    g = MathGrader(timeout_s=10)
    g.command = [sys.executable, "-c", _WORKER_WITH.format(
        body="    if reply == 'garble':\n"
             "        os.write(int(os.environ['ECHO2_GRADER_FD']), b'echo2-grader grade {\"correct\": \"yes\"}\\n')")]
    try:
        grades = g.grade([("1", "\\boxed{1}"), ("2", "garble"), ("3", "3")])
        assert [gr.status.split(":")[0] for gr in grades] == ["ok", "fault", "ok"], grades
        assert grades[1].ungraded and grades[2].correct and g.replaced == 1
    finally:
        g.close()


def _task(*overrides):
    return make_task(load_config(None, ["task.name=math", *overrides]).task)


def test_the_grading_budget_must_fit_the_timeouts_it_allows():
    with pytest.raises(ConfigError, match="grade_file_budget_s 1 is under"):
        load_config(None, ["task.name=math", "task.grade_timeout_s=1", "task.grade_file_max_timeouts=1",
                           "task.grade_file_budget_s=1"])


@pytest.mark.e2e
def test_a_file_of_slow_replies_goes_over_the_time_budget():
    """Replies just under the limit each (the tower takes math-verify's 2 s alarm; the limit is 3 s):
    the file is cut off when its time budget is spent, not after every row."""
    task = _task("task.grade_timeout_s=3", "task.grade_file_max_timeouts=0", "task.grade_file_budget_s=3")
    problem = task.sample_train(random.Random(0), 1)[0]
    try:
        with pytest.raises(GradingBudgetExceeded, match="over its budget") as exc:
            task.score_replies([problem] * 4, [TOWER] * 4)
        graded = int(re.search(r"stopped after (\d+) of its 4 replies", str(exc.value)).group(1))
        assert graded < 4
    finally:
        task.grader.close()


def test_jsonl_fixture_in_gsm8k_columns(grader):
    task = _task(f"task.dataset={FIXTURES / 'math_gsm8k_style.jsonl'}", "task.eval_size=2")
    task.grader = grader
    train = task.sample_train(random.Random(0), 20)
    assert {p.id for p in train} <= {f"q{i}" for i in range(8)}
    held = {p.meta["question"] for p in task.eval_set()}
    assert len(held) == 2 and not held & {p.meta["question"] for p in train}
    p = task.problem(train[0].id)
    assert p == train[0] and p.messages[0]["content"].endswith("\\boxed{}.")
    assert task.reward(p, f"... so \\boxed{{{p.answer}}}")[0] == 1.0
    assert task.reward(p, "\\boxed{-1}")[0] == 0.0
    held_id = next(f"q{i}" for i in range(8) if f"q{i}" not in {q.id for q in train}
                   and task._rows[i][0] in held)
    with pytest.raises(UnknownProblem, match="held-out"):
        task.problem(held_id)
    with pytest.raises(UnknownProblem):
        task.problem("q99")


def test_parquet_math_style_columns_with_format_reward(tmp_path, grader):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (FIXTURES / "math_math_style.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "math.parquet")
    task = _task(f"task.dataset={tmp_path / 'math.parquet'}", "task.columns={question: problem, answer: solution}",
                 "task.eval_size=1", "task.format_reward=0.1")
    task.grader = grader
    assert task.reward_range == (0.0, 1.1)
    by_question = {q: a for q, a in task._rows}
    assert by_question["Simplify $\\frac{\\sqrt{8}}{2}$."] == "\\boxed{\\sqrt{2}}"
    p = next(task.problem(f"q{i}") for i in task._train_rows if task._rows[i][1] == "\\boxed{\\sqrt{2}}")
    assert task.reward(p, "\\boxed{\\frac{2}{\\sqrt{2}}}")[0] == pytest.approx(1.1)
    assert task.reward(p, "about 1.41421356")[0] == pytest.approx(1.0)  # right, but not boxed
    assert task.reward(p, "\\boxed{2}")[0] == pytest.approx(0.1)


def test_datasets_behind_an_fsspec_uri_with_nested_columns():
    import fsspec

    rows = [{"prompt": [{"role": "user", "content": "What is 2+2?"}], "reward_model": {"ground_truth": "4"}}] * 3
    with fsspec.open("memory://echo2-test/dapo.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    out = load_rows("memory://echo2-test/dapo.jsonl", question="prompt", answer="reward_model.ground_truth",
                    answer_format="auto")
    assert out == [("What is 2+2?", "4")] * 3
    with pytest.raises(MathDataError, match="no column 'solution'"):
        load_rows("memory://echo2-test/dapo.jsonl", question="prompt", answer="solution", answer_format="auto")
    with pytest.raises(MathDataError, match="does not exist"):
        load_rows("/nonexistent/file.jsonl", question="q", answer="a", answer_format="auto")


def test_generated_word_problems_are_seeded_and_held_out(grader):
    assert word_problem(7, steps=3, max_number=20) == word_problem(7, steps=3, max_number=20)
    assert word_problem(7, steps=3, max_number=20) != word_problem(7, steps=3, max_number=20, namespace="eval")
    for n in range(200):
        wp = word_problem(n, steps=3, max_number=20)
        assert wp.answer >= 0 and wp.question.count(".") >= 4
    task = _task("task.steps=2", "task.eval_size=5")
    task.grader = grader
    train = task.sample_train(random.Random(1), 4)
    assert all(task.problem(p.id) == p for p in train)
    assert task.reward(train[0], f"So the answer is \\boxed{{{train[0].answer}}}.")[0] == 1.0
    with pytest.raises(UnknownProblem):
        task.problem(task.eval_set()[0].id)


# -- the learner's side: what a file's grading costs, and who is banned for it ---------------------------------
def _math_file(task, tok, actor, replies, claimed, detail=None):
    """A rollout file of ``actor``: groups of two replies to generated problems (``ANSWER`` stands for the
    problem's answer), with the rewards it claims."""
    problems = task.sample_train(random.Random(actor), len(replies) // 2)
    rows = []
    for i, (reply, reward) in enumerate(zip(replies, claimed)):
        p = problems[i // 2]
        reply = reply.replace("ANSWER", str(p.answer))
        completion = tok(reply, add_special_tokens=False)["input_ids"]
        assert tok.decode(completion, skip_special_tokens=True) == reply
        rows.append(Rollout(prompt_id=p.id, group_id=f"g{i // 2}", sample_index=i % 2,
                            prompt_token_ids=task.prompt_tokens(tok, p), completion_token_ids=completion,
                            behavior_logprobs=[-0.5] * len(completion), reward=reward,
                            reward_detail=(detail or {}).get(i, {}), finish_reason="stop"))
    return rollout_bytes(1, rollouts=rows, actor=actor)


@pytest.fixture
def learner_side(tiny_model, tmp_path):
    """A math task with a short grading limit, a store, and a collector that verifies with the task."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    task = _task("task.grade_timeout_s=1", "task.grade_file_max_timeouts=1", "task.grade_file_budget_s=60")
    store = open_store(str(tmp_path))
    limits = RolloutLimits(vocab_size=len(tok), group_size=2, max_completion_tokens=64, max_prompt_tokens=4096,
                           reward_range=task.reward_range)
    collector = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=2, limits=limits,
                                 verifier=TaskVerifier(task, tok, max_new_tokens=64))
    yield task, tok, store, collector
    task.grader.close()


@pytest.mark.e2e
def test_a_file_of_hanging_replies_costs_one_budget_and_bans_its_actor(learner_side):
    """Eight replies that hang the grader, each claiming what a timeout scores: before, each cost the
    learner the limit (and a new worker's start-up allowance) and the file passed; now the file is cut off
    once more replies time out than the budget allows, and its actor is banned."""
    task, tok, store, collector = learner_side
    hanging = commit_rollouts(store, 1, 0, actor="a1-hangs", data=_math_file(task, tok, "a1-hangs", [TOWER] * 8,
                                                                               [0.0] * 8))
    honest = commit_rollouts(store, 1, 0, actor="a2-honest", data=_math_file(
        task, tok, "a2-honest", ["so \\boxed{ANSWER}"] * 4, [1.0] * 4))
    sel = collector.collect(step=2, learner_version=1, timeout_s=60)
    assert [u["key"] for u in sel.used] == [honest]
    reason = {q["key"]: q["reason"] for q in sel.quarantined}[hanging]
    assert "over its budget" in reason and "stopped after 2 of its 8 replies" in reason, reason
    assert set(collector.banned) == {"a1-hangs"}
    assert task.grader.replaced == 2  # two hanging replies graded (the budget's one, then one too many), not eight


@pytest.mark.e2e
def test_one_reply_that_times_out_sets_its_file_aside_without_a_ban(learner_side):
    """A grading timeout on either side is no lie: the file is set aside and its actor keeps going."""
    task, tok, store, collector = learner_side
    right = "so \\boxed{ANSWER}"
    # the learner's grader times out on one reply that the actor graded (just under the limit, say)
    slow_here = commit_rollouts(store, 1, 0, actor="a1-slow-here", data=_math_file(
        task, tok, "a1-slow-here", [TOWER, right, right, right], [0.0, 1.0, 1.0, 1.0]))
    # the actor's grader timed out on a right reply (scored 0, marked ungraded); the learner grades it 1
    slow_there = commit_rollouts(store, 1, 0, actor="a2-slow-there", data=_math_file(
        task, tok, "a2-slow-there", [right] * 4, [0.0, 1.0, 1.0, 1.0], detail={0: {"ungraded": "timeout"}}))
    # the same claim without the mark is a false one
    lie = commit_rollouts(store, 1, 0, actor="a3-lies", data=_math_file(task, tok, "a3-lies", [right] * 4,
                                                                         [0.0, 1.0, 1.0, 1.0]))
    honest = commit_rollouts(store, 1, 0, actor="a4-honest", data=_math_file(task, tok, "a4-honest", [right] * 4,
                                                                              [1.0] * 4))
    sel = collector.collect(step=2, learner_version=1, timeout_s=60)
    assert [u["key"] for u in sel.used] == [honest]
    reasons = {q["key"]: q["reason"] for q in sel.quarantined}
    assert "ungradable" in reasons[slow_here] and "row 0 (timeout)" in reasons[slow_here], reasons
    assert "ungradable" in reasons[slow_there] and "could not finish grading" in reasons[slow_there], reasons
    assert "the task scores the completion 1" in reasons[lie]
    assert set(collector.banned) == {"a3-lies"}
