"""Chunked, signed manifests of a policy version.

Each weights file is cut into chunks of ``chunk_size`` bytes (the last one shorter); the
manifest lists the sha256 of every chunk. Chunk ``i`` of a version is the i-th in manifest
order across all files, so peers and the store agree on numbering. The whole manifest is
signed with HMAC-SHA256 under the run's key (``echo2.data.run_key``); the key never enters
the store or a log.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

SIGNATURE = "signature"


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
