"""Learner checkpoints: ``checkpoints/step-N/`` = every rank's shard of the weights and AdamW state + trainer state.

A checkpoint folder holds ``torch.distributed.checkpoint`` (DCP) files (``checkpoint_files.py``): each rank of the
learner writes its own shard of the trainable weights and of the optimizer state straight to the store
(``dcp-R_I.distcp``, rank R's I-th file), and rank 0's DCP finish step writes ``dcp-metadata``, which maps
every tensor's pieces to files. No rank gathers the weights or the optimizer state for a checkpoint. Rank 0
then adds ``trainer_state.json`` (step, the settled rollout keys, evaluation so far, metrics history),
``rng.pt`` (rank 0's torch and Python RNG states: the other ranks draw no random numbers) and the model's
config and tokenizer files, and writes the manifest last: it names every file of every rank with its size
and sha256, so a learner killed mid-checkpoint leaves no checkpoint, never a half one. With LoRA (one
process) the weights are the adapter's and the base is policy version 0 (``"weights": "lora"``).

Resume on any rank count: the weights and the optimizer state are keyed by parameter name, and DCP
reshards, so a checkpoint of N ranks resumes on M ranks, one process included (the one-process learner
writes the same format without a process group).

Reading. Every file a rank reads is checked against the signed manifest before DCP sees a byte of it
(``checkpoint_files.VerifiedReader``); a folder that holds a file its manifest does not name is refused as well.
``rng.pt`` is loaded with ``torch.load(weights_only=True)``, DCP's non-tensor values too, and DCP's pickled
``dcp-metadata`` by an unpickler that builds DCP's metadata classes only: nothing read from the store runs code.

Format. A checkpoint of the format before sharded checkpoints (one weights folder with ``optimizer.pt``)
is refused by resume with one line (``ManifestRejected``: resume goes to an older one or starts over), while
``echo2 export`` and ``echo2 eval`` still read its weights (``export_checkpoint``, which puts a sharded
one's weights together in one process).

Signed. The manifest is signed with the run's key, as a policy version's is (``manifest.sign``),
and for its own step (``"step": N``, checked against the folder's name), so a checkpoint is loaded
only if this run's learner wrote it, and every file is then checked against the signed hashes.
Anyone else with write access to the store (an actor whose scoped credentials are wider than
``infra/iam/actor-policy.json`` allows; the learner does not rely on that policy) can plant
``checkpoints/step-999999/``, and it must neither be loaded nor stop the run. So a folder that
fails (unsigned, signed by another key, a signed manifest copied from another step, a file that
does not match its hash, a file gone, a file added):

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
from pathlib import Path
from typing import Callable

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from echo2.data import layout
from echo2.data.failpoints import failpoint
from echo2.data.manifest import ManifestRejected, check_file_name, sign
from echo2.data.run_folder import set_aside
from echo2.data.store import AlreadyExists, NotFound, ObjectStore, is_unreadable_object
from echo2.data.weights import (
    INDEX_FILE,
    CorruptWeights,
    _shard,
    committed_folders,
    delete_folder,
    download,
    merge_into_folder,
    read_manifest,
    read_verified,
    save_as_indexed,
    sha256,
    shard_name,
)
from echo2.learner.checkpoint_files import METADATA, load_full, store_name

log = logging.getLogger("echo2.learner")

FORMAT = "echo2-checkpoint/2"
"""The manifest's ``format`` of a sharded checkpoint (a policy version's, and an old checkpoint's, is
``echo2-weights/1``)."""
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng.pt"
OLD_OPTIMIZER_FILE = "optimizer.pt"
"""The optimizer of a checkpoint of the format before sharded checkpoints (never read any more)."""
EXPORT_SHARD_MB = 2048
"""Size of the safetensors shards ``export_checkpoint`` writes."""
MAX_MANIFEST_BYTES = 64 * 2**20
"""A checkpoint manifest larger than this is not read (one of a 70B model in fp32 is under 1 MB)."""
UNLOADABLE = (ManifestRejected, CorruptWeights, NotFound)
"""What a checkpoint folder this run's learner did not write, or one damaged since, raises when loaded."""

WriteShards = Callable[[ObjectStore, str], list[dict]]
"""Writes every rank's shards under a folder (``Learner.save_sharded``); returns the manifest entries of all of them."""


@dataclass
class Checkpoint:
    step: int
    prefix: str
    manifest: dict
    state: dict
    """``trainer_state.json``."""
    rng: dict
    """``torch_rng`` and ``py_rng`` of rank 0."""

    @property
    def entries(self) -> dict[str, dict]:
        """The signed manifest's file entries by name (what every file read is checked against)."""
        return {e["name"]: e for e in self.manifest["files"]}


def save_checkpoint(store: ObjectStore, step: int, write_shards: WriteShards, state: dict, *,
                    key: Ed25519PrivateKey, extra_files: dict[str, bytes], meta: dict | None = None) -> dict:
    """Commit checkpoint ``step``: ``write_shards`` has every rank write its shards (``Learner.save_sharded``),
    then rank 0 (the caller) writes the trainer state ``state``, its RNG states and ``extra_files`` (the model's
    config and tokenizer), and the manifest last, signed with ``key`` (the run's). ``meta``: what the weights
    are (``{"weights": "full"}``, or LoRA's adapter over policy version 0). Returns the manifest."""
    prefix = layout.checkpoint_dir(step)
    if step in checkpoint_steps(store) and not verified_steps(store, key.public_key(), [step]):
        _set_aside(store, prefix)
    if store.exists(layout.manifest_key(prefix)):
        raise AlreadyExists(layout.manifest_key(prefix))
    for name in extra_files:
        check_file_name(name)
    store.delete_prefix(prefix + "/")  # what a learner killed while writing this folder left there
    entries = list(write_shards(store, prefix))
    failpoint("checkpoint")
    rng = io.BytesIO()
    torch.save({"torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}, rng)
    files = {**extra_files, STATE_FILE: json.dumps({"step": step, **state}, indent=1).encode(),
             RNG_FILE: rng.getvalue()}
    for name, data in files.items():
        store.put(f"{prefix}/{name}", data, if_absent=False)
        failpoint("checkpoint")
        entries.append({"name": name, "kind": "aux", "size": len(data), "sha256": sha256(data)})
    manifest = sign({"format": FORMAT, "created_at": time.time(), "files": entries, "step": step,
                     **(meta or {"weights": "full"})}, key)
    store.put_json(layout.manifest_key(prefix), manifest)
    return manifest


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


def load_checkpoint(store: ObjectStore, step: int, public_key: Ed25519PublicKey,
                    restore: Callable[[Checkpoint], None] | None = None) -> Checkpoint:
    """Checkpoint ``step``: its manifest signed by the run's key for this step, in this format, naming every
    file the folder holds, its trainer state and RNG states verified and read; then ``restore`` (every rank
    loads its shards: ``Learner.load_sharded``), which checks each file it reads. ManifestRejected,
    CorruptWeights or NotFound (``UNLOADABLE``) otherwise, before ``restore`` changed any weight."""
    prefix = layout.checkpoint_dir(step)
    manifest = signed_manifest(store, step, public_key)
    if manifest.get("format") != FORMAT:
        raise ManifestRejected(f"{prefix} is a checkpoint of the format before sharded checkpoints "
                               f"({manifest.get('format')!r:.40}, with {OLD_OPTIMIZER_FILE}): this echo2 does not "
                               "resume from it (`echo2 export --step N` still exports its weights)")
    entries = {e["name"]: e for e in manifest["files"]}
    named = {f"{prefix}/{name}" for name in entries} | {layout.manifest_key(prefix)}
    added = sorted(set(store.list(prefix + "/")) - named)
    if added:
        raise CorruptWeights(f"{prefix} holds {len(added)} file(s) its manifest does not name ({added[0]}, ...)")
    try:
        state = json.loads(read_verified(store, prefix, entries[STATE_FILE]))
        # weights_only: tensors and plain containers only; nothing read from the store may run code
        rng = torch.load(io.BytesIO(read_verified(store, prefix, entries[RNG_FILE])), weights_only=True)
    except KeyError as exc:
        raise CorruptWeights(f"{prefix}'s manifest names no {exc}") from None
    except Exception as exc:
        if not is_unreadable_object(exc):  # a file replaced since by one the store will not return
            raise
        raise CorruptWeights(f"the store will not return a file of {prefix} ({exc})") from None
    ckpt = Checkpoint(step=step, prefix=prefix, manifest=manifest, state=state, rng=rng)
    if restore is not None:
        restore(ckpt)
    return ckpt


def newest_checkpoint(store: ObjectStore, public_key: Ed25519PublicKey,
                      restore: Callable[[Checkpoint], None] | None = None) -> Checkpoint | None:
    """The newest checkpoint that verifies and loads (``load_checkpoint``, through ``restore``; None if there
    is none); each newer folder that does not is logged in one line and skipped, never loaded."""
    for step in reversed(checkpoint_steps(store)):
        try:
            return load_checkpoint(store, step, public_key, restore)
        except UNLOADABLE as exc:
            log.error("checkpoint step %d is not loaded (resuming from an older one): %s", step, exc)
    return None


def checkpoint_weights(store: ObjectStore, ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The trainable weights of a checkpoint, whole, in this process (no process group; every file read is
    verified): the model under Hugging Face names, or with LoRA the adapter under PEFT's module names."""
    return load_full(store, ckpt.prefix, ckpt.entries, {"model"})["model"]


def export_checkpoint(store: ObjectStore, step: int, dest: Path, public_key: Ed25519PublicKey) -> dict:
    """``echo2 export --step N`` and ``echo2 eval`` of checkpoint ``step``: a ``from_pretrained`` folder at
    ``dest`` (safetensors shards, their index, the model's config and tokenizer files) of its weights, put
    together from every rank's DCP shards in this process; a LoRA checkpoint's adapter is merged into its base
    (policy version 0). A checkpoint of the old format is a weights folder: its files are copied. Every file
    is verified against the manifest the run's key signed (UNLOADABLE otherwise). Returns the manifest."""
    prefix = layout.checkpoint_dir(step)
    manifest = signed_manifest(store, step, public_key)
    if manifest.get("format") != FORMAT:
        download(store, prefix, dest, public_key=public_key)
    else:
        tensors = checkpoint_weights(store, load_checkpoint(store, step, public_key))
        download(store, prefix, dest, kinds=("aux",), public_key=public_key)
        if manifest.get("weights") == "lora":  # PEFT's parameter names carry the adapter's name; its state dict not
            download(store, layout.policy_dir(manifest["base_version"]), dest, public_key=public_key)
            adapter = {k.replace(".default.", "."): v for k, v in tensors.items()}
            merge_into_folder(dest, adapter, rank=manifest["lora_rank"], alpha=manifest["lora_alpha"])
        else:
            shards = _shard(tensors, EXPORT_SHARD_MB * 2**20)
            weight_map = {name: shard_name(i) for i, shard in enumerate(shards) for name in shard}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (dest / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
            save_as_indexed(dest, tensors)
    for name in (OLD_OPTIMIZER_FILE, "adapter.safetensors", STATE_FILE, RNG_FILE, store_name(METADATA)):
        (dest / name).unlink(missing_ok=True)  # learner state, not the model
    return manifest


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
