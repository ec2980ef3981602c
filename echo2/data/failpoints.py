"""Fault injection for the crash tests: kill this process with SIGKILL at a chosen point of its work.

``ECHO2_FAILPOINTS="publish:3"`` kills the process the 3rd time it passes ``failpoint("publish")``;
several are separated by commas. Unset (always, outside the crash tests) a failpoint costs a dict
lookup. The learner passes ``publish`` between the files of a policy version and before it moves
``LATEST``, ``checkpoint`` between the files of a checkpoint, and ``step`` after choosing a step's
rollouts and after training on them, so a test can kill it at any moment of each.
"""

from __future__ import annotations

import os
import signal

ENV = "ECHO2_FAILPOINTS"
_hits: dict[str, int] = {}


def _targets() -> dict[str, int]:
    out = {}
    for item in os.environ.get(ENV, "").split(","):
        name, _, count = item.strip().partition(":")
        if name and count.isdigit():
            out[name] = int(count)
    return out


def failpoint(name: str) -> None:
    if ENV not in os.environ:
        return
    target = _targets().get(name)
    if target is None:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == target:
        os.kill(os.getpid(), signal.SIGKILL)
