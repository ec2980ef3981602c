"""Shared by the tests: moved out of test_e2e.py (which imports them back) so other test modules import
them from here, not from a test module."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


TINY = ["train.max_steps=4", "train.checkpoint_every=2", "rollout.group_size=4", "rollout.groups_per_batch=2",
        "train.groups_per_step=2", "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "task.eval_size=10",
        "train.lr=1e-3"]


def echo2(*args, check=True, timeout=300, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("cwd", REPO)
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"echo2 {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]
