"""An offline, seeded curriculum of small function-writing problems with hidden tests.

Problem ``n`` of a stream is a pure function of ``(rungs, tests, namespace, n)``: a seeded ``random.Random`` picks a
template of one of the ``rungs``, its parameter (a threshold, a letter, a factor, a separator), a function name
and an argument name among the template's synonyms, and the test inputs; the expected values are the template's
reference function applied to them. So the prompt a model sees is a signature and a one-line docstring, and the
tests (inputs and expected values) are known to the task alone, never to the program.

Rungs of difficulty, as the math task's generated problems have steps:

1. one built-in or operator: the sum, the largest item, a string in upper case, x plus k;
2. a filter, a map or a count with a parameter: the sum of the even numbers, the numbers above k, the count of a
   letter, every item times k;
3. two steps: the sum of the squares of the odd numbers, the largest minus the smallest, a palindrome check,
   distinct values sorted, a running sum.

Inputs are small (lists of up to 8 integers in [-20, 30], lowercase words), every template states what it may
assume (a non-empty list), and the first input of a list template is often the edge case (an empty list).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any, Callable

from echo2.tasks.code_harness import CodeSpec

_WORDS = ("apple", "river", "stone", "cloud", "tiger", "level", "radar", "book", "sun", "moon", "tree", "bird",
          "lamp", "code", "data", "noon", "pear", "kayak", "wind", "fire", "rain", "sea", "star", "map")
_LETTERS = "aeiorstnl"
_PALINDROMES = ("level", "radar", "noon", "kayak", "racecar", "abba", "a", "madam", "refer", "stats")


@dataclass(frozen=True)
class _Template:
    rung: int
    names: tuple[str, ...]
    """Function names it may be given (synonyms)."""
    arg: str
    """Kind of argument: ints (a list), nonempty (a non-empty list), word, text (words), words (a list), int."""
    returns: str
    doc: str
    """The docstring, with ``{x}`` the argument's name and ``{k}`` the parameter."""
    solve: Callable[[Any, Any], Any]
    """The reference: (argument, parameter) -> expected value."""
    params: tuple = (None,)
    make: Callable[[random.Random], Any] | None = None
    """Its own input maker where the argument's kind alone would make weak tests (a palindrome check needs
    palindromes)."""


_ARG_NAMES = {"ints": ("xs", "nums", "numbers", "values"), "nonempty": ("xs", "nums", "numbers", "values"),
              "word": ("s", "word", "text"), "text": ("s", "sentence", "text"), "words": ("words", "items", "names"),
              "int": ("n", "x", "value")}
_TYPES = {"ints": "list[int]", "nonempty": "list[int]", "word": "str", "text": "str", "words": "list[str]",
          "int": "int"}


def _running(xs):
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _dedupe(xs):
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


TEMPLATES: tuple[_Template, ...] = (
    # rung 1: one built-in or operator
    _Template(1, ("sum_list", "total", "list_sum"), "ints", "int", "Return the sum of the numbers in {x}.",
              lambda xs, k: sum(xs)),
    _Template(1, ("max_list", "largest", "biggest"), "nonempty", "int",
              "Return the largest number in {x} ({x} is not empty).", lambda xs, k: max(xs)),
    _Template(1, ("min_list", "smallest", "lowest"), "nonempty", "int",
              "Return the smallest number in {x} ({x} is not empty).", lambda xs, k: min(xs)),
    _Template(1, ("count_items", "list_length", "size"), "ints", "int", "Return how many numbers {x} holds.",
              lambda xs, k: len(xs)),
    _Template(1, ("to_upper", "shout", "upper_case"), "word", "str", "Return {x} in upper case.",
              lambda s, k: s.upper()),
    _Template(1, ("sort_list", "sorted_numbers", "ascending"), "ints", "list[int]",
              "Return the numbers of {x} sorted from smallest to largest.", lambda xs, k: sorted(xs)),
    _Template(1, ("add_k", "increase", "plus_k"), "int", "int", "Return {x} plus {k}.", lambda n, k: n + k,
              (2, 3, 5, 7, 10, 12, 25, 100)),
    _Template(1, ("times_k", "scale", "multiply"), "int", "int", "Return {x} multiplied by {k}.", lambda n, k: n * k,
              (2, 3, 4, 5, 6, 7, 8, 9, 10)),
    _Template(1, ("last_item", "final", "last"), "nonempty", "int",
              "Return the last number in {x} ({x} is not empty).", lambda xs, k: xs[-1]),
    _Template(1, ("is_even", "even", "check_even"), "int", "bool", "Return True if {x} is even, else False.",
              lambda n, k: n % 2 == 0),
    # rung 2: a filter, a map or a count with a parameter
    _Template(2, ("sum_even", "even_total", "add_evens"), "ints", "int", "Return the sum of the even numbers in {x}.",
              lambda xs, k: sum(x for x in xs if x % 2 == 0)),
    _Template(2, ("count_above", "how_many_above", "count_greater"), "ints", "int",
              "Return how many numbers in {x} are greater than {k}.", lambda xs, k: sum(x > k for x in xs),
              (0, 1, 3, 5, 8, 10, 15)),
    _Template(2, ("keep_above", "filter_above", "above"), "ints", "list[int]",
              "Return the numbers in {x} that are greater than {k}, in their order.",
              lambda xs, k: [x for x in xs if x > k], (0, 2, 4, 6, 9, 12)),
    _Template(2, ("count_letter", "letter_count", "count_char"), "text", "int",
              "Return how many times the letter '{k}' appears in {x}.", lambda s, k: s.count(k), tuple(_LETTERS)),
    _Template(2, ("scale_all", "multiply_all", "times_all"), "ints", "list[int]",
              "Return a new list with every number in {x} multiplied by {k}.", lambda xs, k: [x * k for x in xs],
              (2, 3, 4, 5, 10)),
    _Template(2, ("squares", "square_all", "squared"), "ints", "list[int]",
              "Return a new list with the square of every number in {x}.", lambda xs, k: [x * x for x in xs]),
    _Template(2, ("reverse_string", "backwards", "reversed_text"), "word", "str", "Return {x} reversed.",
              lambda s, k: s[::-1]),
    _Template(2, ("count_negative", "negatives", "how_many_negative"), "ints", "int",
              "Return how many numbers in {x} are below zero.", lambda xs, k: sum(x < 0 for x in xs)),
    _Template(2, ("join_words", "glue", "combine"), "words", "str", "Return the words of {x} joined by '{k}'.",
              lambda ws, k: k.join(ws), ("-", "_", ", ", " ", "+", "/")),
    _Template(2, ("long_words", "keep_long", "longer_than"), "words", "list[str]",
              "Return the words of {x} that have more than {k} letters, in their order.",
              lambda ws, k: [w for w in ws if len(w) > k], (2, 3, 4)),
    # rung 3: two steps
    _Template(3, ("sum_odd_squares", "odd_square_total", "square_odds_sum"), "ints", "int",
              "Return the sum of the squares of the odd numbers in {x}.",
              lambda xs, k: sum(x * x for x in xs if x % 2)),
    _Template(3, ("spread", "max_minus_min", "value_range"), "nonempty", "int",
              "Return the largest number in {x} minus the smallest ({x} is not empty).",
              lambda xs, k: max(xs) - min(xs)),
    _Template(3, ("is_palindrome", "palindrome", "reads_same"), "word", "bool",
              "Return True if {x} reads the same backwards, else False.", lambda s, k: s == s[::-1],
              make=lambda rng: rng.choice(_PALINDROMES if rng.random() < 0.5 else _WORDS)),
    _Template(3, ("unique_sorted", "distinct_sorted", "sorted_unique"), "ints", "list[int]",
              "Return the distinct numbers of {x}, sorted from smallest to largest.",
              lambda xs, k: sorted(set(xs))),
    _Template(3, ("dedupe", "remove_duplicates", "first_seen"), "ints", "list[int]",
              "Return the numbers of {x} without repeats, keeping the first time each appears.",
              lambda xs, k: _dedupe(xs)),
    _Template(3, ("running_sum", "prefix_sums", "cumulative"), "ints", "list[int]",
              "Return the running sums of {x}: item i is the sum of the first i + 1 numbers.",
              lambda xs, k: _running(xs)),
    _Template(3, ("count_words", "word_count", "how_many_words"), "text", "int",
              "Return how many words (separated by spaces) {x} holds.", lambda s, k: len(s.split())),
    _Template(3, ("count_between", "in_range", "between"), "ints", "int",
              "Return how many numbers in {x} are at least {k} and at most {k} + 10.",
              lambda xs, k: sum(k <= x <= k + 10 for x in xs), (-10, -5, 0, 5, 10)),
    _Template(3, ("capitalize_words", "title_words", "capitals"), "text", "str",
              "Return {x} with the first letter of every word in upper case.",
              lambda s, k: " ".join(w[:1].upper() + w[1:] for w in s.split(" "))),
    _Template(3, ("index_of_max", "argmax", "where_largest"), "nonempty", "int",
              "Return the index of the largest number in {x} (the first one if it appears twice; {x} is not "
              "empty).", lambda xs, k: xs.index(max(xs))),
)


def _input(kind: str, rng: random.Random, first: bool) -> Any:
    if kind in ("ints", "nonempty"):
        size = 0 if (first and kind == "ints" and rng.random() < 0.5) else rng.randint(1, 8)
        return [rng.randint(-20, 30) for _ in range(size)]
    if kind == "int":
        return rng.randint(-50, 100)
    if kind == "word":
        return rng.choice(_WORDS) if rng.random() < 0.7 else "".join(rng.choice(string.ascii_lowercase)
                                                                    for _ in range(rng.randint(1, 7)))
    if kind == "text":
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 6)))
    if kind == "words":
        return [rng.choice(_WORDS) for _ in range(rng.randint(0 if first else 1, 6))]
    raise ValueError(kind)


@dataclass(frozen=True)
class CodeProblem:
    statement: str
    """The signature and the docstring, as Python code."""
    spec: CodeSpec


def code_problem(n: int, *, rungs: tuple[int, ...], tests: int, namespace: str = "train") -> CodeProblem:
    """Problem ``n`` of the ``namespace`` stream ("train" or "eval")."""
    chosen = sorted(set(rungs))
    rng = random.Random(f"echo2-code-problems:{namespace}:{','.join(map(str, chosen))}:{tests}:{n}")
    template = rng.choice([t for t in TEMPLATES if t.rung in chosen])
    name, arg = rng.choice(template.names), rng.choice(_ARG_NAMES[template.arg])
    param = rng.choice(template.params)
    doc = template.doc.format(x=arg, k=param)
    statement = f'def {name}({arg}: {_TYPES[template.arg]}) -> {template.returns}:\n    """{doc}"""\n'
    cases = []
    for i in range(tests):
        value = template.make(rng) if template.make else _input(template.arg, rng, first=i == 0)
        cases.append(((value,), template.solve(value, param)))
    return CodeProblem(statement, CodeSpec(entry_point=name, prefix=statement, cases=tuple(cases)))
