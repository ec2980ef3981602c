"""Learner checkpoints: ``checkpoints/step-N/`` = loadable weights + optimizer + trainer state.

The folder is a weights folder (``echo2.data.weights``) whose manifest also covers
``optimizer.pt`` (AdamW moments and RNG states) and ``trainer_state.json`` (step, the settled
rollout keys, evaluation so far, metrics history). The manifest is written last, so a learner
killed mid-checkpoint leaves no checkpoint, never a half one. ``optimizer.pt`` is loaded with
``torch.load(weights_only=True)``: nothing read from the store is unpickled with code execution.

Signed. The manifest is signed with the run's key, as a policy version's is (``manifest.sign``),
and for its own step (``"step": N``, checked against the folder's name), so a checkpoint is loaded
only if this run's learner wrote it, and every file is then checked against the signed hashes.
Anyone else with write access to the store (an actor whose scoped credentials are wider than
``infra/iam/actor-policy.json`` allows; the learner does not rely on that policy) can plant
``checkpoints/step-999999/``, and it must neither be loaded nor stop the run. So a folder that
fails (unsigned, signed by another key, a signed manifest copied from another step, a file that
does not match its hash, a file gone):

    resume (``newest_checkpoint``) logs it in one line and goes on to the next older folder, down
               to the newest one that verifies (refusing to resume at all would let whoever can
               plant a folder stop every resume); the resume then moves the planted folders
               above it to ``orphaned/`` with the rest of the lost timeline
    pruning    counts only folders that verify (``verified_steps``): a planted folder never takes
               the place of one of the ``keep`` newest real checkpoints
    saving     a planted folder at the step being saved is moved to ``orphaned/`` first (it would
               make the write fail with AlreadyExists and end the run)

A planted object the store refuses to return or copy to anyone (S3's GLACIER storage class: HEAD
answers, GET and CopyObject are refused; ``store.is_unreadable_object``) fails verification like an
unsigned one, and since it cannot be moved aside it is deleted, logged in one line
(``run_folder.set_aside``; its docstring says why nothing of the run is lost). A refusal of the
learner's own credentials (``AccessDenied``) is not such an object: it propagates.
    export     ``echo2 export --step N`` of such a folder prints one line and exits 2
"""

from __future__ import annotations

import io
import json
import logging
import random
import time
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from echo2.data import layout
from echo2.data.manifest import ManifestRejected
from echo2.data.run_folder import set_aside
from echo2.data.store import NotFound, ObjectStore, is_unreadable_object
from echo2.data.weights import (CorruptWeights, committed_folders, delete_folder, iter_tensors, read_manifest,
                                read_verified, write_weights)

log = logging.getLogger("echo2.learner")

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
ADAPTER_FILE = "adapter.safetensors"
MAX_MANIFEST_BYTES = 64 * 2**20
"""A checkpoint manifest larger than this is not read (one of a 70B model in fp32 is under 1 MB)."""
UNLOADABLE = (ManifestRejected, CorruptWeights, NotFound)
"""What a checkpoint folder this run's learner did not write, or one damaged since, raises when loaded."""


@dataclass
class Checkpoint:
    step: int
    state: dict
    tensors: dict[str, torch.Tensor]
    optimizer: dict
    adapter: dict[str, torch.Tensor] | None


def save_checkpoint(store: ObjectStore, step: int, tensors: dict[str, torch.Tensor], optimizer: dict, state: dict, *,
                    key: Ed25519PrivateKey, shard_mb: int, extra_files: dict[str, bytes],
                    adapter: dict[str, torch.Tensor] | None = None) -> None:
    """``tensors``: full weights under HF names (so the folder loads with from_pretrained);
    ``optimizer``: the optimizer's state dict; ``adapter``: the LoRA adapter being trained, which
    resume restores on top of the base; ``key``: the run's key, which signs the manifest."""
    prefix = layout.checkpoint_dir(step)
    if step in checkpoint_steps(store) and not verified_steps(store, key.public_key(), [step]):
        _set_aside(store, prefix)
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer, "torch_rng": torch.get_rng_state(),
                "py_rng": random.getstate()}, buf)
    files = dict(extra_files)
    files[OPTIMIZER_FILE] = buf.getvalue()
    files[STATE_FILE] = json.dumps({"step": step, **state}, indent=1).encode()
    if adapter is not None:
        files[ADAPTER_FILE] = st_save(adapter, metadata={"format": "pt"})
    write_weights(store, prefix, tensors, extra_files=files, shard_mb=shard_mb, meta={"step": step}, key=key)


def checkpoint_steps(store: ObjectStore) -> list[int]:
    """Steps of every committed checkpoint folder, ascending, whoever wrote it (see ``verified_steps``)."""
    return committed_folders(store, layout.CHECKPOINTS, layout.parse_step_dir)


def signed_manifest(store: ObjectStore, step: int, public_key: Ed25519PublicKey) -> dict:
    """The manifest of checkpoint ``step`` if the run's key signed it for this step; ManifestRejected otherwise."""
    prefix = layout.checkpoint_dir(step)
    size = store.size(layout.manifest_key(prefix))
    if size > MAX_MANIFEST_BYTES:
        raise ManifestRejected(f"manifest of {prefix} is {size} bytes, more than a checkpoint's ({MAX_MANIFEST_BYTES})")
    try:
        return read_manifest(store, prefix, public_key)
    except Exception as exc:
        if not is_unreadable_object(exc):
            raise
        raise ManifestRejected(f"the store will not return the manifest of {prefix} ({exc})") from None


def verified_steps(store: ObjectStore, public_key: Ed25519PublicKey, steps: list[int] | None = None) -> list[int]:
    """The committed checkpoints (of ``steps`` only, if given) whose manifest the run's key signed; each
    other one is logged in one line. Manifests only: the files are checked when loaded."""
    out = []
    for step in [s for s in checkpoint_steps(store) if steps is None or s in steps]:
        try:
            signed_manifest(store, step, public_key)
        except UNLOADABLE as exc:
            log.error("checkpoint step %d is not this run's and is ignored: %s", step, exc)
            continue
        out.append(step)
    return out


def load_checkpoint(store: ObjectStore, step: int, public_key: Ed25519PublicKey) -> Checkpoint:
    """Checkpoint ``step``, its manifest signed by the run's key and every file checked against it
    (ManifestRejected, CorruptWeights, NotFound otherwise: ``UNLOADABLE``)."""
    prefix = layout.checkpoint_dir(step)
    manifest = signed_manifest(store, step, public_key)
    entries = {e["name"]: e for e in manifest["files"]}
    try:
        state = json.loads(read_verified(store, prefix, entries[STATE_FILE]))
        # weights_only: tensors and plain containers only; nothing read from the store may run code
        opt = torch.load(io.BytesIO(read_verified(store, prefix, entries[OPTIMIZER_FILE])), weights_only=True)
        adapter = st_load(read_verified(store, prefix, entries[ADAPTER_FILE])) if ADAPTER_FILE in entries else None
        tensors = {} if adapter is not None else dict(iter_tensors(store, prefix, manifest))
    except Exception as exc:
        if not is_unreadable_object(exc):  # a file replaced since by one the store will not return
            raise
        raise CorruptWeights(f"the store will not return a file of {prefix} ({exc})") from None
    return Checkpoint(step=step, state=state, tensors=tensors, optimizer=opt, adapter=adapter)


def newest_checkpoint(store: ObjectStore, public_key: Ed25519PublicKey) -> Checkpoint | None:
    """The newest checkpoint that loads and verifies (None if there is none); each newer folder that does
    not is logged in one line and skipped, never loaded (see the module's docstring)."""
    for step in reversed(checkpoint_steps(store)):
        try:
            return load_checkpoint(store, step, public_key)
        except UNLOADABLE as exc:
            log.error("checkpoint step %d is not loaded (resuming from an older one): %s", step, exc)
    return None


def prune_checkpoints(store: ObjectStore, keep: int, public_key: Ed25519PublicKey) -> None:
    """Delete all but the ``keep`` newest checkpoints the run's key signed; leave any other folder alone."""
    for step in verified_steps(store, public_key)[:-keep]:
        delete_folder(store, layout.checkpoint_dir(step))


def _set_aside(store: ObjectStore, prefix: str) -> None:
    """Move a folder this run did not write to ``orphaned/<time>/`` (manifest first: it never looks committed
    half moved), keeping it for inspection; an object the store will not copy is deleted (``set_aside``)."""
    dest = layout.orphaned_prefix(f"{time.time():.0f}")
    keys = sorted(store.list(prefix + "/"), key=lambda k: (not k.endswith("/" + layout.MANIFEST), k))
    log.error("%s was not written by this run's learner: moved to %s before the checkpoint of its step", prefix, dest)
    for key in keys:
        set_aside(store, key, dest, f"it was in {prefix}, the checkpoint being saved")
