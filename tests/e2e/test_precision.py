"""train.dtype and train.activation_checkpointing through one Learner step (one process; the 2-rank
FSDP2 versions are in tests/support/precision_step.py, run by test_fsdp_precision_equals_one_process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from precision_step import (  # noqa: E402
    BF16_TOLERANCE,
    CASES,
    loss_differs,
    relative,
    step_tables,
    updates_differ,
)

from echo2.config import TrainConfig  # noqa: E402
from echo2.learner.learner import Learner  # noqa: E402


def one_step(model_dir, tables: list[pa.Table], **train) -> tuple[Learner, dict, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    learner = Learner(model_dir, TrainConfig(lr=1e-3, **train), temperature=1.0)
    metrics = learner.train_step(tables)
    return learner, metrics, learner.full_tensors()


@pytest.mark.parametrize("extra", [{}, {"kl_coef": 0.1}, {"lora_rank": 4}], ids=["full", "kl", "lora"])
def test_activation_checkpointing_changes_nothing_but_memory(tiny_model, extra):
    tables = step_tables()
    before = Learner(tiny_model, TrainConfig(**extra), temperature=1.0).full_tensors()
    plain, m0, w0 = one_step(tiny_model, tables, **extra)
    checkpointed, m1, w1 = one_step(tiny_model, tables, activation_checkpointing=True, **extra)
    # the names a version, a checkpoint and the optimizer state are keyed by stay as they were
    assert checkpointed.published_names == plain.published_names
    assert list(checkpointed.model.state_dict()) == list(plain.model.state_dict())
    assert [n for n, _ in checkpointed.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]
    assert m0["loss"] != 0 and m0["grad_norm"] > 0
    assert relative(m1["loss"], m0["loss"]) < 1e-5 and relative(m1["grad_norm"], m0["grad_norm"]) < 1e-5
    assert w1.keys() == w0.keys()
    moved = [k for k in w0 if not torch.equal(w0[k], before[k])]
    assert moved  # the step did change weights, and equally with and without checkpointing
    for k in w0:
        assert relative(w1[k], w0[k]) < 1e-5, k


def test_activation_checkpointing_recomputes_the_layers():
    """It is on: each layer runs twice per step (again in backward, up to its last saved tensor), only with it on."""
    from logprobs_shared import tiny_llama

    from echo2.learner.logprobs import PolicyLogprobs

    runs = {}
    for on in (False, True):
        model = tiny_llama()
        calls = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        if on:
            from torch.distributed._composable import checkpoint

            for layer in model.model.layers:
                checkpoint(layer)
        ids = torch.randint(0, 97, (2, 8))
        PolicyLogprobs(model, temperature=1.0, chunk_tokens=4)(ids, ids).sum().backward()
        runs[on] = len(calls)
    assert runs == {False: 1, True: 2}


def test_bf16_step_within_tolerance_of_fp32(tiny_model):
    """bf16 compute (autocast) with fp32 master weights and AdamW state; tolerances in BF16_TOLERANCE."""
    tables = step_tables()
    before = Learner(tiny_model, TrainConfig(), temperature=1.0).full_tensors()
    _, m32, w32 = one_step(tiny_model, tables)
    learner, m16, w16 = one_step(tiny_model, tables, dtype="bfloat16", activation_checkpointing=True, kl_coef=0.1)
    _, m32kl, w32kl = one_step(tiny_model, tables, kl_coef=0.1)
    assert all(v.dtype == torch.float32 for v in w16.values())  # master weights stay fp32
    assert all(s["exp_avg"].dtype == torch.float32 for s in learner.optimizer.state.values())
    assert loss_differs(m16["loss"], m32kl["loss"]) < BF16_TOLERANCE["loss"]
    assert relative(m16["grad_norm"], m32kl["grad_norm"]) < BF16_TOLERANCE["grad_norm"]
    assert updates_differ(w16, w32kl, before) < BF16_TOLERANCE["update"]
    # and bf16 did compute in bf16: not bit-equal to fp32
    assert m16["loss"] != m32kl["loss"]
    tensors, _ = learner.policy_version_tensors()  # publish.dtype, not the compute dtype, decides
    assert all(v.dtype == torch.float32 for v in tensors.values())


@pytest.mark.e2e
def test_fsdp_precision_equals_one_process(tiny_model, tmp_path):
    """2 FSDP2 ranks (gloo) with bf16 + activation checkpointing = one process with the same, within
    BF16_TOLERANCE; fp32 with checkpointing on 2 ranks = fp32 without in one process within 1e-5."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = Path(__file__).resolve().parents[1] / "support" / "precision_step.py"
    for world in (1, 2):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
            if world > 1 else [sys.executable]
        # a session of its own: a timeout kills torchrun's workers too, not only the launcher
        proc = subprocess.Popen([*launcher, str(script), str(tiny_model), str(tmp_path / f"w{world}")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
    before = {k: v for k, v in load_file(str(tmp_path / "w1" / "before.safetensors")).items()}
    weights = {(w, case): load_file(str(tmp_path / f"w{w}" / f"{case}.safetensors")) for w in (1, 2) for case in CASES}
    metrics = {(w, case): torch.load(tmp_path / f"w{w}" / f"{case}.pt") for w in (1, 2) for case in CASES}
    # fp32: checkpointing on either side, 2 ranks or 1 process, equals the plain one-process step; the KL
    # penalty (its reference sharded on 2 ranks) equals its own one-process step and does change the loss
    for got, want in [((1, "fp32-ac"), (1, "fp32")), ((2, "fp32"), (1, "fp32")), ((2, "fp32-ac"), (1, "fp32")),
                      ((2, "fp32-kl"), (1, "fp32-kl"))]:
        assert relative(metrics[got]["loss"], metrics[want]["loss"]) < 1e-5, (got, want)
        assert relative(metrics[got]["grad_norm"], metrics[want]["grad_norm"]) < 1e-5, (got, want)
        for k in before:
            assert relative(weights[got][k], weights[want][k]) < 1e-5, (got, want, k)
        assert metrics[got]["greedy"] == metrics[want]["greedy"]  # eval_model: the same weights generate alike
    assert relative(metrics[1, "fp32-kl"]["loss"], metrics[1, "fp32"]["loss"]) > 1e-4
    # bf16 with checkpointing: FSDP2's bf16 parameters against one process's autocast
    for case in ("bf16-ac", "bf16-ac-kl"):
        assert loss_differs(metrics[2, case]["loss"], metrics[1, case]["loss"]) < BF16_TOLERANCE["loss"], case
        assert relative(metrics[2, case]["grad_norm"],
                        metrics[1, case]["grad_norm"]) < BF16_TOLERANCE["grad_norm"], case
        assert updates_differ(weights[2, case], weights[1, case], before) < BF16_TOLERANCE["update"], case
