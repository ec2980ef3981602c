"""Chunked, signed manifests of a policy version (and of checkpoints), and what a manifest may name.

Each weights file is cut into chunks of ``chunk_size`` bytes (the last one shorter); the
manifest lists the sha256 of every chunk. Chunk ``i`` of a version is the i-th in manifest
order across all files, so peers and the store agree on numbering.

Signature: the learner signs the canonical JSON of the whole manifest (sorted keys, no
whitespace, without the ``signature`` field) with its Ed25519 key (``echo2.data.run_key``);
actors verify it with the run's public key from ``run.json``. No actor holds the private key,
so no actor can publish a version the others accept: a manifest that is unsigned, altered,
re-signed by anyone else (another Ed25519 key, an HMAC under the relay secret) is rejected.

File names: every file a manifest names becomes a path, in the store and on disk (an actor's
model folder, ``echo2 export``'s destination), so ``check_manifest`` allows only plain names
(``FILE_NAME``: no ``/``, ``\\``, no leading dot, hence no ``..``), each once, of a known kind.
It runs wherever a manifest is parsed (``weights.read_manifest``: receiver, export, checkpoint
loading), before any name is used, whoever signed the manifest: the learner is trusted, but
a name that escapes its folder would be written on every actor, so this is defense in depth.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE = "signature"
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
KINDS = ("shard", "aux", "delta")
"""shard: safetensors weights; aux: model and tokenizer files; delta: a sparse delta's shards (``echo2.data.delta``)."""


class ManifestRejected(Exception):
    """A manifest that must not be used: bad signature (forged, re-signed, altered, unsigned) or a
    file list that names something other than plain files of its own folder."""


def chunk_size_for(version_bytes: float, *, largest_mb: float, smallest_mb: float, at_least: int) -> int:
    """The chunk size in bytes a version of ``version_bytes`` is cut into: ``largest_mb``, or less where that would
    give fewer than ``at_least`` chunks, but never below ``smallest_mb`` (nor above ``largest_mb``, which wins where
    it is the smaller); at least 1 byte. Why a version needs many chunks: a relay passes a chunk on only once it
    has it whole and verified, so every hop of a chain adds one chunk's transfer to the version's time; in
    ``at_least`` chunks a chain of N hops adds at most N / ``at_least`` of the version's own transfer
    (``docs/broadcast.md``, "Chunk size")."""
    if at_least < 1:
        raise ValueError(f"a version is cut into at least 1 chunk, not {at_least}")
    largest, smallest = max(1, int(largest_mb * 2**20)), max(1, int(smallest_mb * 2**20))
    return max(min(smallest, largest), min(largest, -(-max(0, math.ceil(version_bytes)) // at_least)))


def chunk_hashes(data: bytes, chunk_size: int) -> list[str]:
    return [hashlib.sha256(data[o : o + chunk_size]).hexdigest() for o in range(0, max(len(data), 1), chunk_size)]


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    try:
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise ManifestRejected(f"manifest of version {manifest.get('version')} has no canonical form: {exc}") from None


def sign(manifest: dict, key: Ed25519PrivateKey) -> dict:
    """``manifest`` with its Ed25519 signature (hex) over the canonical JSON of everything else."""
    return {**manifest, SIGNATURE: key.sign(_canonical(manifest)).hex()}


def verify_signature(manifest: dict, public_key: Ed25519PublicKey) -> dict:
    """``manifest`` if the run's public key verifies its signature; ManifestRejected otherwise."""
    signature = manifest.get(SIGNATURE)
    try:
        if not isinstance(signature, str):
            raise ValueError("no signature")
        public_key.verify(bytes.fromhex(signature), _canonical(manifest))
    except (InvalidSignature, ValueError):
        raise ManifestRejected(f"manifest of version {manifest.get('version')} has a bad or missing signature "
                               "(not signed with the run's key)") from None
    return manifest


def check_file_name(name: object) -> str:
    """``name`` if it is a plain file name (``FILE_NAME``); ValueError saying why not."""
    if not isinstance(name, str) or not FILE_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"{name!r} is not a plain file name (letters, digits, '.', '_', '-'; no path)")
    return name


def check_manifest(manifest: object, where: str = "manifest") -> dict:
    """The parsed ``manifest`` if its file list names only plain, distinct files of known kinds;
    ManifestRejected with the reason otherwise. Signatures are checked separately (``verify_signature``)."""
    if not isinstance(manifest, dict):
        raise ManifestRejected(f"{where} is a JSON {type(manifest).__name__}, not an object")
    files = manifest.get("files")
    if not isinstance(files, list):
        raise ManifestRejected(f"{where} has no file list")
    seen: set[str] = set()
    for entry in files:
        if not isinstance(entry, dict):
            raise ManifestRejected(f"{where} has a file entry that is not an object: {entry!r:.80}")
        try:
            name = check_file_name(entry.get("name"))
        except ValueError as exc:
            raise ManifestRejected(f"{where} names a file outside its folder: {str(exc):.200}") from None
        if name in seen:
            raise ManifestRejected(f"{where} names {name!r} twice")
        seen.add(name)
        if entry.get("kind") not in KINDS:
            raise ManifestRejected(f"{where}: {name!r} has unknown kind {entry.get('kind')!r:.40}")
    return manifest


@dataclass(frozen=True)
class Chunk:
    index: int
    file: str
    offset: int
    size: int
    sha256: str


def chunk_table(manifest: dict) -> list[Chunk]:
    """All chunks of a manifest, numbered across files in manifest order."""
    size = manifest["chunk_size"]
    out: list[Chunk] = []
    for entry in manifest["files"]:
        for i, digest in enumerate(entry["chunks"]):
            offset = i * size
            out.append(Chunk(len(out), entry["name"], offset, min(size, entry["size"] - offset), digest))
    return out
