"""A rollout actor for tests/e2e/test_delta_e2e.py: the real ``Actor`` with the real transformers engine,
which also writes down what the engine holds after every swap.

    python tests/support/recording_actor.py --run URL --actor-id ID --parent-pid PID     (the fleet appends these)

After each ``load_weights`` the engine's own parameters are read back, cast to the published
dtype (bf16 -> fp32 -> bf16 is exact) and their tensor table (sha256 per tensor, the learner's
``echo2.data.delta.tensor_table``) appended to ``$ECHO2_TEST_RECORDS/<actor>.jsonl``, so the
test can compare every actor's loaded weights with the learner's published ones, byte for byte.
An observer at the engine boundary, not a replacement: generation is the real engine's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import torch

from echo2.data.delta import tensor_table
from echo2.data.weights import unique_state_dict
from echo2.rollout.actor import run_actor
from echo2.rollout.engines.transformers import TransformersEngine


class RecordingEngine(TransformersEngine):
    def __init__(self, model_dir: Path, *, record: Path, **kw):
        super().__init__(model_dir, **kw)
        self.record = record

    def load_weights(self, tensors) -> None:
        super().load_weights(tensors)
        table = tensor_table(unique_state_dict(self.model, torch.bfloat16))
        with self.record.open("a") as f:
            f.write(json.dumps({name: e["sha256"] for name, e in table.items()}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--actor-id", required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("echo2").setLevel(logging.INFO)
    record = Path(os.environ["ECHO2_TEST_RECORDS"]) / f"{args.actor_id}.jsonl"

    def engine_factory(model_dir: Path, tokenizer):
        eos = tokenizer.eos_token_id
        return RecordingEngine(model_dir, record=record, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id or eos)

    options = json.loads(os.environ.get("ECHO2_STORE_OPTIONS") or "{}")
    torch.set_num_threads(1)
    run_actor(args.run, args.actor_id, options, parent_pid=args.parent_pid, engine_factory=engine_factory)


if __name__ == "__main__":
    main()
