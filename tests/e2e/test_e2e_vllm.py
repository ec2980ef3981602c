"""A whole run with vLLM actors: the learner and the Prefect flow in this environment, the actors in an
actor-only one with vLLM (``fleet.actor_python``). ``make test-vllm`` runs it with
``ECHO2_VLLM_PYTHON=.venv-vllm/bin/python``; skipped without it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

from echo2.bench.tiny_model import make_tiny_model

VLLM_PYTHON = os.environ.get("ECHO2_VLLM_PYTHON")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set ECHO2_VLLM_PYTHON to a Python with vLLM (make test-vllm)"),
]


def test_a_run_with_vllm_actors_trains_and_swaps_versions_in_place(tmp_path):
    model = make_tiny_model(tmp_path / "model", hidden_size=64)  # vLLM's CPU attention needs 32-wide heads
    sets = [f"model.name={model}", f"store.url={tmp_path}", "run.id=vllm", "train.max_steps=4",
            "train.checkpoint_every=2", "rollout.group_size=4", "rollout.groups_per_batch=2", "train.groups_per_step=2",
            "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "task.eval_size=10",
            "rollout.engine={kind: vllm, dtype: float32, enforce_eager: true, kv_cache_gib: 0.25}",
            f"fleet.actor_python={VLLM_PYTHON}"]
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "run", str(REPO / "configs" / "quickstart.yaml"),
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    run_dir = tmp_path / "runs" / "vllm"
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("actor*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs[-3000:]}"
    summary = json.loads((run_dir / "reports" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["rollouts_used"] >= 4 and summary["rollouts_quarantined"] == 0
    # the actors ran vLLM, each started its engine once and took later versions in place
    assert logs.count("vLLM engine up") == len(list((run_dir / "logs").glob("actor*.log"))) >= 1, logs[-3000:]
    assert logs.count("weights reloaded in place") >= 2, logs[-3000:]
    assert re.search(r"now generating with policy v[1-9]", logs), logs[-3000:]
