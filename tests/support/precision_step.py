"""Two learner steps per precision case, in one process or as rank r of a torchrun group (FSDP2 over gloo);
run by tests/e2e/test_precision.py. Rank 0 writes OUT_DIR/{case}.safetensors (the weights after the steps),
OUT_DIR/{case}.pt (the second step's loss and grad_norm, the greedy tokens of ``eval_model()``) and
OUT_DIR/before.safetensors (the weights before any step, one process).
Usage: [torchrun --nproc-per-node N] precision_step.py MODEL_DIR OUT_DIR

Cases: fp32 (plain), fp32-ac (activation checkpointing), bf16-ac (train.dtype bfloat16 + checkpointing:
one process autocasts, FSDP2 computes with bf16 parameters through its MixedPrecisionPolicy), and both with
the KL penalty on (its frozen reference is sharded too on 2 ranks)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import step_files  # noqa: E402

from echo2.config import LearnerConfig, TrainConfig  # noqa: E402
from echo2.learner.distributed import init_process_group, make_learner, world  # noqa: E402
from echo2.learner.evaluate import ModelSampler  # noqa: E402
from echo2.learner.process_group import control_group, leave  # noqa: E402

CASES = {"fp32": {}, "fp32-ac": {"activation_checkpointing": True},
         "bf16-ac": {"dtype": "bfloat16", "activation_checkpointing": True},
         "fp32-kl": {"kl_coef": 0.5},
         "bf16-ac-kl": {"dtype": "bfloat16", "activation_checkpointing": True, "kl_coef": 0.5}}
BF16_TOLERANCE = {"loss": 0.01, "grad_norm": 0.01, "update": 0.2}
"""A bf16 step against an fp32 one (or FSDP2's bf16 against one process's autocast) on the tiny model, relative:
loss (``loss_differs``) and gradient norm, and ``updates_differ`` of the AdamW update (|d_a - d_b| / |d_b|, over
all weights)."""
LOSS_SCALE = 0.1
"""The size of loss below which bf16's rounding is judged absolutely (``loss_differs``)."""


def relative(a, b) -> float:
    """|a - b| / |b| for numbers, or the largest element's over the tensor's largest magnitude for tensors."""
    if isinstance(a, torch.Tensor):
        return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))
    return abs(a - b) / max(abs(b), 1e-12)


def loss_differs(a: float, b: float) -> float:
    """|a - b| / max(|b|, ``LOSS_SCALE``). GRPO's loss is a mean of advantage-weighted ratios whose advantages sum
    to zero per group, so it is a near-cancelling sum (about 0.01 here) of terms of size about 1: bf16 rounds those
    terms, not their sum, so a bf16 loss is off by a share of the terms' size, and a relative error of the tiny sum
    measures the cancellation, not the precision. Which CPU kernels run decides how much: on an AMD EPYC (AVX2, no
    AVX-512 BF16; 2026-12-03) one process's autocast was 1.8% off fp32's second-step loss (1.7e-4 absolute) and
    FSDP2's bf16 parameters 0.2%, with gradient norms within 2e-4 of each other, where earlier machines had every
    loss within 1%. A wrong loss (a factor, a missing term) moves it by its own size and is still caught."""
    return abs(a - b) / max(abs(b), LOSS_SCALE)


def updates_differ(after_a: dict, after_b: dict, before: dict) -> float:
    """|(a - before) - (b - before)| / |b - before| over every weight (one norm over all of them)."""
    diff = sum(float(((after_a[k] - before[k]).double() - (after_b[k] - before[k]).double()).square().sum())
               for k in before)
    size = sum(float((after_b[k] - before[k]).double().square().sum()) for k in before)
    return (diff / size) ** 0.5


def step_tables() -> list[pa.Table]:
    """Two files of varied rewards and lengths (several micro-batches, dealt unevenly over 2 ranks)."""
    # near the random model's own (log 1/300 = -5.7): ratios near 1, so the loss depends on the policy
    return step_files(completion=lambda f, i: [4 + (i * 7 + k) % 200 for k in range(3 + (i * 5) % 11)],
                      behavior=lambda k: -5.6 - 0.05 * (k % 5))


def main(model_dir: Path, out: Path) -> None:
    nproc = int(os.environ.get("WORLD_SIZE", "1"))
    out.mkdir(parents=True, exist_ok=True)
    for case, options in CASES.items():
        # a small token budget: several micro-batches, so that both ranks run some
        config = TrainConfig(micro_batch_tokens=40, lr=1e-3, **options)
        if nproc > 1:
            init_process_group(LearnerConfig(nproc=nproc))
        torch.manual_seed(0)
        learner = make_learner(model_dir, config, temperature=1.0)
        if nproc > 1 and config.kl_coef > 0:  # no rank holds a full copy of the reference either
            from torch.distributed.fsdp import FSDPModule
            assert isinstance(learner.reference_policy, FSDPModule)
        if case == "fp32" and world()[0] == 0 and nproc == 1:
            save_file({k: v.contiguous() for k, v in learner.full_tensors().items()}, str(out / "before.safetensors"))
        if world()[0] != 0:
            learner.follow()
            continue
        learner.train_step(step_tables())
        metrics = learner.train_step(step_tables())  # a second step: the policy has left the KL reference
        weights = learner.full_tensors()
        # evaluation generates on rank 0 alone, from a copy of the gathered weights
        greedy = [r.token_ids for r in ModelSampler(learner.eval_model(), learner.tokenizer, temperature=None,
                                                    batch_size=2)([[1, 2, 3], [5, 6, 7, 8]], 6)]
        if nproc > 1:  # the followers go on to the next case (release_followers releases only once a run)
            torch.distributed.broadcast_object_list(["stop", None], src=0, group=control_group())
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{case}.safetensors"))
        torch.save({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "greedy": greedy}, out / f"{case}.pt")
        print(case, {"world": nproc, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]})


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    leave()  # the groups down before exit, as a process of `echo2 learner` (process_group.leave)
