"""From a reply to a verdict: the program cut out of the reply, the harness that runs its tests in the sandbox, and
the reading of what the harness printed.

The program. A reply's code is its first fenced block (```` ```python ````, ```` ``` ````; one the token limit cut
open counts to its end) that defines the entry point, else its first fenced block; a reply without a fence is
code if it defines the entry point or, as the body of the function the prompt began (HumanEval's completion
style), if it compiles so. Code that defines the entry point runs after the prompt's own code (the signature and
docstring, with any helper or import the prompt shows: a docstring is a whole body, so the prompt's stub is
valid code that the reply's definition replaces); a body runs as the prompt's function's body. Nothing found:
``no-code``.

The harness. The sandboxed program is a fixed harness with the program in it as a string: it silences
``print`` (``sys.stdout`` and ``sys.stderr`` go nowhere, ``input()`` meets an empty stdin), seeds ``random``,
loads the program into a namespace of its own (``__name__`` is not ``__main__``), prints a ready line and only
then reads a nonce from stdin, which the sandbox writes once it sees that line (``Sandbox.run``'s handshake).
It then runs each test and reports it on a line of its own, ``<nonce> <i> <verdict>``, on a copy of the
original stdout, and ``<nonce> end`` after the last; then it exits at once (threads and ``atexit`` hooks of the
program do not run on). Two kinds of test:

- values (the generated curriculum, and MBPP-style rows whose every test is ``assert f(literal...) ==
  literal``): the harness gets the arguments only and reports ``repr`` of what the entry point returns; the
  expected values never enter the sandbox, and the caller compares them with the reported value read back as a
  Python literal (``ast.literal_eval``). A program cannot forge a pass without computing the answer.
- checks (HumanEval's ``check(candidate)``, other assert lines): the test code runs inside the sandbox, beside
  the program, and the harness reports pass (it raised nothing) or fail. Code loaded before the nonce exists
  cannot print a valid verdict line, but a program that inspects the harness (its frames, its stdin, its file
  descriptors) while its tests run, or returns objects that compare equal to anything, can forge a pass: the
  docs say so.

The verdict. Every test reported and the end line there: passed = the tests that passed; otherwise nothing
counts, and the program's outcome says why: ``timeout`` (its wall clock or CPU seconds) or ``crash`` (it did
not load, died, printed past the output cap, or lost its verdict lines). A verdict line that repeats a test
fails that test.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from echo2.tasks.sandbox import Outcome

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_CODE_LANGUAGES = {"", "python", "py", "python3", "py3"}


@dataclass(frozen=True)
class CodeSpec:
    """What a problem's reward needs: its entry point, the code its prompt began, its hidden tests."""

    entry_point: str
    prefix: str
    """The prompt's code: imports, helpers, the entry point's signature and docstring."""
    cases: tuple[tuple[tuple, Any], ...] = ()
    """Value tests: (arguments, expected value); the expected values stay outside the sandbox."""
    checks: tuple[str, ...] = ()
    """Check tests: code run beside the program with ``candidate`` bound to its entry point."""

    @property
    def tests(self) -> int:
        return len(self.cases) + len(self.checks)


@dataclass
class Verdict:
    status: str
    """passed, failed (every test reported), timeout, crash (not every test reported) or no-code."""
    passed: int
    tests: int
    seconds: float = 0.0
    verdicts: list[bool] = field(default_factory=list)

    @property
    def correct(self) -> bool:
        return self.status == "passed"


def extract_program(reply: str, spec: CodeSpec) -> str | None:
    """The program to test for ``reply`` (the module docstring's rules), or None when it holds no code."""
    blocks = [body for language, body in _FENCE.findall(reply) if language.lower() in _CODE_LANGUAGES]
    defines = re.compile(rf"^(?:async\s+)?def\s+{re.escape(spec.entry_point)}\s*\(", re.M)
    if blocks:
        code = next((b for b in blocks if defines.search(b)), blocks[0])
    else:
        code = reply
    if not code.strip():
        return None
    head = f"{spec.prefix.rstrip()}\n\n\n" if spec.prefix.strip() else ""
    if defines.search(code):
        return f"{head}{code.strip(chr(10))}\n"
    if not head:  # no function begun by the prompt (an MBPP statement): the code as it is, if it is code
        return f"{code.strip(chr(10))}\n" if blocks or _compiles(code) else None
    body = _as_body(code)
    if body is None:
        return None
    program = f"{spec.prefix.rstrip()}\n{body}\n"
    # prose, or code that is neither a definition nor a body, is no code; a fenced block is code all the same (it
    # loads and crashes on its own)
    return program if blocks or _compiles(program) else None


def _compiles(source: str) -> bool:
    try:
        compile(source, "<program>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def _as_body(code: str) -> str | None:
    """``code`` as the body of the prompt's function: indented lines up to the first one back at the margin (where
    a raw completion goes on with other definitions), or unindented code indented by four spaces."""
    lines = code.rstrip().split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    if not lines:
        return None
    if lines[0][:1] in (" ", "\t"):
        kept = []
        for line in lines:
            if line.strip() and line[:1] not in (" ", "\t"):
                break
            kept.append(line)
        return "\n".join(kept).rstrip()
    return "\n".join(("    " + line) if line.strip() else line for line in lines)


_HARNESS = '''import io as _io, json as _json, os as _os, random as _random, sys as _sys
_FD = _os.dup(1)
_IN = _sys.stdin.buffer
class _Nowhere(_io.TextIOBase):
    def write(self, text):
        return len(text)
_sys.stdout = _sys.stderr = _Nowhere()
_sys.stdin = _io.StringIO("")
def _say(line):
    data = (line + "\\n").encode()
    while data:
        data = data[_os.write(_FD, data):]
_NS = {"__name__": "__candidate__", "__builtins__": __builtins__}
_random.seed(0)
try:
    exec(compile(%(program)r, "<candidate>", "exec"), _NS)
    _F = _NS[%(entry)r]
    _LOADED = True
except BaseException:
    _LOADED = False
_say(%(ready)r)
_N = _IN.readline().decode(errors="replace").strip()
if not _LOADED:
    _say(_N + " load-error")
    _os._exit(0)
for _i, _a in enumerate(%(cases)r):
    _random.seed(_i)
    try:
        _v = "=" + repr(_F(*_a))
    except BaseException:
        _v = "!"
    _say(_N + " " + str(_i) + " " + _json.dumps(_v))
for _j, _t in enumerate(%(checks)r):
    _random.seed(_j)
    _g = dict(_NS)
    _g["candidate"] = _F
    try:
        exec(compile(_t, "<test>", "exec"), _g)
        _v = "pass"
    except BaseException:
        _v = "fail"
    _say(_N + " " + str(%(n_cases)d + _j) + " " + _json.dumps(_v))
_say(_N + " end")
_os._exit(0)
'''


def harness(program: str, spec: CodeSpec) -> tuple[str, tuple[str, str]]:
    """The sandboxed source for ``program`` and its handshake (ready line, nonce) for ``Sandbox.run``."""
    ready = f"echo2-harness-ready-{secrets.token_hex(8)}"
    nonce = secrets.token_hex(16)
    source = _HARNESS % {"program": program, "entry": spec.entry_point, "ready": ready,
                         "cases": [tuple(args) for args, _ in spec.cases], "checks": list(spec.checks),
                         "n_cases": len(spec.cases)}
    return source, (ready, nonce)


def judge(outcome: Outcome, spec: CodeSpec, nonce: str) -> Verdict:
    """The verdict of one run from what it printed (the module docstring's rules)."""
    reported: dict[int, str | None] = {}
    ended, loaded = False, True
    for line in outcome.stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue
        rest = line[len(nonce) + 1:]
        if rest == "end":
            ended = True
            break
        if rest == "load-error":
            loaded = False
            break
        index, _, payload = rest.partition(" ")
        if not index.isdigit() or not 0 <= int(index) < spec.tests:
            continue
        try:
            value = json.loads(payload)
        except ValueError:
            value = None
        i = int(index)
        reported[i] = None if i in reported else value  # a test reported twice: forged, it fails
    if not loaded or not ended or len(reported) < spec.tests:
        status = "timeout" if outcome.status == "timeout" else "crash"
        return Verdict(status, 0, spec.tests, outcome.seconds, [False] * spec.tests)
    verdicts = [_passes(spec, i, reported[i]) for i in range(spec.tests)]
    passed = sum(verdicts)
    return Verdict("passed" if passed == spec.tests else "failed", passed, spec.tests, outcome.seconds, verdicts)


def _passes(spec: CodeSpec, index: int, value: Any) -> bool:
    if not isinstance(value, str):
        return False
    if index >= len(spec.cases):
        return value == "pass"
    if not value.startswith("="):
        return False
    try:
        got = ast.literal_eval(value[1:])
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return same_value(got, spec.cases[index][1])


def same_value(got: Any, expected: Any) -> bool:
    """``got == expected`` with the type kept (True is not 1, 1.0 is not 1) and floats within 1e-6 (relative)."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, float) or isinstance(got, float):
        if not isinstance(got, (int, float)) or not isinstance(expected, (int, float)):
            return False
        return abs(got - expected) <= 1e-6 * max(1.0, abs(expected))
    if isinstance(expected, (list, tuple)):
        return (type(got) is type(expected) and len(got) == len(expected)
                and all(same_value(g, e) for g, e in zip(got, expected)))
    if isinstance(expected, dict):
        return (isinstance(got, dict) and got.keys() == expected.keys()
                and all(same_value(got[k], expected[k]) for k in expected))
    return type(got) is type(expected) and got == expected


def no_code(spec: CodeSpec) -> Verdict:
    return Verdict("no-code", 0, spec.tests, 0.0, [False] * spec.tests)


def value_cases(asserts: list[str], entry_point: str | None) -> tuple[str, tuple[tuple[tuple, Any], ...]] | None:
    """MBPP-style tests judged outside: every line ``assert NAME(literal, ...) == literal`` (one NAME for all), as
    (NAME, cases); None when any line is of another form (those run as checks inside the sandbox)."""
    name, cases = entry_point, []
    for line in asserts:
        try:
            tree = ast.parse(line.strip())
        except SyntaxError:
            return None
        if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
            return None
        test = tree.body[0].test
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
                and isinstance(test.left, ast.Call) and isinstance(test.left.func, ast.Name)
                and not test.left.keywords):
            return None
        if name is not None and test.left.func.id != name:
            return None
        name = test.left.func.id
        try:
            args = tuple(ast.literal_eval(a) for a in test.left.args)
            expected = ast.literal_eval(test.comparators[0])
        except (ValueError, SyntaxError, TypeError):
            return None
        cases.append((args, expected))
    return (name, tuple(cases)) if name and cases else None
