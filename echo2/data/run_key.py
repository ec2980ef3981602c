"""The run's keys: the learner's signing key, and the public key actors verify versions with.

Actors run on machines we do not own (docs/architecture.md, "Trust boundaries"), so the key that signs
policy versions is one no actor holds: an Ed25519 private key only the learner has, from
``$ECHO2_RUN_KEY`` (a resumed or remote learner; tests) or else a 0600 file in the secrets
folder, created once by the learner. Both hold the 32-byte seed as 64 hex digits. The private
key never enters the store, a log or an actor's environment. ``run.json`` carries the public
key (it is public) and its fingerprint: actors read it once at start and need no secret to
verify; a resumed learner checks that its private key is the run's (``run_folder.check_run_key``).

The same key signs each actor's relay token (``relay_tokens.py``): a peer checks a token with the
public key, so no actor holds anything that mints one, and the learner can revoke any actor's.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from echo2.errors import Echo2InputError

FINGERPRINT_CONTEXT = b"echo2 ed25519 fingerprint v1"
PUBLIC_PREFIX = "ed25519:"
KEY_ENV = "ECHO2_RUN_KEY"
"""The learner's private key (never set for an actor)."""


class MissingRunKey(Echo2InputError):
    """The run's key is not where it is expected, or is not the key the run was started with."""


class UnreadableRunKey(Echo2InputError):
    """Something is where the run's key is expected, but it is not a key (a missing key is another case)."""


def key_path(run_id: str) -> Path:
    base = Path(os.environ.get("ECHO2_SECRETS", Path.home() / ".config" / "echo2" / "keys"))
    return base / f"{run_id}.key"


def _seed_text(key: Ed25519PrivateKey) -> str:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()).hex()


def _parse(text: str, where: str) -> Ed25519PrivateKey:
    try:
        seed = bytes.fromhex(text.strip())
        if len(seed) != 32:
            raise ValueError(f"{len(seed)} bytes")
        return Ed25519PrivateKey.from_private_bytes(seed)
    except ValueError:
        raise UnreadableRunKey(f"the key at {where} is not an echo2 run key (64 hex digits of an Ed25519 seed); "
                               "restore the secrets file the run was started with") from None


def read_key(path: Path) -> Ed25519PrivateKey:
    """The key in a secrets file (``key_path``), with one clear error when it is not a key."""
    return _parse(path.read_text(errors="replace"), str(path))


def run_key(run_id: str, *, create: bool = False) -> Ed25519PrivateKey:
    """The learner's signing key: ``$ECHO2_RUN_KEY``, else the secrets file of the run (made with ``create``).

    Only the learner calls this; an actor never needs the private key (it verifies with
    ``public_key_of(run.json)``).
    """
    if os.environ.get(KEY_ENV):
        return _parse(os.environ[KEY_ENV], f"${KEY_ENV}")
    path = key_path(run_id)
    if path.exists():
        return read_key(path)
    if not create:
        raise MissingRunKey(f"no key for run {run_id}: set {KEY_ENV} or provide {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # EXCL: two learners never race to two keys
    with os.fdopen(fd, "w") as f:
        f.write(_seed_text(Ed25519PrivateKey.generate()))
    return _parse(path.read_text(), str(path))


def public_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The public key as ``run.json`` carries it: ``ed25519:<64 hex digits>``."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return PUBLIC_PREFIX + public.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def fingerprint(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """A short name of the public key (kept in run.json, shown in errors)."""
    raw = bytes.fromhex(public_key_text(key)[len(PUBLIC_PREFIX):])
    return hashlib.sha256(FINGERPRINT_CONTEXT + raw).hexdigest()[:16]


def public_key_of(record: dict) -> Ed25519PublicKey:
    """The run's public key from its ``run.json`` record: what an actor verifies versions with."""
    text = record.get("public_key")
    try:
        if not isinstance(text, str) or not text.startswith(PUBLIC_PREFIX):
            raise ValueError(text)
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(text[len(PUBLIC_PREFIX):]))
    except ValueError:
        raise MissingRunKey(f"run.json of run {record.get('run_id')} carries no Ed25519 public key "
                            "(a run of an older echo2?): actors cannot check its versions") from None
