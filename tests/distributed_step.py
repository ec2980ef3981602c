"""One GRPO step of the learner, in one process or as rank r of a torchrun group (run by
tests/test_distributed.py). Writes the updated weights (rank 0) to OUT as safetensors.
Usage: [torchrun --nproc-per-node N] distributed_step.py MODEL_DIR OUT"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import make_rollouts  # noqa: E402

from echo2.config import TrainConfig  # noqa: E402
from echo2.data.rollouts import encode_rollouts  # noqa: E402
from echo2.learner.distributed import init_process_group, make_learner, release_followers, world  # noqa: E402


def tables() -> list[pa.Table]:
    """Two files of varied rewards and lengths: 7 micro-batches of 2 rows, dealt unevenly over 2 ranks."""
    out = []
    for f in range(2):
        rows = make_rollouts(n_groups=3, group_size=4, vocab=300, salt=f"-{f}",
                             reward=lambda g, s: float((g + s + f) % 3 == 0), logprob=-1.2)
        for i, r in enumerate(rows):  # lengths differ, so the length sort and padding matter
            r.completion_token_ids = [4 + (i + k) % 200 for k in range(3 + i % 5)]
            r.behavior_logprobs = [-1.0 - 0.1 * k for k in range(len(r.completion_token_ids))]
        data = encode_rollouts(rows, run_id="run", actor_id="a", policy_version=0, task="arithmetic")
        out.append(pa.ipc.open_file(pa.BufferReader(data)).read_all())
    return out


def main(model_dir: Path, out: Path) -> None:
    config = TrainConfig(micro_batch_size=2, lr=1e-3, nproc=int(__import__("os").environ.get("WORLD_SIZE", "1")))
    if config.nproc > 1:
        init_process_group(config)
    torch.manual_seed(0)
    learner = make_learner(model_dir, config, temperature=1.0)
    rank, size = world()
    if rank != 0:
        learner.follow()
        return
    metrics = learner.train_step(tables())
    weights = learner.full_tensors()
    release_followers()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out))
    print({"world": size, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "rollouts": metrics["rollouts"],
           "groups_with_signal": metrics["groups_with_signal"]})


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
