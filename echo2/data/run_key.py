"""The run's secret key: it signs policy manifests and derives the relay token.

Only the learner (and the local actors it starts, through their environment) holds it. The key
never enters the store or a log; ``run.json`` holds only its fingerprint, so a resumed learner
can tell that it holds the key the run was started with.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from echo2.errors import Echo2InputError

TOKEN_CONTEXT = b"echo2 relay token v1"
FINGERPRINT_CONTEXT = b"echo2 key fingerprint v1"
KEY_ENV = "ECHO2_RUN_KEY"


class MissingRunKey(Echo2InputError):
    """The run's key is not where it is expected, or is not the key the run was started with."""


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
        raise MissingRunKey(f"no key for run {run_id}: set {KEY_ENV} or provide {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_hex(32).encode())
    return path.read_bytes().strip()



def fingerprint(key: bytes) -> str:
    """A public name of the key (kept in run.json): HMAC of a fixed context, so it reveals nothing."""
    return hmac.new(key, FINGERPRINT_CONTEXT, hashlib.sha256).hexdigest()[:16]
