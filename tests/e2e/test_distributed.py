"""The learner over 2 processes (torchrun, gloo on CPU, FSDP2) against the one-process learner."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
from conftest import REPO
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

SCRIPT = str(REPO / "tests" / "support" / "distributed_step.py")
ATOL = 1e-5
"""fp32 weights after one AdamW step (lr 1e-3) agree to this: the ranks sum the same gradient in another order."""
BF16 = {"loss": 1e-3, "grad_norm": 1e-3, "update": 0.25}
"""bf16, 2 ranks against one process, relative: loss, gradient norm, and the AdamW update over all weights
(||update_2 - update_1|| / ||update_1||; the update bound is tests/support/precision_step.py's). They differ by more
than float order: one process autocasts (bf16 matmuls, fp32 norms and parameters), FSDP2's
MixedPrecisionPolicy computes with bf16 copies of every parameter, norms included; and AdamW's first step,
lr g / (|g| + eps), turns the sign of every small gradient element into a full step (measured on the tiny
model: loss 4.8e-5, gradient norm 3.7e-4, update 0.10)."""


def _step(tiny_model, out, nproc: int) -> tuple[dict, list[dict]]:
    """Every case of distributed_step.py: rank 0's metrics per case, and every rank's pass counts."""
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 \
        else [sys.executable]
    proc = subprocess.run([*prefix, SCRIPT, str(tiny_model), str(out), "fp32", "bf16"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [ast.literal_eval(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {m["case"]: m for m in lines if "world" in m}, [m for m in lines if "rank" in m]


def test_two_fsdp_ranks_step_as_one_process_with_every_option_on(tiny_model, tmp_path):
    """Packs of a small token budget dealt by tokens (one rank runs zero-weight fillers), small logprob chunks,
    activation checkpointing: 2 ranks = 1 process, in fp32 up to float order and in bf16 within ``BF16``."""
    from transformers import AutoModelForCausalLM

    one, _ = _step(tiny_model, tmp_path / "one.safetensors", 1)
    two, passes = _step(tiny_model, tmp_path / "two.safetensors", 2)
    assert {m["world"] for m in one.values()} == {1} and {m["world"] for m in two.values()} == {2}
    for case in ("fp32", "bf16"):
        assert one[case]["rollouts"] == two[case]["rollouts"] == 24
        assert one[case]["groups_with_signal"] == two[case]["groups_with_signal"] > 0
        counts = {m["rank"]: m for m in passes if m["case"] == case}
        assert counts[0]["packs"] + counts[1]["packs"] > 2
        assert counts[0]["packs"] + counts[0]["fillers"] == counts[1]["packs"] + counts[1]["fillers"]
        assert counts[0]["fillers"] + counts[1]["fillers"] > 0  # the uneven deal's filler passes ran
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    f1, f2 = one["fp32"], two["fp32"]
    assert abs(f1["loss"] - f2["loss"]) < 1e-6 and abs(f1["grad_norm"] - f2["grad_norm"]) < 1e-5, (f1, f2)
    a, b = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    assert a.keys() == b.keys() and "lm_head.weight" not in a  # the tied duplicate left out, as published
    moved = max((a[k] - initial[k]).abs().max().item() for k in a)
    assert moved > 1e-4  # the step did move the weights
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    b1, b2 = one["bf16"], two["bf16"]
    c, d = load_file(tmp_path / "one.bf16.safetensors"), load_file(tmp_path / "two.bf16.safetensors")
    update = (sum(((d[k] - c[k]).double() ** 2).sum() for k in c) /
              sum(((c[k] - initial[k]).double() ** 2).sum() for k in c)).sqrt().item()
    print(f"2 ranks vs 1 process, every option on: fp32 largest weight difference {worst:.2e} (moved up to "
          f"{moved:.2e}); bf16 loss {relative(b2['loss'], b1['loss']):.1e}, grad norm "
          f"{relative(b2['grad_norm'], b1['grad_norm']):.1e}, update {update:.1e} relative")
    assert worst < ATOL, worst
    assert relative(b2["loss"], b1["loss"]) < BF16["loss"], (b1, b2)
    assert relative(b2["grad_norm"], b1["grad_norm"]) < BF16["grad_norm"], (b1, b2)
    assert update < BF16["update"]


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_echo2_run_drives_a_two_process_learner_end_to_end(tiny_model, tmp_path):
    """`echo2 run ... --set learner.nproc=2`: torchrun, the flow in rank 0, a real actor, a real store. Rank 0
    is SIGKILLed in step 3 (a failpoint: the collector and the update each pass it); `--resume` on two ranks
    again continues from step 2's checkpoint (weights and optimizer state broadcast from rank 0) and finishes
    with every rollout file accounted for."""
    import json
    import os

    from e2e_runs import QUICKSTART, TINY, echo2, sets
    from helpers import ledger_audit, reap_session, reap_tagged

    from echo2.data.store import open_store

    args = sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=fsdp", *TINY, "learner.nproc=2",
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


def test_no_follower_holds_the_model_and_a_publish_holds_no_fp32_copy(tmp_path):
    """Two gloo ranks load a ~0.44B-parameter model (1.7 GB in fp32, saved in bf16): the follower never holds it
    whole (its shard is half the fp32 model: its peak stays well under the whole), rank 0 holds the checkpoint once
    in the file's dtype; a bf16 publish gathers tensor by tensor, so rank 0's peak grows by less than the fp32 state.
    Before, every rank loaded the whole fp32 model (peak >= 1x fp32), and a publish gathered the full fp32 state
    on rank 0's CPU before casting it (peak >= 1.5x fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from echo2.bench.tiny_model import arithmetic_tokenizer

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=6,
                         num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
                         max_position_embeddings=256)
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # random weights, a bf16 checkpoint as published models are
    model.save_pretrained(tmp_path / "model")
    arithmetic_tokenizer().save_pretrained(tmp_path / "model")
    del model
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(REPO / "tests" / "support" / "memory_run.py"), str(tmp_path / "model")], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [ast.literal_eval(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    load = {m["rank"]: m["load_peak_mb"] for m in lines if "load_peak_mb" in m}
    publish = next(m for m in lines if "publish_peak_mb" in m)
    fp32_mb = params * 4 / 2**20
    assert abs(publish["fp32_mb"] - fp32_mb) < 1
    print(f"{params / 1e9:.2f}B parameters, {fp32_mb:.0f} MB in fp32: load peak above start rank 0 {load[0]:.0f} MB, "
          f"follower {load[1]:.0f} MB; rank 0's bf16 publish peak {publish['publish_peak_mb']:.0f} MB "
          f"({publish['published_mb']:.0f} MB published)")
    assert load[1] < 0.75 * fp32_mb  # its fp32 shard (0.5x) and one tensor in flight, never the whole model
    assert publish["publish_peak_mb"] < fp32_mb


def test_one_process_that_shards_steps_evaluates_and_checkpoints_as_one_that_does_not(tiny_model, tmp_path,
                                                                                        one_rank_group):
    """FSDP2 over a one-rank group (what one GPU runs): the same step, greedy tokens, published weights and a
    checkpoint that restores them, as the unsharded one-process learner."""
    import torch
    from distributed_step import tables

    from echo2.config import TrainConfig
    from echo2.data.store import open_store
    from echo2.learner.evaluate import ModelSampler
    from echo2.learner.learner import Learner

    def run(sharded: bool):
        torch.manual_seed(0)
        learner = Learner(tiny_model, TrainConfig(lr=1e-3, micro_batch_tokens=48, logprob_chunk_tokens=16,
                                                  attention="varlen"), temperature=1.0, sharded=sharded)
        metrics = learner.train_step(tables())
        greedy = ModelSampler(learner.eval_model(), learner.tokenizer, temperature=None, batch_size=4)
        tokens = [r.token_ids for r in greedy([[1, 5, 9], [1, 7], [1, 2, 3, 4]], max_new_tokens=6)]
        return learner, metrics, tokens, learner.full_tensors()

    plain, m0, t0, w0 = run(False)
    sharded, m1, t1, w1 = run(True)
    assert sharded.sharded and not plain.sharded
    assert relative(m1["loss"], m0["loss"]) < 1e-5 and relative(m1["grad_norm"], m0["grad_norm"]) < 1e-5
    assert w0.keys() == w1.keys()
    assert max((w0[k] - w1[k]).abs().max().item() for k in w0) < ATOL
    assert t0 == t1
    store = open_store(str(tmp_path))
    entries = {e["name"]: e for e in sharded.save_sharded(store, "ckpt")}
    sharded.train_step(tables())  # move on, then restore
    sharded.load_sharded(store, "ckpt", entries)
    restored = sharded.full_tensors()
    assert all(torch.equal(restored[k], w1[k]) for k in w1)
