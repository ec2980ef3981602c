"""The learner over 2 processes (torchrun, gloo on CPU, FSDP2) against the one-process learner."""

from __future__ import annotations

import ast
import subprocess
import sys

from safetensors.torch import load_file

from conftest import REPO

SCRIPT = str(REPO / "tests" / "distributed_step.py")
ATOL = 1e-5
"""Weights after one AdamW step (lr 1e-3) agree to this: the ranks sum the same gradient in another order."""


def _step(tiny_model, out, nproc: int) -> dict:
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 \
        else [sys.executable]
    proc = subprocess.run([*prefix, SCRIPT, str(tiny_model), str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


def test_one_distributed_step_updates_the_weights_as_one_process_does(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    one = _step(tiny_model, tmp_path / "one.safetensors", 1)
    two = _step(tiny_model, tmp_path / "two.safetensors", 2)
    assert one["world"] == 1 and two["world"] == 2
    assert abs(one["loss"] - two["loss"]) < 1e-6 and abs(one["grad_norm"] - two["grad_norm"]) < 1e-5, (one, two)
    assert one["rollouts"] == two["rollouts"] == 24 and one["groups_with_signal"] == two["groups_with_signal"] > 0
    a, b = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    assert a.keys() == b.keys() and "lm_head.weight" not in a  # the tied duplicate left out, as published
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    moved = max((a[k] - initial[k]).abs().max().item() for k in a)
    assert moved > 1e-4  # the step did move the weights
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"largest difference of a weight, 2 ranks vs 1 process: {worst:.2e} (moved up to {moved:.2e})")
    assert worst < ATOL, worst


def test_echo2_run_drives_a_two_process_learner_end_to_end(tiny_model, tmp_path):
    """`echo2 run ... --set train.nproc=2`: torchrun, the flow in rank 0, a real actor, a real store. Rank 0
    is SIGKILLed in step 3 (a failpoint: the collector and the update each pass it); `--resume` on two ranks again continues from step 2's checkpoint
    (weights and optimizer state broadcast from rank 0) and finishes with every rollout file accounted for."""
    import json
    import os

    from test_e2e import QUICKSTART, TINY, echo2, sets

    from echo2.data.store import open_store
    from helpers import ledger_audit, reap_session, reap_tagged

    args = sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=fsdp", *TINY, "train.nproc=2",
                "eval.before=false")
    # its own session: what a SIGKILLed rank 0 leaves behind (Prefect's ephemeral server) is reaped after
    with open(tmp_path / "killed.log", "w") as out:
        killed = subprocess.Popen([sys.executable, "-m", "echo2.cli", "run", QUICKSTART, *args], cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "ECHO2_FAILPOINTS": "step:6", "ECHO2_TEST_TAG": str(tmp_path)})
        try:
            code = killed.wait(timeout=600)  # torchrun ends the other rank when rank 0 dies
        finally:
            reap_session(killed)
            reap_tagged(str(tmp_path))  # rank 0's Prefect server, in rank 0's session (torchrun starts one per rank)
    run = tmp_path / "runs" / "fsdp"
    assert code != 0 and not (run / "reports" / "summary.json").exists(), (tmp_path / "killed.log").read_text()[-2000:]
    assert (run / "checkpoints" / "step-000002" / "manifest.json").exists()
    proc = echo2("run", QUICKSTART, *args, "--resume", timeout=600)
    summary = json.loads((run / "reports" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["eval_after"] is not None, proc.stdout[-2000:]
    assert json.loads((run / "policy" / "LATEST").read_text()) == {"version": 4}
    problems, counts = ledger_audit(open_store(str(run)))
    assert not problems and counts["used"] >= 4, (problems, counts)
