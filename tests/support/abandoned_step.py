"""Rank 0 of a 2-process torchrun learner hears a notice that abandons the step in the middle of its packs
(run by tests/e2e/test_distributed_notice.py): a SIGTERM sent to rank 0 right after its first pack's backward, whose
handler (a notice the step cannot finish within) raises. Rank 0 prints one line: whether the step was abandoned,
whether every weight is still what it was before the step, the version, and whether a whole step then ran on both
ranks (the follower back in ``follow()``, in step with rank 0).
Usage: torchrun --nproc-per-node 2 abandoned_step.py MODEL_DIR"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from distributed_step import report, tables  # noqa: E402

from echo2.config import LearnerConfig, TrainConfig  # noqa: E402
from echo2.learner.distributed import init_process_group, make_learner, world  # noqa: E402
from echo2.learner.notice import NoticeInterrupt  # noqa: E402
from echo2.learner.process_group import leave  # noqa: E402


def main(model_dir: Path) -> None:
    config = TrainConfig(lr=1e-3, micro_batch_tokens=48)
    init_process_group(LearnerConfig(nproc=2))
    torch.manual_seed(0)
    learner = make_learner(model_dir, config, temperature=1.0)
    if world()[0] != 0:
        learner.follow()
        return
    heard = []

    def notice(signum, frame):  # a notice the step cannot finish within: abandon it
        heard.append(signum)
        raise NoticeInterrupt("a notice too short for the step")

    signal.signal(signal.SIGTERM, notice)
    before = learner.full_tensors()
    backward, packs = learner._backward, []

    def backward_then_notice(*args, **kwargs):
        backward(*args, **kwargs)
        packs.append(1)
        if len(packs) == 1:
            signal.raise_signal(signal.SIGTERM)

    learner._backward = backward_then_notice
    abandoned = False
    try:
        learner.train_step(tables())
    except NoticeInterrupt:
        abandoned = True
    after = learner.full_tensors()
    version = learner.version
    learner._backward = backward
    learner.train_step(tables())  # a whole step: the follower left the abandoned one at the same point
    moved = any(not torch.equal(after[k], v) for k, v in learner.full_tensors().items())
    learner.release()
    report({"abandoned": abandoned, "heard": len(heard), "version": version, "moved_after": moved,
            "unchanged": all(torch.equal(before[k], after[k]) for k in before)})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave()  # the groups down before exit, as a process of `echo2 learner` (process_group.leave)
