"""Grading math replies with math-verify in a worker process, under a wall-clock limit.

math-verify (``parse`` + ``verify``) bounds its own work with ``signal.alarm``, which works only in a
process's main thread: in any other thread it raises ValueError, and with its timeouts off nothing
bounds it. The learner verifies rollouts from a Prefect task thread and a reply is text an untrusted
actor chose (``\\boxed{9^{9^{9^{9^{9}}}}}`` keeps sympy busy for as long as it is let), so grading
runs in a spawned worker process whose main thread keeps math-verify's alarms, and the caller waits
at most ``timeout_s`` per reply: a reply that takes longer scores 0 ("timeout") and the worker is
killed and replaced. Actor and learner grade through the same code, so they agree except on a reply
that one side finishes just under the limit and the other does not (the file is then quarantined).

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
    """"ok", "timeout" or "error: ..."."""


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


def _serve() -> None:
    """Worker loop (``python -m echo2.tasks.math_grader``): read a JSON list of [gold, reply] per line on
    stdin, write one JSON grade per item on stdout as it is done; stop at end of input."""
    for line in sys.stdin:
        for gold, reply in json.loads(line):
            sys.stdout.write(json.dumps(asdict(grade_reply(gold, reply))) + "\n")
            sys.stdout.flush()


STARTUP_S = 60.0
"""Extra wait for a new worker's first answer (it imports math-verify and sympy)."""


class MathGrader:
    """Grades (gold, reply) pairs in a worker process, ``timeout_s`` at most per reply. Thread-safe."""

    def __init__(self, timeout_s: float = 5.0):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self.command = [sys.executable, "-m", "echo2.tasks.math_grader"]
        """The worker process (``_serve`` below)."""
        self._warm = False
        """Whether the worker has answered once (its start, ~2 s of imports, is not counted against a reply)."""
        atexit.register(self.close)

    def _start(self) -> None:
        self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._buffer = b""
        self._warm = False

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdin.close()
            self._proc.stdout.close()
        self._proc = None

    def _read_line(self, wait: float) -> bytes | None:
        """One line from the worker within ``wait`` seconds, or None (stuck or dead)."""
        deadline = time.monotonic() + wait
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # the worker died
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def grade(self, pairs: Sequence[tuple[str, str]]) -> list[Grade]:
        with self._lock:
            out: list[Grade] = []
            pending = [(str(gold), str(reply)) for gold, reply in pairs]
            while pending:
                if self._proc is None or self._proc.poll() is not None:
                    self._kill()
                    self._start()
                try:
                    self._proc.stdin.write((json.dumps(pending) + "\n").encode())
                    self._proc.stdin.flush()
                except (BrokenPipeError, OSError):
                    self._kill()  # died between batches: start a new one and send again
                    continue
                done = 0
                for _ in pending:
                    line = self._read_line(self.timeout_s + (0.0 if self._warm else STARTUP_S))
                    if line is None:
                        break
                    out.append(Grade(**json.loads(line)))
                    self._warm = True
                    done += 1
                if done < len(pending):  # the worker is stuck on (or died at) pending[done]: it scores 0
                    self._kill()
                    out.append(Grade(False, None, "\\boxed" in pending[done][1], "timeout"))
                    done += 1
                pending = pending[done:]
            return out

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                try:
                    self._proc.stdin.close()  # end of input: the worker returns
                    self._proc.wait(2)
                except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                    pass
            self._kill()


if __name__ == "__main__":
    _serve()
