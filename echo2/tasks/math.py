"""``math``: word and competition problems with answers checked by math-verify.

Problems come from the offline generator (``dataset: generated``, ``word_problems.py``) or from a
dataset file (``math_data.py``: JSONL / Parquet, local, behind an fsspec URI, or a Hugging Face
dataset id). The prompt is the question and ``task.instruction`` (by default: reason step by step
and put the answer in ``\\boxed{}``) as one user message.

Reward: 1 when math-verify finds the reply's answer equal to the gold answer (``math_grader.py``
says exactly what is extracted and compared), plus ``format_reward`` when the reply puts an answer
in ``\\boxed{}``; so the range is [0, 1 + format_reward]. Grading runs in a worker process under a
wall-clock limit, the same code in the actor and in the learner, which re-scores every reply. A reply
the grader cannot finish scores 0 (plus the format bonus) on the actor, marked ``ungraded`` in its
detail; on the learner it makes the file ``Ungradable`` (set aside), and a file over its grading budget
(``task.grade_file_budget_s``, ``task.grade_file_max_timeouts``) raises ``GradingBudgetExceeded``.

Held out: with ``eval_dataset``, ``eval_size`` rows of it (a seeded sample); otherwise ``eval_size``
rows of ``dataset`` set aside by a seeded shuffle. Training never draws a held-out row, nor a row
whose question is also a held-out question. Prompt ids: ``q<row>`` (dataset rows) and ``wp<n>``
(generated problem n); held-out problems get ids that ``problem()`` refuses.
"""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

from echo2.config import MathTaskConfig
from echo2.tasks.base import UNGRADED, Problem, Task, Ungradable, UnknownProblem
from echo2.tasks.math_data import load_rows
from echo2.tasks.math_grader import FileBudget, Grade, MathGrader
from echo2.tasks.word_problems import word_problem

_ROW_ID = re.compile(r"q(0|[1-9]\d{0,8})")
_GENERATED_ID = re.compile(r"wp(0|[1-9]\d{0,9})")
_GENERATED_SPACE = 10**9
_HOLDOUT_SEED = "echo2-math-holdout"


class MathTask(Task):
    name = "math"

    def __init__(self, config: MathTaskConfig):
        self.config = config
        self.reward_range = (0.0, 1.0 + config.format_reward)
        self.grader = MathGrader(timeout_s=config.grade_timeout_s)
        self.file_budget = FileBudget(seconds=config.grade_file_budget_s, max_ungraded=config.grade_file_max_timeouts)
        self.generated = config.dataset == "generated"
        if self.generated:
            self._rows: list[tuple[str, str]] = []
            self._train_rows: list[int] = []
            eval_pairs = [self._generated(i, "eval") for i in range(config.eval_size)]
            self._eval = [self._problem(f"wp-eval-{i}", q, a) for i, (q, a) in enumerate(eval_pairs)]
        else:
            self._rows = self._load(config.dataset)
            if config.eval_dataset is not None:
                held_rows = self._load(config.eval_dataset, split=config.eval_hf_split)
                chosen = sorted(random.Random(_HOLDOUT_SEED).sample(range(len(held_rows)),
                                                                    min(config.eval_size, len(held_rows))))
                self._eval = [self._problem(f"eval-{i}", *held_rows[i]) for i in chosen]
                held_out: set[int] = set()
            else:
                if config.eval_size >= len(self._rows):
                    raise ValueError(f"task.eval_size {config.eval_size} leaves no training problems "
                                     f"({len(self._rows)} rows in {config.dataset})")
                order = list(range(len(self._rows)))
                random.Random(_HOLDOUT_SEED).shuffle(order)
                held_out = set(order[:config.eval_size])
                self._eval = [self._problem(f"eval-{i}", *self._rows[i]) for i in sorted(held_out)]
            eval_questions = {p.meta["question"] for p in self._eval}
            self._train_rows = [i for i in range(len(self._rows))
                                if i not in held_out and self._rows[i][0] not in eval_questions]
            if not self._train_rows:
                raise ValueError(f"every row of {config.dataset} is held out")
        self._eval_questions = frozenset(p.meta["question"] for p in self._eval)
        self._train_set = frozenset(self._train_rows)

    def _load(self, source: str, split: str | None = None) -> list[tuple[str, str]]:
        """The rows of ``source``: ``split`` (the eval split) or ``hf_split`` of a Hugging Face dataset."""
        c = self.config
        return load_rows(source, question=c.columns.question, answer=c.columns.answer, answer_format=c.answer_format,
                         hf_split=split or c.hf_split, hf_subset=c.hf_subset, hf_revision=c.hf_revision,
                         hf_data_files=c.hf_data_files, limit=c.limit)

    def _generated(self, n: int, namespace: str) -> tuple[str, str]:
        wp = word_problem(n, steps=self.config.steps, max_number=self.config.max_number, namespace=namespace)
        return wp.question, str(wp.answer)

    def _problem(self, prompt_id: str, question: str, gold: str) -> Problem:
        content = f"{question}\n{self.config.instruction}" if self.config.instruction else question
        return Problem(id=prompt_id, messages=({"role": "user", "content": content},), answer=gold,
                       meta={"question": question})

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            if self.generated:
                index = rng.randrange(_GENERATED_SPACE)
                question, gold = self._generated(index, "train")
                if question in self._eval_questions:
                    continue
                out.append(self._problem(f"wp{index}", question, gold))
            else:
                index = rng.choice(self._train_rows)
                out.append(self._problem(f"q{index}", *self._rows[index]))
        return out

    def problem(self, prompt_id: str) -> Problem:
        if self.generated:
            m = _GENERATED_ID.fullmatch(prompt_id)
            if m is None or int(m.group(1)) >= _GENERATED_SPACE:
                raise UnknownProblem(f"prompt_id {prompt_id[:40]!r} is not a generated training problem 'wp<n>'")
            question, gold = self._generated(int(m.group(1)), "train")
            if question in self._eval_questions:
                raise UnknownProblem(f"prompt_id {prompt_id!r} is a held-out problem")
            return self._problem(prompt_id, question, gold)
        m = _ROW_ID.fullmatch(prompt_id)
        if m is None or int(m.group(1)) >= len(self._rows):
            raise UnknownProblem(f"prompt_id {prompt_id[:40]!r} is not a row 'q<n>' of {self.config.dataset}")
        index = int(m.group(1))
        question, gold = self._rows[index]
        if question in self._eval_questions or index not in self._train_set:
            raise UnknownProblem(f"prompt_id {prompt_id!r} is a held-out problem")
        return self._problem(prompt_id, question, gold)

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    def reward(self, problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
        return self.rewards([problem], [completion])[0]

    def _reward(self, grade: Grade) -> float:
        return float(grade.correct) + (self.config.format_reward if grade.boxed else 0.0)

    def rewards(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[tuple[float, dict[str, Any]]]:
        grades = self.grader.grade([(p.answer, c) for p, c in zip(problems, completions)])
        out = []
        for problem, grade in zip(problems, grades):
            detail = {"answer": problem.answer, "extracted": grade.extracted, "correct": grade.correct,
                      "boxed": grade.boxed, "status": grade.status}
            if grade.ungraded:
                detail[UNGRADED] = grade.status
            out.append((self._reward(grade), detail))
        return out

    def score_replies(self, problems: Sequence[Problem], texts: Sequence[str]) -> list[float]:
        """The learner's grading of one file, under the file's budget: a reply it cannot finish makes the
        file ``Ungradable`` (the actor may have finished it, just under the limit); past the budget the
        grader raises ``GradingBudgetExceeded``."""
        grades = self.grader.grade([(p.answer, t) for p, t in zip(problems, texts)], budget=self.file_budget)
        ungraded = [(row, g.status) for row, g in enumerate(grades) if g.ungraded]
        if ungraded:
            rows = ", ".join(f"row {row} ({status})" for row, status in ungraded[:5])
            raise Ungradable(f"the grader could not finish {len(ungraded)} repl{'y' if len(ungraded) == 1 else 'ies'}"
                             f" within task.grade_timeout_s={self.grader.timeout_s:g}s: {rows}")
        return [self._reward(g) for g in grades]
