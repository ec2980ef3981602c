"""Learner checkpoints: ``checkpoints/step-N/`` = loadable weights + optimizer + trainer state.

The folder is a weights folder (``echo2.data.weights``) whose manifest also covers
``optimizer.pt`` (AdamW moments and RNG states) and ``trainer_state.json`` (step, the settled
rollout keys, evaluation so far, metrics history). The manifest is written last, so a learner
killed mid-checkpoint leaves no checkpoint, never a half one.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass

import torch

from echo2.data import layout
from echo2.data.store import ObjectStore
from echo2.data.weights import iter_tensors, read_manifest, read_verified, unique_state_dict, write_weights

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


@dataclass
class Checkpoint:
    step: int
    state: dict
    tensors: dict[str, torch.Tensor]
    optimizer: dict


def save_checkpoint(store: ObjectStore, step: int, model, optimizer, state: dict, *, shard_mb: int,
                    extra_files: dict[str, bytes]) -> None:
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                "py_rng": random.getstate()}, buf)
    files = dict(extra_files)
    files[OPTIMIZER_FILE] = buf.getvalue()
    files[STATE_FILE] = json.dumps({"step": step, **state}, indent=1).encode()
    write_weights(store, layout.checkpoint_dir(step), unique_state_dict(model), extra_files=files,
                  shard_mb=shard_mb, meta={"step": step})


def checkpoint_steps(store: ObjectStore) -> list[int]:
    steps = []
    for key in store.list("checkpoints/"):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == layout.MANIFEST:
            s = layout.parse_step_dir(parts[1])
            if s is not None:
                steps.append(s)
    return sorted(steps)


def load_checkpoint(store: ObjectStore, step: int) -> Checkpoint:
    prefix = layout.checkpoint_dir(step)
    manifest = read_manifest(store, prefix)
    entries = {e["name"]: e for e in manifest["files"]}
    state = json.loads(read_verified(store, prefix, entries[STATE_FILE]))
    opt = torch.load(io.BytesIO(read_verified(store, prefix, entries[OPTIMIZER_FILE])), weights_only=False)
    tensors = dict(iter_tensors(store, prefix, manifest))
    return Checkpoint(step=step, state=state, tensors=tensors, optimizer=opt)


def prune_checkpoints(store: ObjectStore, keep: int) -> None:
    for step in checkpoint_steps(store)[:-keep]:
        prefix = layout.checkpoint_dir(step)
        store.delete(f"{prefix}/{layout.MANIFEST}")
        store.delete_prefix(prefix + "/")
