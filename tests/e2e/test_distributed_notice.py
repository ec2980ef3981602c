"""Under torchrun a notice can abandon a step (``learner/distributed.py``, ``DistributedLearner._safe_point``): the
ranks all-reduce at every safe point whether rank 0 holds a deferred signal, and leave the step together before any
weight changed. Two processes with gloo on the CPU (tests/support/abandoned_step.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e


def test_a_notice_abandons_a_two_rank_step_between_packs_and_no_weight_moves(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(REPO / "tests/support/abandoned_step.py"), str(tiny_model)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    [line] = [ast.literal_eval(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert line["abandoned"] and line["heard"] == 1, line
    assert line["unchanged"] and line["version"] == 0, line  # abandoned before the optimizer step, on every rank
    assert line["moved_after"], line  # the next step ran whole: the follower was back in step
