"""The math task: answer extraction, math-verify on tricky cases, the grader's time limit, datasets and
the offline generator. The fixtures under tests/fixtures/ were written for this project."""

import json
import random
import sys
from pathlib import Path

import pytest

from echo2.config import load_config
from echo2.tasks import UnknownProblem, make_task
from echo2.tasks.math_data import MathDataError, gold_answer, last_boxed, load_rows
from echo2.tasks.math_grader import Grade, MathGrader, reply_expression
from echo2.tasks.word_problems import word_problem

FIXTURES = Path(__file__).parent / "fixtures"


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


def test_math_verify_on_tricky_cases(grader):
    grades = grader.grade([(gold, reply) for gold, reply, _ in TRICKY])
    assert [g.correct for g in grades] == [c for _, _, c in TRICKY], [
        (gold, reply, g) for (gold, reply, c), g in zip(TRICKY, grades) if g.correct != c]
    assert grades[0].boxed and not grades[3].boxed
    assert grades[11].extracted is None


def test_a_stuck_worker_is_killed_and_the_reply_scores_zero(monkeypatch):
    """Test double at the process boundary: a worker that never answers (as one stuck in sympy would)."""
    g = MathGrader(timeout_s=0.5)
    monkeypatch.setattr("echo2.tasks.math_grader.STARTUP_S", 0.0)
    monkeypatch.setattr(g, "command", [sys.executable, "-c", "import time; time.sleep(600)"])
    grades = g.grade([("1", "\\boxed{1}"), ("2", "\\boxed{2}")])
    assert grades == [Grade(False, None, True, "timeout"), Grade(False, None, True, "timeout")]
    assert g._proc is None  # killed, not left behind
    g.close()


def _task(*overrides):
    return make_task(load_config(None, ["task.name=math", *overrides]).task)


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
