"""Chunked, signed manifests of a policy version.

Each weights file is cut into chunks of ``chunk_size`` bytes (the last one shorter); the
manifest lists the sha256 of every chunk. Chunk ``i`` of a version is the i-th in manifest
order across all files, so peers and the store agree on numbering. The whole manifest is
signed with HMAC-SHA256 under the run's key; the key never enters the store or a log.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

SIGNATURE = "signature"
TOKEN_CONTEXT = b"echo2 relay token v1"
KEY_ENV = "ECHO2_RUN_KEY"


class ManifestRejected(Exception):
    """A manifest's signature does not verify under the run key (forged, re-signed or altered)."""


def chunk_hashes(data: bytes, chunk_size: int) -> list[str]:
    return [hashlib.sha256(data[o : o + chunk_size]).hexdigest() for o in range(0, max(len(data), 1), chunk_size)]


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(manifest: dict, key: bytes) -> dict:
    return {**manifest, SIGNATURE: hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()}


def verify_signature(manifest: dict, key: bytes) -> dict:
    expected = hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(str(manifest.get(SIGNATURE, "")), expected):
        raise ManifestRejected(f"manifest of version {manifest.get('version')} has a bad or missing signature")
    return manifest


def relay_token(key: bytes) -> str:
    """The bearer token relay requests carry, derived from the run key (so it never needs its own secret)."""
    return hmac.new(key, TOKEN_CONTEXT, hashlib.sha256).hexdigest()


def key_path(run_id: str) -> Path:
    base = Path(os.environ.get("ECHO2_SECRETS", Path.home() / ".config" / "echo2" / "keys"))
    return base / f"{run_id}.key"


def run_key(run_id: str, *, create: bool = False) -> bytes:
    """The run's HMAC key: ``$ECHO2_RUN_KEY``, else the secrets file of the run (created by the learner)."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV].encode()
    path = key_path(run_id)
    if path.exists():
        return path.read_bytes().strip()
    if not create:
        raise ManifestRejected(f"no key for run {run_id}: set {KEY_ENV} or provide {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_hex(32).encode())
    return path.read_bytes().strip()


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
