"""Delta chains: a sparse delta version applies to its base version, and so on back to a keyframe.

What a version's (signed) manifest says about itself:

    "weights": "full"                                      a full version (no chain: LoRA runs, full runs)
    "weights": "full", "keyframe": v, "tensors": {...}     a keyframe of a delta run: full shards plus the
                                                           tensor table (dtype, shape, sha256 per tensor)
    "weights": "delta", "base_version": b, "keyframe": k,  sparse delta shards against version b (the
    "tensors": {...}                                       previous one published), whose chain starts at
                                                           keyframe k; the table adds the changed counts

The chain of version v is [k, ..., b, v]: the keyframe, then every delta after it, each applying
to the one before. ``rebuild`` reconstructs a version from its chain and checks every step
against its signed table (``echo2.data.delta.apply_delta``). Garbage collection keeps the whole
chain of every version it keeps (``chain_closure``). The manifests come from a callable, so the
same walk serves the learner (its store), ``echo2 export`` and actors (signature-checked
manifests through their receiver).
"""

from __future__ import annotations

from typing import Callable

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from echo2.data import layout
from echo2.data.delta import DeltaRejected, apply_delta, mismatches
from echo2.data.store import NotFound, ObjectStore
from echo2.data.weights import read_manifest, read_verified

ManifestOf = Callable[[int], dict]
FilesOf = Callable[[dict], dict[str, bytes]]


def is_delta(manifest: dict) -> bool:
    return manifest.get("weights") == "delta"


def base_of(manifest: dict) -> int:
    """The version a delta applies to; DeltaRejected unless it is an earlier version number."""
    version, base = manifest.get("version"), manifest.get("base_version")
    if not (_is_int(base) and _is_int(version) and 0 <= base < version):
        raise DeltaRejected(f"delta v{version!r:.20} names base {base!r:.20}, not an earlier version")
    return base


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def chain_manifests(version: int, manifest_of: ManifestOf) -> list[dict]:
    """Manifests of the chain of ``version``, keyframe first. NotFound if a link is gone."""
    chain = [_signed_for(manifest_of(version), version)]
    while is_delta(chain[-1]):  # bases strictly decrease: the walk ends
        base = base_of(chain[-1])
        chain.append(_signed_for(manifest_of(base), base))
    return chain[::-1]


def _signed_for(manifest: dict, version: int) -> dict:
    if manifest.get("version") != version or isinstance(manifest.get("version"), bool):
        raise DeltaRejected(f"the manifest of v{version} is for version {manifest.get('version')!r:.20}")
    return manifest


def weight_bytes(manifest: dict) -> int:
    """Bytes a receiver downloads for this version's weights (shards or delta shards)."""
    return sum(e["size"] for e in manifest["files"] if e["kind"] in ("shard", "delta"))


def full_tensors(manifest: dict, files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """The tensors of a full version's shards, checked against its tensor table when it has one."""
    try:
        tensors = {k: v for e in manifest["files"] if e["kind"] == "shard"
                   for k, v in st_load(files[e["name"]]).items()}
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise DeltaRejected(f"v{manifest.get('version')}: a shard does not parse: {str(exc):.200}") from None
    table = manifest.get("tensors")
    if table is not None:
        bad = mismatches(tensors, table) if isinstance(table, dict) else ["(no table)"]
        if bad:
            raise DeltaRejected(f"keyframe v{manifest.get('version')} differs from its tensor table in {bad[:3]}")
    return tensors


def delta_files(manifest: dict, files: dict[str, bytes]) -> list[bytes]:
    return [files[e["name"]] for e in manifest["files"] if e["kind"] == "delta"]


def apply_version(tensors: dict[str, torch.Tensor], manifest: dict, files: dict[str, bytes]) -> None:
    """Apply the delta version ``manifest`` to ``tensors`` (its base), in place, verified; DeltaRejected if not."""
    table = manifest.get("tensors")
    if not isinstance(table, dict):
        raise DeltaRejected(f"delta v{manifest.get('version')} has no tensor table")
    apply_delta(tensors, delta_files(manifest, files), table)


def rebuild(chain: list[dict], files_of: FilesOf,
            start: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The weights at the end of ``chain``. From ``start`` (the weights of ``chain[0]``, changed in
    place) or else from ``chain[0]``'s own files, which must be a full version."""
    tensors = start if start is not None else full_tensors(chain[0], files_of(chain[0]))
    for manifest in chain[1:]:
        apply_version(tensors, manifest, files_of(manifest))
    return tensors


# -- the store's view -----------------------------------------------------------------------

def store_manifest_of(store: ObjectStore, public_key: Ed25519PublicKey | None = None) -> ManifestOf:
    """Manifests read from the store; with ``public_key`` each link's signature is checked (``echo2 export``)."""
    return lambda version: read_manifest(store, layout.policy_dir(version), public_key)


def store_files_of(store: ObjectStore) -> FilesOf:
    def files(manifest: dict) -> dict[str, bytes]:
        prefix = layout.policy_dir(int(manifest["version"]))
        return {e["name"]: read_verified(store, prefix, e) for e in manifest["files"] if e["kind"] != "aux"}

    return files


def read_version(store: ObjectStore, version: int,
                 public_key: Ed25519PublicKey | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Full weights of a published version (rebuilt through its chain when it is a delta), and the
    manifest of the full version it starts from (whose model files go with it)."""
    chain = chain_manifests(version, store_manifest_of(store, public_key))
    return rebuild(chain, store_files_of(store)), chain[0]


def chain_closure(store: ObjectStore, versions: set[int], cache: dict[int, dict] | None = None) -> set[int]:
    """``versions`` and every version their chains need. A version whose manifest is gone counts as
    itself only (nothing can be rebuilt through it). ``cache`` keeps manifests between calls."""
    cache = {} if cache is None else cache

    def manifest_of(v: int) -> dict:
        if v not in cache:
            cache[v] = read_manifest(store, layout.policy_dir(v))
        return cache[v]

    needed = set(versions)
    for v in versions:
        try:
            needed.update(m["version"] for m in chain_manifests(v, manifest_of))
        except (NotFound, DeltaRejected):
            continue
    return needed
