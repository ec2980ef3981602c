"""Host memory of a sharded learner at load and at publish, as rank r of a torchrun group (run by
tests/e2e/test_distributed.py). Usage: torchrun --nproc-per-node N memory_run.py MODEL_DIR

Every rank builds the learner (meta init, rank 0 reads the checkpoint and sends each tensor, every rank keeps its
shards) and prints {'rank', 'load_peak_mb'}: its resident high-water mark during the load above what it held
before (``/proc/self/clear_refs`` resets the mark). Rank 0 then gathers the version it would publish
(``policy_version_tensors``, publish dtype bfloat16) and prints {'rank': 0, 'publish_peak_mb', 'fp32_mb'}:
the high-water mark during the gather above what it held before, and the model's fp32 size."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from echo2.config import LearnerConfig, TrainConfig  # noqa: E402
from echo2.learner.distributed import init_process_group, make_learner, release_followers, world  # noqa: E402
from echo2.learner.process_group import leave  # noqa: E402


def status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> float:
    """Reset the kernel's resident high-water mark; the resident size now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mb("VmRSS")


def report(line: dict) -> None:
    sys.stdout.write(f"{line!r}\n")
    sys.stdout.flush()


def main(model_dir: Path) -> None:
    config = TrainConfig()
    init_process_group(LearnerConfig(nproc=int(os.environ["WORLD_SIZE"])))
    import transformers  # noqa: F401  (imported before the mark is reset: its import is not the load's)
    from accelerate import init_empty_weights  # noqa: F401

    before = reset_peak()
    learner = make_learner(model_dir, config, temperature=1.0, publish_dtype="bfloat16")
    rank, _ = world()
    report({"rank": rank, "load_peak_mb": status_mb("VmHWM") - before})
    if rank != 0:
        learner.follow()
        return
    fp32_mb = sum(p.numel() for p in learner.model.parameters()) * 4 / 2**20
    before = reset_peak()
    tensors, _ = learner.policy_version_tensors()
    report({"rank": 0, "publish_peak_mb": status_mb("VmHWM") - before, "fp32_mb": fp32_mb,
            "published_mb": sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20})
    release_followers()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave()  # the groups down before exit, as a process of `echo2 learner` (process_group.leave)
