"""Policy versions and checkpoints as safetensors shards plus a manifest written last.

A weights folder (``policy/v000042/`` or ``checkpoints/step-000040/``) holds
``shard-0000.safetensors``..., ``model.safetensors.index.json``, the model's ``config.json`` and
tokenizer files, and ``manifest.json`` with the size and sha256 of every file. The manifest is
the commit point: a folder without one does not exist for readers, and every byte read back is
checked against it, so a corrupted or truncated shard is never loaded. Every manifest read is
checked to name only plain files of its own folder (``manifest.check_manifest``) before any of
its names becomes a store key or a path.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from echo2.data import layout
from echo2.data.failpoints import failpoint
from echo2.data.manifest import ManifestRejected, check_file_name, check_manifest, chunk_hashes, sign, verify_signature
from echo2.data.store import AlreadyExists, NotFound, ObjectStore

INDEX_FILE = "model.safetensors.index.json"
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


DEFAULT_CHUNK_SIZE = 8 * 2**20


class CorruptWeights(Exception):
    """A weights file does not match its manifest."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def model_files(model_dir: Path) -> dict[str, bytes]:
    """The non-weight files that make a weights folder loadable by ``from_pretrained``."""
    return {name: (model_dir / name).read_bytes() for name in MODEL_FILES if (model_dir / name).exists()}


def unique_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """State dict without tied duplicates (safetensors refuses shared storage); cast to ``dtype``."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous()
    return out


def _shard(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def write_weights(
    store: ObjectStore,
    prefix: str,
    tensors: dict[str, torch.Tensor],
    *,
    extra_files: dict[str, bytes],
    shard_mb: int,
    meta: dict,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    key: Ed25519PrivateKey | None = None,
) -> dict:
    """Write shards, index and ``extra_files`` under ``prefix``, then the manifest. Returns the manifest.

    Every file is also described chunk by chunk (sha256 per ``chunk_size`` bytes) for the relay;
    with ``key`` (the learner's Ed25519 key) the manifest is signed so actors can reject forgeries.
    Names of ``extra_files`` must be plain file names (``manifest.FILE_NAME``), checked before
    anything is written: readers refuse a manifest naming anything else.

    The manifest is the commit point, created once; a committed folder raises ``AlreadyExists``.
    Until then the folder is nobody's: what a killed writer left there is cleared first and the
    files are written with overwrite, so a retried put (its response lost) or a second attempt
    after a crash never fails on its own leftovers.
    """
    shards = _shard(tensors, shard_mb * 2**20)
    weight_map = {k: shard_name(i) for i, shard in enumerate(shards) for k in shard}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
    files = [(shard_name(i), "shard", lambda shard=shard: st_save(shard, metadata={"format": "pt"}))
             for i, shard in enumerate(shards)]
    files += [(name, "aux", data) for name, data in {INDEX_FILE: index, **extra_files}.items()]
    return write_folder(store, prefix, files, meta=meta, chunk_size=chunk_size, key=key)


def shard_name(index: int) -> str:
    return f"shard-{index:04d}.safetensors"


def write_folder(store: ObjectStore, prefix: str, files: list[tuple[str, str, bytes | Callable[[], bytes]]], *,
                 meta: dict, chunk_size: int = DEFAULT_CHUNK_SIZE, key: Ed25519PrivateKey | None = None) -> dict:
    """Commit ``files`` ((name, kind, bytes or a function making them, one at a time)) under ``prefix``:
    the protocol of ``write_weights`` for any set of files (a sparse delta version's shards)."""
    if store.exists(layout.manifest_key(prefix)):
        raise AlreadyExists(layout.manifest_key(prefix))
    for name, _, _ in files:
        check_file_name(name)
    store.delete_prefix(prefix + "/")
    failkind = "checkpoint" if prefix.startswith(layout.CHECKPOINTS) else "publish"
    entries = []
    for name, kind, data in files:
        data = data() if callable(data) else data
        store.put(f"{prefix}/{name}", data, if_absent=False)
        failpoint(failkind)
        entries.append({"name": name, "kind": kind, "size": len(data), "sha256": sha256(data),
                        "chunks": chunk_hashes(data, chunk_size)})
    manifest = {"format": "echo2-weights/1", "created_at": time.time(), "chunk_size": chunk_size, "files": entries,
                **meta}
    if key is not None:
        manifest = sign(manifest, key)
    store.put_json(layout.manifest_key(prefix), manifest)
    return manifest


def read_manifest(store: ObjectStore, prefix: str, public_key: Ed25519PublicKey | None = None) -> dict:
    """The manifest of the folder ``prefix``, its file names checked (ManifestRejected). With ``public_key``
    (the run's) also its signature, and that it was signed for this folder: a signed manifest copied into
    another folder (``checkpoints/step-999999/``, ``policy/v999999/``) names another number and is refused."""
    try:
        manifest = store.get_json(layout.manifest_key(prefix))
    except ValueError:  # not JSON (NotFound is a KeyError, not this)
        raise ManifestRejected(f"manifest of {prefix} is not JSON") from None
    check_manifest(manifest, f"manifest of {prefix}")
    if public_key is None:
        return manifest
    try:
        verify_signature(manifest, public_key)
    except ManifestRejected:
        raise ManifestRejected(f"{prefix} is not signed with the run's key (unsigned, altered or signed with "
                               "another key): not written by this run's learner") from None
    folder = prefix.rstrip("/").rsplit("/", 1)[-1]
    for field, number in (("version", layout.parse_version_dir(folder)), ("step", layout.parse_step_dir(folder))):
        if number is not None and manifest.get(field) != number:
            raise ManifestRejected(f"{prefix} holds the signed manifest of {field} {manifest.get(field)!r:.20}, "
                                   "copied from another folder")
    return manifest


def read_verified(store: ObjectStore, prefix: str, entry: dict) -> bytes:
    data = store.get(f"{prefix}/{entry['name']}")
    if len(data) != entry["size"] or sha256(data) != entry["sha256"]:
        raise CorruptWeights(f"{prefix}/{entry['name']} does not match its manifest "
                             f"(size {len(data)}, expected {entry['size']})")
    return data


def iter_tensors(store: ObjectStore, prefix: str, manifest: dict) -> Iterable[tuple[str, torch.Tensor]]:
    """Verified tensors of every shard. All shards are checked before the first tensor is yielded."""
    blobs = [read_verified(store, prefix, e) for e in manifest["files"] if e["kind"] == "shard"]
    for blob in blobs:
        yield from st_load(blob).items()


def download(store: ObjectStore, prefix: str, dest: Path, *, kinds: tuple[str, ...] = ("shard", "aux"),
             public_key: Ed25519PublicKey | None = None) -> dict:
    """Copy a committed weights folder to ``dest`` (verified; its signature too with ``public_key``). Returns its
    manifest."""
    try:
        manifest = read_manifest(store, prefix, public_key)
    except NotFound:
        raise NotFound(f"{store.url}/{prefix} has no manifest: not a committed weights folder") from None
    dest.mkdir(parents=True, exist_ok=True)
    for entry in manifest["files"]:
        if entry["kind"] in kinds:
            (dest / entry["name"]).write_bytes(read_verified(store, prefix, entry))
    return manifest


def publish_version(
    store: ObjectStore, version: int, tensors: dict[str, torch.Tensor], *, extra_files: dict[str, bytes],
    shard_mb: int, chunk_size: int = DEFAULT_CHUNK_SIZE, key: Ed25519PrivateKey | None = None,
    meta: dict | None = None,
) -> dict:
    """Commit policy version ``version`` (signed with ``key``) and point ``policy/LATEST`` at it."""
    manifest = write_weights(
        store, layout.policy_dir(version), tensors, extra_files=extra_files, shard_mb=shard_mb,
        meta={"version": version, **(meta or {})}, chunk_size=chunk_size, key=key,
    )
    _move_latest(store, version)
    return manifest


def publish_delta_version(store: ObjectStore, version: int, shards: list[bytes], *, meta: dict,
                          chunk_size: int = DEFAULT_CHUNK_SIZE, key: Ed25519PrivateKey | None = None) -> dict:
    """Commit ``version`` as sparse delta shards (``echo2.data.delta``, kind ``delta``) and move LATEST.

    No model files travel with a delta: they are the keyframe's, which every chain starts from."""
    files = [(shard_name(i), "delta", data) for i, data in enumerate(shards)]
    manifest = write_folder(store, layout.policy_dir(version), files, meta={"version": version, **meta},
                            chunk_size=chunk_size, key=key)
    _move_latest(store, version)
    return manifest


def _move_latest(store: ObjectStore, version: int) -> None:
    failpoint("publish")
    store.put_pointer(layout.LATEST, json.dumps({"version": version}).encode())


def latest_version(store: ObjectStore) -> int | None:
    try:
        return int(store.get_json(layout.LATEST)["version"])
    except NotFound:
        return None


def delete_folder(store: ObjectStore, prefix: str) -> None:
    """Remove a committed weights folder: the manifest first, so a half-deleted folder never looks committed."""
    store.delete(layout.manifest_key(prefix))
    store.delete_prefix(prefix + "/")


def committed_folders(store: ObjectStore, prefix: str, parse) -> list[int]:
    """Numbers of the folders under ``prefix`` (``v000042``, ``step-000040``) that have a manifest, ascending."""
    out = []
    for key in store.list(prefix):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == layout.MANIFEST and (n := parse(parts[1])) is not None:
            out.append(n)
    return sorted(out)


def published_versions(store: ObjectStore) -> list[int]:
    return committed_folders(store, layout.POLICY, layout.parse_version_dir)


def save_as_indexed(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` into ``folder`` as the shards its ``model.safetensors.index.json`` names
    (a rebuilt delta version, into a folder holding its keyframe's model files)."""
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    if set(weight_map) != set(tensors):
        raise CorruptWeights(f"{folder / INDEX_FILE} does not name the rebuilt version's tensors")
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        shards.setdefault(check_file_name(weight_map[name]), {})[name] = t
    for shard, group in shards.items():
        (folder / shard).write_bytes(st_save(group, metadata={"format": "pt"}))


def merge_into_folder(folder: Path, adapter: dict[str, torch.Tensor], *, rank: int, alpha: float) -> None:
    """Fold a LoRA adapter into the shards of a downloaded base folder, shard by shard."""
    from echo2.data.lora import merge_lora

    merged_modules = 0
    for shard in sorted(folder.glob("shard-*.safetensors")):
        base = st_load(shard.read_bytes())
        merged, n = merge_lora(base, adapter, rank=rank, alpha=alpha, strict=False)
        merged_modules += n
        shard.write_bytes(st_save(merged, metadata={"format": "pt"}))
    expected = sum(k.endswith(".lora_A.weight") for k in adapter)
    if merged_modules != expected:
        raise CorruptWeights(f"adapter has {expected} modules but only {merged_modules} match the base")
