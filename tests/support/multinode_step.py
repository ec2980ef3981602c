"""tests/support/distributed_step.py's fp32 GRPO step (every issue-19 option on) on a learner whose ranks span
torchrun nodes (run by tests/e2e/test_multinode.py as separate torchrun launches with --nnodes N over loopback),
after writing where this process sits (RANK, GROUP_RANK = its node, LOCAL_RANK, WORLD_SIZE) as JSON to
LAYOUT_DIR/rank-<RANK>.json.
Usage: torchrun --nnodes N --node-rank R ... multinode_step.py MODEL_DIR OUT LAYOUT_DIR"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from distributed_step import main  # noqa: E402

if __name__ == "__main__":
    layout = {key: int(os.environ[key]) for key in ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE")}
    (Path(sys.argv[3]) / f"rank-{layout['RANK']}.json").write_text(json.dumps(layout))
    main(Path(sys.argv[1]), Path(sys.argv[2]), ["fp32"])
