"""Grading math replies with math-verify in a worker process, under a wall-clock limit.

math-verify (``parse`` + ``verify``) bounds its own work with ``signal.alarm``, which works only in a
process's main thread: in any other thread it raises ValueError, and with its timeouts off nothing
bounds it. The learner verifies rollouts from a Prefect task thread and a reply is text an untrusted
actor chose (``\\boxed{9^{9^{9^{9^{9}}}}}`` keeps sympy busy for as long as it is let), so grading
runs in a spawned worker process whose main thread keeps math-verify's alarms, and the caller waits
at most ``timeout_s`` per reply: a reply that takes longer is "timeout" (ungraded: it scores 0) and
the worker is killed. A warm spare, started as soon as each worker is up (one more process of about
75 MB), takes its place at once, so a killed worker costs its reply's ``timeout_s`` and no start-up
(about 0.6 s of imports, seconds on a loaded machine); there is no start-up allowance on a reply. Actor and learner
grade through the same code, so they agree except on a reply that one
side finishes just under the limit and the other does not: ungraded on either side, its file is set
aside (``echo2/learner/verify.py``).

On the learner a file is graded under a ``FileBudget`` (``task.grade_file_budget_s`` seconds, at most
``task.grade_file_max_timeouts`` ungraded replies): past it the rest of the file is not graded and
``GradingBudgetExceeded`` is raised. So a file of hanging replies costs the learner one budget, not
``timeout_s`` per row.

The channel: the worker answers on a pipe of its own (file descriptor ``ECHO2_GRADER_FD``), one framed
line per answer (``echo2-grader ready`` once started, then ``echo2-grader grade {json}`` per reply);
its stdout and stderr go to /dev/null, so whatever sympy or a library prints cannot reach the
channel. A line that is not a well-formed frame is a worker fault: the worker is replaced and that
reply is ungraded ("fault: ..."), like a timeout; it never raises into the caller.

What is compared (``grade_reply`` in the worker):
- the gold answer, already cut out of the reference by the task, is parsed wrapped as ``$...$`` (bare
  LaTeX with nested commands does not parse otherwise) or as given when it holds ``\\boxed{}``;
- a reply with ``####`` is cut to the rest of that line after the last one (math-verify takes the
  last number, and ``####`` is no anchor for it), then parsed with LaTeX and plain-expression extraction: a
  ``\\boxed{}`` or an "answer is" / "Answer:" anchor wins, else the last number of the reply;
- ``verify(gold, reply)``: equal as numbers (to 6 decimals), as expressions (sympy), sets, intervals
  or equations: ``\\frac{1}{2}`` = ``0.5``, ``50\\%`` = ``0.5``, ``x=3`` = ``3``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Sequence

from pydantic import TypeAdapter, ValidationError

from echo2.tasks.base import GradingBudgetExceeded

PARSE_TIMEOUT_S = 2
"""math-verify's own alarm for one parse or one verify, in whole seconds (inside the worker)."""


@dataclass(frozen=True)
class Grade:
    correct: bool
    extracted: str | None
    """The answer math-verify found in the reply (None: nothing it could parse)."""
    boxed: bool
    """Whether the reply puts an answer in ``\\boxed{}``."""
    status: str = "ok"
    """"ok"; "error: ..." (math-verify gave up on the input: the reply scores 0, the same on every
    machine); or ungraded: "timeout" (over ``timeout_s``) or "fault: ..." (the worker died or sent
    something that is not an answer)."""

    @property
    def ungraded(self) -> bool:
        """The grader did not finish this reply: another machine may score it otherwise."""
        return self.status == "timeout" or self.status.startswith("fault")


def gold_expression(gold: str) -> str:
    """How a gold answer is handed to math-verify: as LaTeX math, so nested commands parse."""
    gold = gold.strip()
    if "\\boxed" in gold or (gold.startswith("$") and gold.endswith("$")):
        return gold
    return f"${gold}$"


def reply_expression(reply: str) -> str:
    """The part of a reply whose answer counts: the rest of the line after the last ``####`` when there
    is one (GSM8K's convention), else the whole reply."""
    return reply.rsplit("####", 1)[1].split("\n", 1)[0] if "####" in reply else reply


def grade_reply(gold: str, reply: str) -> Grade:
    """Grade in this process (the worker's main thread: math-verify's alarms apply)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    boxed = "\\boxed" in reply
    try:
        gold_parsed = parse(gold_expression(gold), extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                            parsing_timeout=PARSE_TIMEOUT_S)
        if not gold_parsed:
            return Grade(False, None, boxed, "error: the gold answer does not parse")
        parsed = parse(reply_expression(reply), extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                       parsing_timeout=PARSE_TIMEOUT_S)
        if not parsed:
            return Grade(False, None, boxed)
        extracted = str(parsed[-1])[:200]
        return Grade(bool(verify(gold_parsed, parsed, timeout_seconds=PARSE_TIMEOUT_S)), extracted, boxed)
    except Exception as exc:  # sympy and latex2sympy raise anything on odd input: the reply scores 0
        return Grade(False, None, boxed, f"error: {type(exc).__name__}")


RESULT_FD_ENV = "ECHO2_GRADER_FD"
"""Environment variable naming the worker's answer pipe (its write end, passed to the worker)."""
_READY = b"echo2-grader ready"
_GRADE = b"echo2-grader grade "
MAX_FRAME_BYTES = 64 * 1024
"""An answer line is a few hundred bytes (``extracted`` is cut at 200 characters); a longer one is a fault."""
_GRADE_FRAME = TypeAdapter(Grade)


def _serve() -> None:
    """Worker loop (``python -m echo2.tasks.math_grader``): import and warm up math-verify, say ready on the
    answer pipe, then read a JSON list of [gold, reply] per line on stdin and write one grade frame per
    item as it is done; stop at end of input."""
    answers = os.fdopen(int(os.environ[RESULT_FD_ENV]), "wb")
    grade_reply("1", "1")  # imports math-verify, sympy and the parsers: a spare is ready to grade at once
    answers.write(_READY + b"\n")
    answers.flush()
    for line in sys.stdin:
        for gold, reply in json.loads(line):
            answers.write(_GRADE + json.dumps(asdict(grade_reply(gold, reply))).encode() + b"\n")
            answers.flush()


STARTUP_S = 60.0
"""How long a worker may take to start (import math-verify and sympy, about 0.6 s on an idle machine)
before the grader gives up on it. Only the wait for a worker that a call begins with is not counted
against a file's budget; a replacement is a spare that has been starting since the worker before it
took over, so it is normally ready already."""


class _NoAnswer(Exception):
    """The worker gave no usable answer; ``status`` is the ungraded Grade's ("timeout" or "fault: ...")."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


class _Worker:
    """One grading process and the read end of its answer pipe."""

    def __init__(self, command: list[str]):
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, pass_fds=(write_fd,),
                                         env={**os.environ, RESULT_FD_ENV: str(write_fd)})
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the worker holds it now: end of file here once the worker is gone
        self.fd = read_fd
        self.buffer = b""
        self.ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _line(self, wait: float) -> bytes:
        deadline = time.monotonic() + wait
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_FRAME_BYTES:
                raise _NoAnswer(f"fault: an answer line over {MAX_FRAME_BYTES} bytes")
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise _NoAnswer("timeout")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise _NoAnswer("fault: the worker died")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def has_line(self) -> bool:
        return b"\n" in self.buffer or bool(select.select([self.fd], [], [], 0)[0])

    def await_ready(self, wait: float) -> None:
        if not self.ready:
            line = self._line(wait)
            if line != _READY:
                raise _NoAnswer(f"fault: the worker began with {line[:60]!r}, not the ready frame")
            self.ready = True

    def answer(self, wait: float) -> Grade:
        line = self._line(wait)
        if not line.startswith(_GRADE):
            raise _NoAnswer(f"fault: {line[:60]!r} is not a grade frame")
        try:
            return _GRADE_FRAME.validate_json(line[len(_GRADE):], strict=True)
        except ValidationError as exc:
            raise _NoAnswer(f"fault: unreadable grade ({exc.error_count()} errors)") from None

    def send(self, pairs: list[tuple[str, str]]) -> None:
        self.proc.stdin.write((json.dumps(pairs) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        try:
            self.proc.stdin.close()
        except OSError:  # unflushed bytes to a dead worker
            pass
        os.close(self.fd)


@dataclass(frozen=True)
class FileBudget:
    """What grading one rollout file may cost the learner (``task.grade_file_*``)."""

    seconds: float
    max_ungraded: int
    """Replies that may time out or fault; one more puts the file over its budget."""


class _Clock:
    def __init__(self, budget: FileBudget, rows: int):
        self.budget, self.rows = budget, rows
        self.started = time.monotonic()
        self.ungraded = 0

    def left(self) -> float:
        return self.budget.seconds - (time.monotonic() - self.started)

    def over(self, graded: int, why: str) -> GradingBudgetExceeded:
        return GradingBudgetExceeded(
            f"grading the file went over its budget ({why}): stopped after {graded} of its {self.rows} replies, "
            f"{self.ungraded} of which timed out or crashed the grader (at most {self.budget.max_ungraded} may), "
            f"in {time.monotonic() - self.started:.1f}s (budget {self.budget.seconds:g}s)")


class MathGrader:
    """Grades (gold, reply) pairs in a worker process, ``timeout_s`` at most per reply, with a warm spare
    worker to replace one that is killed. Thread-safe (calls are served one at a time)."""

    def __init__(self, timeout_s: float = 5.0, *, startup_s: float = STARTUP_S):
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._spare: _Worker | None = None
        self.command = [sys.executable, "-m", "echo2.tasks.math_grader"]
        """The worker process (``_serve`` above)."""
        self.replaced = 0
        """Workers killed (timeout, fault) and replaced by the spare."""
        self.waited_for_spare = 0
        """Replacements that found the spare still starting and had to wait for it."""
        atexit.register(self.close)

    @property
    def worker_pid(self) -> int | None:
        return None if self._worker is None else self._worker.pid

    @property
    def spare_pid(self) -> int | None:
        return None if self._spare is None else self._spare.pid

    def await_spare(self, timeout: float | None = None) -> None:
        """Block until the spare worker has started (say, before timing a grade)."""
        with self._lock:
            self._ensure_worker()
            self._await_worker(None, 0, replacement=False)
            self._spare.await_ready(self.startup_s if timeout is None else timeout)

    def _ensure_worker(self) -> None:
        """A worker: the spare when there is one, else a new one."""
        if self._worker is None:
            self._worker, self._spare = self._spare or _Worker(self.command), None

    def _replace(self) -> None:
        """Kill the worker; the spare takes over and a new spare starts."""
        if self._worker is not None:
            self._worker.kill()
            self._worker = None
            self.replaced += 1
        self._ensure_worker()

    def _await_worker(self, clock: _Clock | None, graded: int, *, replacement: bool = True) -> None:
        """Wait until the worker is ready; a replacement's wait is the file's cost (``clock``)."""
        for _ in range(3):
            worker = self._worker
            if not worker.ready:
                if replacement and not worker.has_line():
                    self.waited_for_spare += 1
                wait = self.startup_s if clock is None else min(self.startup_s, clock.left())
                try:
                    worker.await_ready(wait)
                except _NoAnswer as exc:
                    self._replace()
                    if clock is not None and wait < self.startup_s and exc.status == "timeout":
                        raise clock.over(graded, "out of time waiting for a replacement worker") from None
                    continue
            if self._spare is None:  # started once the worker is up, so that the two starts do not slow each other
                self._spare = _Worker(self.command)
            return
        raise RuntimeError(f"the math grader's worker ({' '.join(self.command)}) does not start: three in a row "
                           f"sent no ready frame within {self.startup_s:g}s")

    def grade(self, pairs: Sequence[tuple[str, str]], budget: FileBudget | None = None) -> list[Grade]:
        """One Grade per pair, in order. With ``budget`` (the learner grading one file) raises
        ``GradingBudgetExceeded`` as soon as the file is over it; without, every reply is graded."""
        with self._lock:
            if self._worker is not None and self._worker.proc.poll() is not None:
                self._replace()  # died while idle
            self._ensure_worker()
            # the start of the worker a call begins with is not the file's cost
            self._await_worker(None, 0, replacement=False)
            pairs = [(str(gold), str(reply)) for gold, reply in pairs]
            clock = None if budget is None else _Clock(budget, len(pairs))
            out: list[Grade] = []
            outstanding = 0  # replies sent to the worker and not answered yet
            send_failures = 0
            try:
                while len(out) < len(pairs):
                    try:
                        self._worker.send(pairs[len(out):])
                    except OSError:  # the worker died before it read them: no reply's fault
                        send_failures += 1
                        if send_failures == 3:
                            raise RuntimeError("the math grader's workers keep dying before they read a reply")
                        self._replace()
                        self._await_worker(clock, len(out))
                        continue
                    outstanding = len(pairs) - len(out)
                    while outstanding:
                        reply = pairs[len(out)][1]
                        if clock is not None and clock.left() <= 0:
                            raise clock.over(len(out), "out of time")
                        wait = self.timeout_s if clock is None else min(self.timeout_s, clock.left())
                        try:
                            out.append(self._worker.answer(wait))
                            outstanding -= 1
                            continue
                        except _NoAnswer as exc:  # stuck, dead or garbled on this reply: it is ungraded
                            self._replace()
                            outstanding = 0
                            if clock is not None and wait < self.timeout_s and exc.status == "timeout":
                                raise clock.over(len(out), "out of time") from None
                            out.append(Grade(False, None, "\\boxed" in reply, exc.status))
                        if clock is not None:
                            clock.ungraded += 1
                            if clock.ungraded > budget.max_ungraded:
                                raise clock.over(len(out), "too many replies the grader could not finish")
                        if len(out) < len(pairs):
                            self._await_worker(clock, len(out))
            except BaseException:
                if outstanding:
                    self._replace()  # it is still grading this call's replies: its next answers would be stale
                raise
            return out

    def close(self) -> None:
        """Kill the workers (they hold no state worth a graceful end)."""
        with self._lock:
            for worker in (self._worker, self._spare):
                if worker is not None:
                    worker.kill()
            self._worker = self._spare = None


if __name__ == "__main__":
    _serve()
