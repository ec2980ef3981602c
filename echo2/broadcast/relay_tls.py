"""Mutual TLS for the relay: peers on different machines speak TLS 1.3 with certificates from the
run's CA (``data/relay_certs.py``), so the weights of a private model are not readable on the wire,
and no peer can pose as another.

When (``broadcast.tls``): ``on``; ``off``; ``auto`` (the default) = on whenever the relay binds an
address other than loopback, so a cloud VM's relay (0.0.0.0, a port open to the internet) always
speaks TLS, and a local run on 127.0.0.1 stays plain HTTP (no traffic leaves the machine; tests stay
fast). A SkyPilot fleet refuses ``off`` (``echo2/config``). A node's mode covers both its ends: a TLS
node serves only TLS and dials only ``https://`` peers; a plain node dials only ``http://`` peers;
a peer of the other kind is skipped for the next source, as any failing peer is. TLS concerns
peer-to-peer traffic only: the store is reached over its own transport (HTTPS to S3/GCS) under its
own access control, and whatever comes from anywhere is checked against the signed manifest.

Server (every actor): a TLS 1.3 context with the actor's certificate that requires a client
certificate chaining to the run's CA (``CERT_REQUIRED``). The handshake is done with
``loop.start_tls`` by a small acceptor in front of aiohttp's request handler, so that a refused
handshake (no certificate, one of another CA or expired, plain HTTP to a TLS port) is logged with
its reason and counted (asyncio's own TLS server drops those silently outside debug mode). Then,
at every request (so also on a kept-alive connection), the relay reads the client's actor from its
certificate and refuses (401, logged) a certificate of a revoked actor and a bearer token of an
actor other than the certificate's: a stolen token is of no use without that actor's key, and a
stolen key none without its token.

Client (the fetcher): the same CA as the only trust anchor, the actor's certificate as its client
certificate, and, for each peer, OpenSSL's host name check against ``identity_name(peer id)``
from the signed relay plan, instead of the URL's address (which the actor wrote itself and proves
nothing). It happens inside the handshake, before the request and its token are sent: a server
presenting any other actor's certificate (one that squats on an advertised address, or an actor
advertising another's URL) fails the handshake, and the child moves on to its next source.

Python's ``ssl`` reads a certificate chain only from a file: the key is put in an anonymous memory
file (``memfd_create``; a 0600 file in a 0700 temporary folder where there is none), loaded, and
the file closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import ssl
import tempfile
from typing import Callable

from echo2.config import BroadcastConfig
from echo2.data.relay_certs import ActorCertificate, actor_of_peercert, ca_of_run, certificate_from_env, identity_name

log = logging.getLogger("echo2.relay")

HANDSHAKE_TIMEOUT_S = 10.0


def tls_enabled(config: BroadcastConfig) -> bool:
    """Whether this node's relay speaks TLS (``broadcast.tls``, ``auto`` judged by the bind address)."""
    if config.tls != "auto":
        return config.tls == "on"
    host = config.host.strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return True


def _load_chain(context: ssl.SSLContext, pem: bytes) -> None:
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("echo2-relay-cert", os.MFD_CLOEXEC)
        try:
            os.write(fd, pem)
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return
    folder = tempfile.mkdtemp(prefix="echo2-tls-")  # 0700
    try:
        path = os.path.join(folder, "chain.pem")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(pem)
        context.load_cert_chain(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _context(purpose: ssl.Purpose, ca_pem: str, certificate: ActorCertificate) -> ssl.SSLContext:
    context = ssl.create_default_context(purpose, cadata=ca_pem)  # the run's CA and nothing else
    context.minimum_version = ssl.TLSVersion.TLSv1_3  # both ends are echo2
    context.verify_mode = ssl.CERT_REQUIRED
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    _load_chain(context, certificate.pem())
    return context


class RelayTLS:
    """One actor's TLS: its server and client contexts, from its certificate and the run's CA."""

    def __init__(self, certificate: ActorCertificate, ca_pem: str):
        self.actor_id = certificate.actor_id
        self.server_context = _context(ssl.Purpose.CLIENT_AUTH, ca_pem, certificate)
        self.client_context = _context(ssl.Purpose.SERVER_AUTH, ca_pem, certificate)  # check_hostname stays on

    def __repr__(self) -> str:
        return f"RelayTLS({self.actor_id!r})"

    @staticmethod
    def server_hostname(peer_id: str) -> str:
        """What the client asks OpenSSL to find in the server's certificate: the plan's peer, not its address."""
        return identity_name(peer_id)

    @staticmethod
    def client_actor(transport) -> str | None:
        """The actor the (verified) client certificate on ``transport`` names; None without one."""
        return actor_of_peercert(transport.get_extra_info("peercert")) if transport is not None else None


def relay_tls(config: BroadcastConfig, run: dict, actor_id: str) -> RelayTLS | None:
    """An actor's relay TLS, or None where ``broadcast.tls`` says plain; clear errors for what is missing."""
    if not tls_enabled(config):
        return None
    ca_pem = ca_of_run(run)
    certificate = certificate_from_env()
    certificate.check(actor_id, ca_pem)
    return RelayTLS(certificate, ca_pem)


def refusal_reason(exc: BaseException) -> str:
    """A loggable reason for a failed handshake (OpenSSL's words; never key material)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc.strerror or type(exc).__name__).lower().replace("_", " ")
    if isinstance(exc, (asyncio.TimeoutError, ConnectionAbortedError)):
        return "TLS handshake timed out"
    return f"connection ended during the TLS handshake ({type(exc).__name__})"


class _TLSAcceptor(asyncio.Protocol):
    """Accepts a TCP connection, does the TLS handshake, then hands the connection to ``handler_factory()``."""

    def __init__(self, handler_factory: Callable[[], asyncio.Protocol], context: ssl.SSLContext,
                 on_refused: Callable[[str, str], None], tasks: set):
        self.handler_factory = handler_factory
        self.context = context
        self.on_refused = on_refused
        self.tasks = tasks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()  # the ClientHello waits for start_tls (which resumes reading)
        task = asyncio.ensure_future(self._handshake(transport))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _handshake(self, transport: asyncio.Transport) -> None:
        handler = self.handler_factory()
        peer = transport.get_extra_info("peername")
        remote = str(peer[0]) if peer else "?"
        try:
            tls_transport = await asyncio.get_running_loop().start_tls(
                transport, handler, self.context, server_side=True, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:  # ssl.SSLError is an OSError
            transport.close()
            self.on_refused(remote, refusal_reason(exc))
            return
        except asyncio.CancelledError:  # the relay is stopping
            transport.close()
            raise
        handler.connection_made(tls_transport)


class TLSListener:
    """A listening socket whose connections become aiohttp requests after a mutual TLS handshake."""

    def __init__(self, handler_factory: Callable[[], asyncio.Protocol], context: ssl.SSLContext,
                 on_refused: Callable[[str, str], None]):
        self.handler_factory = handler_factory
        self.context = context
        self.on_refused = on_refused
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _TLSAcceptor(self.handler_factory, self.context, self.on_refused, self._tasks), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()  # no new connections; those handed to aiohttp end with its runner
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
