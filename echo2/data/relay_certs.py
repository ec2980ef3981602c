"""The run's relay CA: a certificate authority per run that only the learner can sign with, and the
certificate + key it issues to each actor for the relay's mutual TLS (``broadcast/relay_tls.py``).

CA key. It is not a second secret: the learner derives it from the run's Ed25519 seed
(``run_key.py``) with HKDF-SHA256 under its own label, as a P-256 scalar. So there is still one
secret per run to keep, back up and hand to a remote or resumed learner (``$ECHO2_RUN_KEY`` or the
0600 secrets file), a resumed learner has the same CA by construction, and the key lives nowhere:
not in the store, a log, an actor's environment, nor even the secrets folder. The label keeps the
two uses apart (an Ed25519 signature and an ECDSA signature under keys that share no algebra).

CA certificate. Self-signed, ``BasicConstraints(ca, path_length=0)`` and ``KeyUsage(key_cert_sign,
crl_sign)`` (both critical), named ``echo2 relay CA <run key fingerprint>``; it is public and goes
into ``run.json`` (``relay_ca``) when the run is created, where every actor reads its trust anchor.
Leaves are issued later by the same derived key under the same name, so OpenSSL chains them to the
certificate in ``run.json`` whichever learner process issued them.

Actor certificate. One per actor, issued at launch: a fresh P-256 key, the actor id as CN and as
the URI SAN ``urn:echo2:actor:<id>`` (what a relay server reads to learn who its client is), the
DNS SAN ``identity_name(id)`` (what a client checks to know it reached the peer it meant to),
EKU server and client auth (an actor is both), valid until its relay token expires. It names no
address: a cloud VM's public IP is known only after it boots (and a spot replacement gets a new
one), and an address says nothing about who answers at it. A client therefore verifies the
server's identity, not its address: it dials the URL from the signed relay plan and asks OpenSSL to
match the certificate against the plan's peer id (``server_hostname=identity_name(peer)``), during
the handshake, before a byte of the request (token included) is sent. The DNS name is a hash of the
id under ``.invalid`` (RFC 6761: never resolvable), since actor ids may hold characters DNS does not
allow and host names compare case-insensitively (``A0`` and ``a0`` are two actors).

Why the learner makes the actor's key rather than signing a CSR from it: an actor has no channel
to the learner before it starts but the store, which is untrusted (the learner would have to tell
a CSR of actor A from one an attacker filed in A's name) and slow (the learner reads it between
steps, so an actor could not relay until the next one). The launch secret channel already carries
the actor's relay token, a secret of the same power for the same lifetime; the key goes the same
way, in one single-line secret, ``$ECHO2_RELAY_TLS`` (``e2rc1.<cert DER>.<PKCS#8 key DER>``,
base64url). A leak of it (e.g. from SkyPilot's request log) lets the holder speak as that one actor
until it expires or is revoked, exactly as a leaked token does; it cannot mint another identity.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import os

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from echo2.data.run_key import MissingRunKey, fingerprint

RELAY_TLS_ENV = "ECHO2_RELAY_TLS"
"""An actor's own relay certificate and its private key (it cannot issue anything)."""
BUNDLE_PREFIX = "e2rc1"
CA_LABEL = b"echo2 relay ca v1"
URI_PREFIX = "urn:echo2:actor:"
IDENTITY_DOMAIN = "actor.echo2.invalid"
CA_YEARS = 10
"""The CA certificate's lifetime: a run may be resumed long after it started; leaves are short-lived."""
CLOCK_SKEW = datetime.timedelta(minutes=10)
"""Certificates start this long before they are made: a VM's clock may be behind the learner's."""
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


class BadRelayCertificate(MissingRunKey):
    """An actor's relay certificate is missing, malformed, or not for this actor of this run."""


def identity_name(actor_id: str) -> str:
    """The DNS SAN naming ``actor_id``: what a client asks OpenSSL to match on the server's certificate."""
    return f"{hashlib.sha256(actor_id.encode()).hexdigest()[:32]}.{IDENTITY_DOMAIN}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class RelayCA:
    """The learner's CA of run ``run_id``: derived from the run key, never stored."""

    def __init__(self, run_key: Ed25519PrivateKey, run_id: str):
        seed = run_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        okm = HKDF(hashes.SHA256(), length=48, salt=None, info=CA_LABEL).derive(seed)  # 48 bytes: no bias mod n
        self._key = ec.derive_private_key(int.from_bytes(okm, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
        self.run_id = run_id
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"echo2 relay CA {fingerprint(run_key)}")])
        self._ski = x509.SubjectKeyIdentifier.from_public_key(self._key.public_key())

    def __repr__(self) -> str:  # never the key
        return f"RelayCA({self.name.rfc4514_string()})"

    def certificate_pem(self) -> str:
        """The self-signed CA certificate (public: ``run.json`` carries it)."""
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
                .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + datetime.timedelta(days=365 * CA_YEARS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(self._ski, critical=False)
                .sign(self._key, hashes.SHA256()))
        return cert.public_bytes(Encoding.PEM).decode()

    def issue(self, actor_id: str, expires_at: float) -> str:
        """``$ECHO2_RELAY_TLS`` of ``actor_id``: a fresh key and its certificate, valid until ``expires_at``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, actor_id)]))
                .issuer_name(self.name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - CLOCK_SKEW)
                .not_valid_after(datetime.datetime.fromtimestamp(expires_at, datetime.timezone.utc))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                             crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(URI_PREFIX + actor_id),
                                                            x509.DNSName(identity_name(actor_id))]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(self._ski),
                               critical=False)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(self._key, hashes.SHA256()))
        return ".".join((BUNDLE_PREFIX, _b64(cert.public_bytes(Encoding.DER)),
                         _b64(key.private_bytes(Encoding.DER, PrivateFormat.PKCS8, NoEncryption()))))


class ActorCertificate:
    """An actor's certificate and key, parsed from ``$ECHO2_RELAY_TLS``; ``pem()`` for ``load_cert_chain``."""

    def __init__(self, bundle: str):
        parts = bundle.strip().split(".") if isinstance(bundle, str) else []
        try:
            if len(parts) != 3 or parts[0] != BUNDLE_PREFIX:
                raise ValueError("not an e2rc1 bundle")
            self.certificate = x509.load_der_x509_certificate(_unb64(parts[1]))
            self._key = serialization.load_der_private_key(_unb64(parts[2]), password=None)
        except (ValueError, TypeError, binascii.Error):
            raise BadRelayCertificate(f"${RELAY_TLS_ENV} is not an echo2 relay certificate bundle") from None
        if self.certificate.public_key().public_numbers() != self._key.public_key().public_numbers():
            raise BadRelayCertificate(f"${RELAY_TLS_ENV}: the key is not the certificate's")

    def __repr__(self) -> str:  # never the key
        return f"ActorCertificate({self.actor_id!r})"

    @property
    def actor_id(self) -> str | None:
        return actor_of_certificate(self.certificate)

    def pem(self) -> bytes:
        """Certificate then key, PEM: what ``SSLContext.load_cert_chain`` reads (from a private file)."""
        return (self.certificate.public_bytes(Encoding.PEM)
                + self._key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))

    def check(self, actor_id: str, ca_pem: str) -> None:
        """Refuse, with one clear line, a bundle of another actor or of another run's CA, or expired."""
        if self.actor_id != actor_id:
            raise BadRelayCertificate(f"${RELAY_TLS_ENV} names actor {self.actor_id!r}, not {actor_id!r}")
        ca = x509.load_pem_x509_certificate(ca_pem.encode())
        try:
            self.certificate.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise BadRelayCertificate(f"${RELAY_TLS_ENV} was not issued by this run's relay CA "
                                      f"({type(exc).__name__})") from None
        if self.certificate.not_valid_after_utc <= _now():
            raise BadRelayCertificate(f"${RELAY_TLS_ENV}: the certificate of {actor_id} expired "
                                      f"at {self.certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")


def actor_of_certificate(cert: x509.Certificate) -> str | None:
    """The actor a certificate of ours names (its one ``urn:echo2:actor:`` URI SAN), else None."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    names = [u[len(URI_PREFIX):] for u in sans.get_values_for_type(x509.UniformResourceIdentifier)
             if u.startswith(URI_PREFIX)]
    return names[0] if len(names) == 1 else None


def actor_of_peercert(peercert: dict | None) -> str | None:
    """The same, from ``ssl.SSLSocket.getpeercert()``'s dict (a verified peer's certificate)."""
    if not peercert:
        return None
    names = [value[len(URI_PREFIX):] for kind, value in peercert.get("subjectAltName", ())
             if kind == "URI" and value.startswith(URI_PREFIX)]
    return names[0] if len(names) == 1 else None


def certificate_from_env() -> ActorCertificate:
    bundle = os.environ.get(RELAY_TLS_ENV)
    if not bundle:
        raise BadRelayCertificate(f"the relay speaks TLS but there is no certificate: set {RELAY_TLS_ENV} "
                                  "(the fleet that starts an actor sets it)")
    return ActorCertificate(bundle)


def ca_of_run(record: dict) -> str:
    """The relay CA certificate (PEM) from ``run.json``; a clear error for a run made before there was one."""
    pem = record.get("relay_ca")
    if not isinstance(pem, str) or "BEGIN CERTIFICATE" not in pem:
        raise BadRelayCertificate(f"run.json of run {record.get('run_id')} carries no relay CA (a run of an older "
                                  "echo2?): its relay cannot speak TLS; set broadcast.tls: off or start a new run")
    return pem
