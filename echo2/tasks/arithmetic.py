"""``arithmetic``: a + b with operands of up to ``digits`` digits.

Reward 1 when the last integer in the completion equals a + b, else 0. The held-out set is a
fixed, seeded sample of pairs that training never draws.
"""

from __future__ import annotations

import random
import re
from typing import Any

from echo2.tasks.base import Problem, Task, UnknownProblem

_INT = re.compile(r"-?\d+")
_PROMPT_ID = re.compile(r"(0|[1-9]\d{0,8})\+(0|[1-9]\d{0,8})")
_EVAL_SEED = 1234


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(self, digits: int = 1, eval_size: int = 50):
        self.digits = digits
        self.high = 10**digits - 1
        pairs_total = (self.high + 1) ** 2
        if eval_size >= pairs_total:
            raise ValueError(f"task.eval_size {eval_size} leaves no training problems ({pairs_total} pairs exist)")
        rng = random.Random(_EVAL_SEED)
        held: set[tuple[int, int]] = set()
        while len(held) < eval_size:
            held.add((rng.randint(0, self.high), rng.randint(0, self.high)))
        self._held_out = held
        self._eval = [self._problem(a, b) for a, b in sorted(held)]
        # Small pair spaces are enumerated, so sampling never loops on rejected pairs.
        self._train_pairs = (
            [(a, b) for a in range(self.high + 1) for b in range(self.high + 1) if (a, b) not in held]
            if pairs_total <= 1_000_000
            else None
        )

    def _problem(self, a: int, b: int) -> Problem:
        question = f"What is {a} + {b}?"
        return Problem(id=f"{a}+{b}", messages=({"role": "user", "content": question},), answer=a + b)

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            if self._train_pairs is not None:
                a, b = rng.choice(self._train_pairs)
            else:
                a, b = rng.randint(0, self.high), rng.randint(0, self.high)
                if (a, b) in self._held_out:
                    continue
            out.append(self._problem(a, b))
        return out

    def problem(self, prompt_id: str) -> Problem:
        m = _PROMPT_ID.fullmatch(prompt_id)
        if m is None:
            raise UnknownProblem(f"prompt_id {prompt_id[:40]!r} is not 'a+b'")
        a, b = int(m.group(1)), int(m.group(2))
        if a > self.high or b > self.high:
            raise UnknownProblem(f"prompt_id {prompt_id!r} has operands over {self.digits} digits")
        if (a, b) in self._held_out:
            raise UnknownProblem(f"prompt_id {prompt_id!r} is a held-out problem")
        return self._problem(a, b)

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    def reward(self, problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
        found = _INT.findall(completion.replace(",", ""))
        parsed = int(found[-1]) if found else None
        correct = parsed == problem.answer
        return (1.0 if correct else 0.0), {"answer": problem.answer, "parsed": parsed, "correct": correct}
