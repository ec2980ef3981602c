"""One GRPO step of the learner per case, in one process or as rank r of a torchrun group (run by
tests/e2e/test_distributed.py and tests/e2e/test_moe.py), with every option of issue 19 on: small token-budget packs
(some rows over the budget, so alone in a pack), small log-probability chunks, activation checkpointing;
``bf16`` adds train.dtype bfloat16. Rank 0 writes the weights after case fp32's step to OUT (another case's
to OUT with ``.CASE`` before its suffix) and prints one line per case, {'case', 'world', 'loss', 'grad_norm',
'rollouts', 'groups_with_signal'}, the last line of its output; every rank prints {'case', 'rank', 'packs',
'fillers'} (the packs it trained and the zero-weight passes it ran for FSDP's collectives) before it.
Usage: [torchrun --nproc-per-node N] distributed_step.py MODEL_DIR OUT [CASE ...]   (default: fp32)"""

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
from echo2.learner.process_group import control_group, leave  # noqa: E402

EVERY_OPTION = {"micro_batch_tokens": 48, "logprob_chunk_tokens": 16, "activation_checkpointing": True}
CASES = {"fp32": EVERY_OPTION, "bf16": {**EVERY_OPTION, "dtype": "bfloat16"}}


def tables() -> list[pa.Table]:
    """Two files of varied rewards and very uneven lengths (sequences of 3 to 242 tokens; budget 48)."""
    def completion(f: int, i: int) -> list[int]:
        n = 240 if (f, i) == (0, 0) else 1 + (i * 37 + f * 11) % 89  # one long row: the ranks run unequal counts
        return [4 + (i * 7 + k) % 290 for k in range(n)]

    # near the random model's own (log 1/300 = -5.7): ratios near 1, so the loss depends on the policy
    return step_files(completion=completion, behavior=lambda k: -5.6 - 0.05 * (k % 5))


def report(line: dict) -> None:
    """One line in one write: the ranks share stdout, and print() writes the newline separately, so two
    ranks' lines could interleave into one."""
    sys.stdout.write(f"{line!r}\n")
    sys.stdout.flush()


def count_passes(learner, case: str) -> None:
    """Print, on every rank, the packs it trained and the zero-weight filler passes it ran in each step."""
    calls = {"backward": 0, "micro_batch": 0}
    backward, micro_batch, accumulate = learner._backward, learner._micro_batch, learner._accumulate

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    def accumulate_and_report(*args, **kwargs):
        calls.update(backward=0, micro_batch=0)
        totals = accumulate(*args, **kwargs)
        report({"case": case, "rank": world()[0], "packs": calls["backward"],
                "fillers": calls["micro_batch"] - calls["backward"]})
        return totals

    learner._backward = counted("backward", backward)
    learner._micro_batch = counted("micro_batch", micro_batch)
    learner._accumulate = accumulate_and_report


def weights_file(out: Path, case: str) -> Path:
    """Where rank 0 writes the weights after ``case``'s step."""
    return out if case == "fp32" else out.with_suffix(f".{case}{out.suffix}")


def main(model_dir: Path, out: Path, cases: list[str]) -> None:
    nproc = int(os.environ.get("WORLD_SIZE", "1"))
    for case in cases:
        config = TrainConfig(lr=1e-3, **CASES[case])
        if nproc > 1:
            init_process_group(LearnerConfig(nproc=nproc))
        torch.manual_seed(0)
        learner = make_learner(model_dir, config, temperature=1.0)
        count_passes(learner, case)
        rank, size = world()
        if rank != 0:
            learner.follow()
            continue
        metrics = learner.train_step(tables())
        weights = learner.full_tensors()
        if nproc > 1:  # the followers go on to the next case (release_followers releases only once a run)
            torch.distributed.broadcast_object_list(["stop", None], src=0, group=control_group())
        save_file({k: v.contiguous() for k, v in weights.items()}, str(weights_file(out, case)))
        report({"case": case, "world": size, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                "rollouts": metrics["rollouts"], "groups_with_signal": metrics["groups_with_signal"]})
    leave()  # as a process of `echo2 learner` does (process_group.leave)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] or ["fp32"])
