"""Per-actor relay tokens: each actor's own, signed by the learner, checked by every peer, revocable.

Relay requests carry ``Authorization: Bearer <token>`` so that a stranger can neither pull nor probe
chunks. A token names one actor of one run and when it stops working, and carries the learner's
Ed25519 signature over that (the run's signing key, ``run_key.py``):

    e2rt1.<base64url(run_id \\n actor_id \\n expires_unix)>.<base64url(signature)>

A peer checks it with the run's public key from ``run.json``: no node holds anything that mints a
token, so an actor can speak only as itself, and a leaked token works for one actor until it
expires or is revoked. The learner revokes an actor (replaced, reclaimed, crashed, or found
dishonest) by naming it in the ``revoked`` list of the next signed manifest; a relay refuses that
actor's token from the version it learns of the revocation on. A refusal is logged with the reason
and the actor it names, never with the token.

An actor gets its token through ``$ECHO2_RELAY_TOKEN``, set by the fleet that started it through
the backend's secret channel.
"""

from __future__ import annotations

import base64
import binascii
import os
import time

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from echo2.data.run_key import MissingRunKey

PREFIX = "e2rt1"
CONTEXT = b"echo2 relay token v1\0"
RELAY_TOKEN_ENV = "ECHO2_RELAY_TOKEN"
"""An actor's own relay token (it cannot sign anything)."""
MAX_TOKEN_CHARS = 512


class TokenRefused(Exception):
    """Why a token is not accepted: the text is safe to log (it never contains the token)."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint(key: Ed25519PrivateKey, run_id: str, actor_id: str, expires_at: float) -> str:
    """The relay token of ``actor_id`` in ``run_id``, valid until ``expires_at`` (epoch seconds)."""
    if "\n" in run_id or "\n" in actor_id:
        raise ValueError("run and actor ids cannot hold newlines")
    claim = f"{run_id}\n{actor_id}\n{int(expires_at)}".encode()
    return f"{PREFIX}.{_b64(claim)}.{_b64(key.sign(CONTEXT + claim))}"


def token_from_env() -> str:
    token = os.environ.get(RELAY_TOKEN_ENV)
    if not token:
        raise MissingRunKey(f"no relay token: set {RELAY_TOKEN_ENV} (the fleet that starts an actor sets it)")
    return token


class RelayAuth:
    """What a relay node accepts: tokens the run's key signed for this run, unexpired, not revoked."""

    def __init__(self, public_key: Ed25519PublicKey, run_id: str):
        self.public_key = public_key
        self.run_id = run_id
        self.revoked: frozenset[str] = frozenset()
        self._verified: dict[str, tuple[str, int]] = {}  # token -> (actor, expiry): a signature is checked once

    def revoke(self, actor_ids) -> None:
        """Replace the revoked set (the newest signed manifest's ``revoked`` list)."""
        self.revoked = frozenset(str(a) for a in actor_ids)

    def actor_of(self, token: str, now: float | None = None) -> str:
        """The actor ``token`` speaks for; ``TokenRefused`` (with a loggable reason) otherwise."""
        now = time.time() if now is None else now
        known = self._verified.get(token)
        if known is None:
            known = self._verify(token)
            if len(self._verified) >= 4096:  # bounded: a flood of valid tokens cannot grow it forever
                self._verified.clear()
            self._verified[token] = known
        actor, expires = known
        if expires < now:
            raise TokenRefused(f"the token of {actor} expired")
        if actor in self.revoked:
            raise TokenRefused(f"{actor} is revoked")
        return actor

    def _verify(self, token: str) -> tuple[str, int]:
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
            raise TokenRefused("malformed token")
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != PREFIX:
            raise TokenRefused("malformed token")
        try:
            claim, signature = _unb64(parts[1]), _unb64(parts[2])
            run_id, actor, expires = claim.decode().split("\n")
            expires_at = int(expires)
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise TokenRefused("malformed token") from None
        try:
            self.public_key.verify(signature, CONTEXT + claim)
        except InvalidSignature:
            raise TokenRefused(f"a token for {actor[:64]!r} not signed by this run's key") from None
        if run_id != self.run_id:
            raise TokenRefused(f"a token of another run ({run_id[:64]!r})")
        return actor, expires_at
