"""Learner checkpoints: ``checkpoints/step-N/`` = loadable weights + optimizer + trainer state.

The folder is a weights folder (``echo2.data.weights``) whose manifest also covers
``optimizer.pt`` (AdamW moments and RNG states) and ``trainer_state.json`` (step, the settled
rollout keys, evaluation so far, metrics history). The manifest is written last, so a learner
killed mid-checkpoint leaves no checkpoint, never a half one. ``optimizer.pt`` is loaded with
``torch.load(weights_only=True)``: nothing read from the store is unpickled with code execution.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from echo2.data import layout
from echo2.data.store import ObjectStore
from echo2.data.weights import (committed_folders, delete_folder, iter_tensors, read_manifest, read_verified,
                                write_weights)

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
ADAPTER_FILE = "adapter.safetensors"


@dataclass
class Checkpoint:
    step: int
    state: dict
    tensors: dict[str, torch.Tensor]
    optimizer: dict
    adapter: dict[str, torch.Tensor] | None


def save_checkpoint(store: ObjectStore, step: int, tensors: dict[str, torch.Tensor], optimizer: dict, state: dict, *,
                    shard_mb: int, extra_files: dict[str, bytes], adapter: dict[str, torch.Tensor] | None = None) -> None:
    """``tensors``: full weights under HF names (so the folder loads with from_pretrained);
    ``optimizer``: the optimizer's state dict; ``adapter``: the LoRA adapter being trained, which
    resume restores on top of the base."""
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer, "torch_rng": torch.get_rng_state(),
                "py_rng": random.getstate()}, buf)
    files = dict(extra_files)
    files[OPTIMIZER_FILE] = buf.getvalue()
    files[STATE_FILE] = json.dumps({"step": step, **state}, indent=1).encode()
    if adapter is not None:
        files[ADAPTER_FILE] = st_save(adapter, metadata={"format": "pt"})
    write_weights(store, layout.checkpoint_dir(step), tensors, extra_files=files, shard_mb=shard_mb,
                  meta={"step": step})


def checkpoint_steps(store: ObjectStore) -> list[int]:
    return committed_folders(store, layout.CHECKPOINTS, layout.parse_step_dir)


def load_checkpoint(store: ObjectStore, step: int) -> Checkpoint:
    prefix = layout.checkpoint_dir(step)
    manifest = read_manifest(store, prefix)
    entries = {e["name"]: e for e in manifest["files"]}
    state = json.loads(read_verified(store, prefix, entries[STATE_FILE]))
    # weights_only: tensors and plain containers only; nothing read from the store may run code
    opt = torch.load(io.BytesIO(read_verified(store, prefix, entries[OPTIMIZER_FILE])), weights_only=True)
    adapter = st_load(read_verified(store, prefix, entries[ADAPTER_FILE])) if ADAPTER_FILE in entries else None
    tensors = {} if adapter is not None else dict(iter_tensors(store, prefix, manifest))
    return Checkpoint(step=step, state=state, tensors=tensors, optimizer=opt, adapter=adapter)


def prune_checkpoints(store: ObjectStore, keep: int) -> None:
    for step in checkpoint_steps(store)[:-keep]:
        delete_folder(store, layout.checkpoint_dir(step))
