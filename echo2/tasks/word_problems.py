"""An offline, seeded generator of multi-step arithmetic word problems (GSM8K-like, smaller numbers).

Problem ``n`` of a generator is a pure function of ``(steps, max_number, n)``: a person starts with
a count of some item, then ``steps`` events change it (finds / buys more, gives away / eats / sells,
receives groups of equal size, shares equally), and the question asks how many are left. Every
intermediate count is a whole number between 0 and ``max_number * 10`` (a subtraction never goes
below zero, a division is always exact), so the answer is one integer, and the worked solution is
kept for inspection. The same ``n`` gives the same problem on every machine (``random.Random`` with
a string seed is deterministic across platforms and Python versions >= 3.2).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Theo", "Ines", "Kofi", "Yuki", "Ana")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards", "books", "coins")
_PLACES = ("at the market", "in the park", "at school", "in a box", "at the fair")
_FRIENDS = ("her brother", "a friend", "his sister", "a neighbor", "the teacher", "a cousin")


@dataclass(frozen=True)
class WordProblem:
    question: str
    answer: int
    solution: str


def word_problem(n: int, *, steps: int, max_number: int, namespace: str = "train") -> WordProblem:
    """Problem ``n`` of the ``namespace`` stream ("train" or "eval")."""
    rng = random.Random(f"echo2-word-problems:{namespace}:{steps}:{max_number}:{n}")
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    pronoun = "She" if name in ("Mia", "Ava", "Zoe", "Lena", "Sara", "Ines", "Yuki", "Ana") else "He"
    possessive = "her" if pronoun == "She" else "his"
    value = rng.randint(2, max_number)
    cap = max_number * 10
    sentences = [f"{name} has {value} {item}."]
    work = [f"start: {value}"]
    for _ in range(steps):
        kinds = ["add", "multiply"] if value == 0 else ["add", "subtract", "multiply", "divide"]
        while True:
            kind = rng.choice(kinds)
            if kind == "add" and value + 1 <= cap:
                k = rng.randint(1, min(max_number, cap - value))
                sentences.append(rng.choice((f"{pronoun} finds {k} more {item} {rng.choice(_PLACES)}.",
                                             f"{pronoun} buys {k} more {item}.",
                                             f"{rng.choice(_FRIENDS).capitalize()} gives {name} {k} {item}.")))
                work.append(f"{value} + {k} = {value + k}")
                value += k
                break
            if kind == "subtract" and value >= 1:
                k = rng.randint(1, min(value, max_number))
                sentences.append(rng.choice((f"{pronoun} gives {k} {item} to {rng.choice(_FRIENDS)}.",
                                             f"{pronoun} loses {k} {item} {rng.choice(_PLACES)}.",
                                             f"{pronoun} sells {k} {item}.")))
                work.append(f"{value} - {k} = {value - k}")
                value -= k
                break
            if kind == "multiply" and value >= 1 and value * 2 <= cap:
                k = rng.randint(2, max(2, min(5, cap // value)))
                sentences.append(rng.choice((f"Then the number of {item} {name} has becomes {k} times as large.",
                                             f"{pronoun} swaps each of {possessive} {item} for {k} new ones.")))
                work.append(f"{value} * {k} = {value * k}")
                value *= k
                break
            if kind == "divide" and value >= 2:
                divisors = [d for d in range(2, min(value, 10) + 1) if value % d == 0]
                if divisors:
                    k = rng.choice(divisors)
                    sentences.append(f"{pronoun} shares the {item} equally among {k} people, {pronoun.lower()} "
                                     f"included, and keeps {possessive} share.")
                    work.append(f"{value} / {k} = {value // k}")
                    value //= k
                    break
            kinds = [k for k in kinds if k != kind] or ["add"]
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    return WordProblem(question=question, answer=value, solution="; ".join(work))
