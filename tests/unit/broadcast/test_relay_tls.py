"""The relay across hosts (issue 12, item 9): mutual TLS with certificates of the run's CA, on
loopback with real sockets, real OpenSSL handshakes and the real relay code. Weights are not readable
on the wire, no peer can pose as another, and a revoked actor is refused by certificate and token.
"""

from __future__ import annotations

import asyncio
import ssl
import time

import aiohttp
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from relay_helpers import env_of_a_launched_actor, make_version, slow_store_reader
from relay_helpers import poll_until as _poll_until
from relay_tls_shared import RUN, _bundle, _ca_pem, _tls, _token

from echo2.broadcast.protocol import FetchPolicy, Peer
from echo2.broadcast.receiver import PolicyReceiver
from echo2.broadcast.relay import RelayServer
from echo2.broadcast.relay_node import RelayNode
from echo2.broadcast.relay_tls import RelayTLS, relay_tls, tls_enabled
from echo2.config import BroadcastConfig, Config, ConfigError, load_config
from echo2.data import layout
from echo2.data.relay_certs import (
    RELAY_TLS_ENV,
    ActorCertificate,
    BadRelayCertificate,
    RelayCA,
    ca_of_run,
    identity_name,
)
from echo2.data.relay_tokens import RelayAuth
from echo2.data.run_folder import create_run
from echo2.data.run_key import KEY_ENV, public_key_of, run_key
from echo2.data.store import open_store
from echo2.data.weights import publish_version


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run as the learner creates it (its key in the secrets folder, run.json with the relay CA, version 0)."""
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(RELAY_TLS_ENV, raising=False)
    store = open_store(str(tmp_path / "store" / "runs" / RUN))
    key = run_key(RUN, create=True)
    create_run(store, RUN, Config.model_validate({"run": {"id": RUN}}).model_dump(mode="json"), key=key,
               echo2_version="test")
    publish_version(store, 0, {"w": torch.zeros(8)}, extra_files={}, shard_mb=1, key=key)
    return store, key


def _receiver(store, key, actor: str, monkeypatch) -> PolicyReceiver:
    """An actor's receiver built as ``Actor`` builds it: run.json, its token, $ECHO2_RELAY_TLS, broadcast.tls on."""
    monkeypatch.setenv(RELAY_TLS_ENV, _bundle(key, actor))
    run = store.get_json(layout.RUN_JSON)
    config = BroadcastConfig(mode="relay", tls="on", pipeline_wait_s=2.0, heartbeat_s=0.2)
    return PolicyReceiver(store, actor, public_key_of(run), _token(key, actor), config, staleness=2, run_id=RUN,
                          tls=relay_tls(config, run, actor))


@pytest.fixture
def a0(run, monkeypatch):
    """Actor a0's TLS relay, holding version 0."""
    store, key = run
    receiver = _receiver(store, key, "a0", monkeypatch)
    try:
        _poll_until(receiver, 0)
        yield receiver
    finally:
        receiver.close()


CLOSED_BY_SERVER = "connection closed by the server"


def _wait_for(condition, timeout: float = 10.0) -> None:
    """The relay counts a refused handshake in its own thread, maybe just after the client saw the close."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the relay did not count the refusal"
        time.sleep(0.02)


def _get(url: str, *, token: str | None = None, context: ssl.SSLContext | None = None,
         server_hostname: str | None = None, version: int = 0) -> int | str:
    """The status of a chunk request, or the name of the error that stopped it."""
    async def get():
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        kwargs = {"ssl": context, "server_hostname": server_hostname} if context is not None else {}
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/v1/versions/{version}/chunks/0", headers=headers, **kwargs) as r:
                    return r.status
        except aiohttp.ClientConnectorError as exc:  # nothing listening: never a refusal by the relay
            return type(exc).__name__
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            # connected, then closed by the server: TLS 1.3 finishes the client's side of the handshake before
            # the server checks its certificate, so the server's alert reaches the client as an end of stream
            # or as a reset (ECONNRESET, an SSL alert), whichever the scheduling makes it read first
            return CLOSED_BY_SERVER
        except aiohttp.ClientError as exc:
            return type(exc).__name__

    return asyncio.run(get())


def test_a_chain_of_three_tls_receivers_delivers_verified_versions_peer_to_peer(run, monkeypatch):
    store, key = run
    nodes = [_receiver(store, key, f"a{i}", monkeypatch) for i in range(3)]
    try:
        assert all(n.url.startswith("https://127.0.0.1:") for n in nodes)
        for n in nodes:
            _poll_until(n, 0)
        relay = {"fanout": 1, "roots": 1, "peers": [{"id": f"a{i}", "url": n.url} for i, n in enumerate(nodes)]}
        publish_version(store, 1, {"w": torch.arange(300_000, dtype=torch.float32)}, extra_files={}, shard_mb=1,
                        chunk_size=256 * 1024, key=key, meta={"relay": relay})
        got = [_poll_until(n, 1) for n in nodes]
        assert got[0].files() == got[1].files() == got[2].files()
        assert set(got[0].sources) == {"store"}
        assert set(got[1].sources) == {f"a0 at {nodes[0].url}"}  # every chunk over TLS from its parent
        assert set(got[2].sources) == {f"a1 at {nodes[1].url}"}
        assert all(n.node.server.refusals == n.node.server.handshake_refusals == 0 for n in nodes)
    finally:
        for n in nodes:
            n.close()


def test_a_tls_relay_refuses_no_certificate_a_foreign_one_a_mismatched_token_and_plain_http(run, a0, caplog):
    store, key = run
    url, server = a0.url, a0.node.server
    a1, a2 = _token(key, "a1"), _token(key, "a2")
    name = identity_name("a0")
    # the right certificate and token: served
    assert _get(url, token=a1, context=_tls(store, key, "a1").client_context, server_hostname=name) == 200
    # no client certificate: the handshake is refused
    bare = ssl.create_default_context(cadata=_ca_pem(store))
    counted = server.handshake_refusals
    assert _get(url, token=a1, context=bare, server_hostname=name) == CLOSED_BY_SERVER
    _wait_for(lambda: server.handshake_refusals > counted)  # each refusal is the server's, counted as such
    counted = server.handshake_refusals
    # a certificate of another run's CA (a CA of its own), and a token of this run
    other = Ed25519PrivateKey.generate()
    foreign = RelayTLS(ActorCertificate(RelayCA(other, RUN).issue("a1", time.time() + 3600)),
                       RelayCA(other, RUN).certificate_pem())
    foreign.client_context.load_verify_locations(cadata=_ca_pem(store))  # it trusts us; we do not trust it
    assert _get(url, token=a1, context=foreign.client_context, server_hostname=name) == CLOSED_BY_SERVER
    _wait_for(lambda: server.handshake_refusals > counted)
    # the certificate of a1 with the token of a2
    assert _get(url, token=a2, context=_tls(store, key, "a1").client_context, server_hostname=name) == 401
    # plain HTTP to the TLS port
    counted = server.handshake_refusals
    assert _get(url.replace("https://", "http://"), token=a1) == CLOSED_BY_SERVER
    _wait_for(lambda: server.handshake_refusals > counted)
    assert server.refusals == 1
    for reason in ("peer did not return a certificate", "certificate verify failed", "http request",
                   "a token of a2 over the certificate of a1"):
        assert reason in caplog.text, reason
    assert a1 not in caplog.text and a2 not in caplog.text  # refusals never log a secret


class CountingServer(RelayServer):
    """A relay that counts the chunk requests that reached it (a test peer)."""

    requests = 0

    async def _chunk(self, request):
        CountingServer.requests += 1
        return await super()._chunk(request)


def test_a_client_does_not_accept_a_server_presenting_another_actors_certificate(run, monkeypatch, caplog):
    store, key = run
    manifest, files = make_version(store, version=1)
    auth = RelayAuth(key.public_key(), RUN)
    # a1 listens where the plan says a0 is (it squats on a0's address, or a0 advertised a1's URL)
    squatter = RelayNode(_token(key, "a1"), auth, slow_store_reader(store, 0), server_cls=CountingServer,
                         tls=_tls(store, key, "a1"))
    child = RelayNode(_token(key, "a2"), RelayAuth(key.public_key(), RUN), slow_store_reader(store, 0),
                      policy=FetchPolicy(pipeline_wait_s=2), tls=_tls(store, key, "a2"))
    try:
        squatter.seed(manifest, files)
        CountingServer.requests = 0
        buf = child.start_fetch(manifest, [Peer(squatter.url, "a0")]).result(timeout=30)
        assert buf.files() == files and set(buf.sources) == {"store"}  # left for the store at the handshake
        assert CountingServer.requests == 0  # nothing was sent to it, the token least of all
        assert "Hostname mismatch" in caplog.text and f"leaving a0 at {squatter.url}" in caplog.text
        # the same server, asked as who it is, serves: TLS itself works
        buf = child.start_fetch({**manifest}, [Peer(squatter.url, "a1")]).result(timeout=30)
        assert set(buf.sources) == {f"a1 at {squatter.url}"} and CountingServer.requests == 1  # one streamed run
        # a TLS node never dials a plain-HTTP peer, nor a bare URL it cannot check the identity of
        caplog.clear()
        buf = child.start_fetch({**manifest}, [Peer(squatter.url.replace("https", "http"), "a1"), squatter.url]
                                ).result(timeout=30)
        assert set(buf.sources) == {"store"} and caplog.text.count("this relay speaks TLS") == 2
    finally:
        child.close()
        squatter.close()


def test_a_revoked_actor_is_refused_by_certificate_from_the_version_that_revokes_it(run, a0, caplog):
    store, key = run
    a1 = dict(token=_token(key, "a1"), context=_tls(store, key, "a1").client_context,
              server_hostname=identity_name("a0"))
    assert _get(a0.url, **a1) == 200
    publish_version(store, 1, {"w": torch.ones(8)}, extra_files={}, shard_mb=1, key=key, meta={"revoked": ["a1"]})
    _poll_until(a0, 1)
    assert _get(a0.url, version=1, **a1) == 401
    assert "the certificate of a1 is revoked" in caplog.text
    # nor is a revoked actor a parent: a plan that still names it (alive, heartbeating) is not followed
    relay = {"fanout": 1, "roots": 1, "peers": [{"id": "a1", "url": "https://127.0.0.1:9"},
                                                {"id": "a0", "url": a0.url}]}
    publish_version(store, 2, {"w": torch.ones(8) * 2}, extra_files={}, shard_mb=1, key=key,
                    meta={"relay": relay, "revoked": ["a1"]})
    assert set(_poll_until(a0, 2).sources) == {"store"}
    assert "skipping a1 at https://127.0.0.1:9: a1 is revoked" in caplog.text


def test_the_learner_gives_no_children_to_a_revoked_actor(run):
    from echo2.broadcast.topology import register
    from echo2.config import TrainConfig
    from echo2.data.ledger import write_event
    from echo2.learner.publisher import Publisher

    store, key = run
    for actor in ("a0", "a1", "a2"):
        write_event(store, "launch", actor)  # the fleet launched all three
        register(store, actor, f"https://10.0.0.{actor[1]}:8443", 0)  # all three alive
    publisher = Publisher(store, train=TrainConfig(), broadcast=BroadcastConfig(), key=key, extra_files={})
    manifest, _ = publisher.publish(1, {"w": torch.ones(8)}, {}, revoked={"a1"})
    assert sorted(p["id"] for p in manifest["relay"]["peers"]) == ["a0", "a2"] and manifest["revoked"] == ["a1"]


def _secret_forms(key) -> dict[str, str]:
    """Every spelling of the CA's private key (and the run key it derives from) a leak could take."""
    ca = RelayCA(key, RUN)
    private = ca._key  # the test looks inside on purpose: this is what must never leak
    scalar = private.private_numbers().private_value
    import base64
    der = private.private_bytes(Encoding.DER, PrivateFormat.PKCS8, NoEncryption())
    return {"ca pem": private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode().splitlines()[1],
            "ca scalar hex": f"{scalar:064x}", "ca scalar": str(scalar),
            "ca der b64": base64.urlsafe_b64encode(der).rstrip(b"=").decode()[40:100],
            "ca der std b64": base64.b64encode(der).decode()[40:100],
            "run key seed": key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()).hex()}


def test_actors_get_their_own_certificate_and_the_ca_key_is_never_in_the_store_env_or_logs(run, tmp_path, monkeypatch,
                                                                                           caplog):
    store, key = run
    record = store.get_json(layout.RUN_JSON)
    actor_id, env, _ = env_of_a_launched_actor(store, key, tmp_path, (KEY_ENV, RELAY_TLS_ENV), run_id=RUN)
    assert env[KEY_ENV] is None
    cert = ActorCertificate(env[RELAY_TLS_ENV])
    cert.check(actor_id, ca_of_run(record))  # its own, from this run's CA
    with pytest.raises(BadRelayCertificate, match="names actor"):
        cert.check("a-different-actor", ca_of_run(record))
    # a real actor's receiver over TLS with it, then a version relayed: the grep covers what a run writes
    a0 = _receiver(store, key, "a0", monkeypatch)
    try:
        _poll_until(a0, 0)
        publish_version(store, 1, {"w": torch.ones(8)}, extra_files={}, shard_mb=1, key=key, meta={"revoked": ["a9"]})
        _poll_until(a0, 1)
    finally:
        a0.close()
    in_store = b"".join(p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file())
    in_logs = b"".join(p.read_bytes() for p in (tmp_path / "logs").rglob("*") if p.is_file())  # the actor's log
    for what, secret in _secret_forms(key).items():
        assert secret.encode() not in in_store + in_logs, what
        assert secret not in caplog.text and secret not in env[RELAY_TLS_ENV], what
    # the actor's own key is a secret too (its log shows it: the test printed it)
    assert env[RELAY_TLS_ENV].encode() not in in_store


def test_a_resumed_learner_issues_certificates_of_the_same_ca(run, monkeypatch):
    store, key = run
    ca_pem = ca_of_run(store.get_json(layout.RUN_JSON))
    again = run_key(RUN)  # a resumed learner: the key from the secrets file, no new one
    ActorCertificate(RelayCA(again, RUN).issue("a0", time.time() + 60)).check("a0", ca_pem)
    with pytest.raises(BadRelayCertificate, match="not issued by this run's relay CA"):
        ActorCertificate(RelayCA(Ed25519PrivateKey.generate(), RUN).issue("a0", time.time() + 60)).check("a0", ca_pem)
    with pytest.raises(BadRelayCertificate, match="expired"):
        ActorCertificate(RelayCA(key, RUN).issue("a0", time.time() - 1)).check("a0", ca_pem)


def test_what_an_actor_needs_for_tls_is_checked_with_one_clear_error_each(run, monkeypatch):
    store, key = run
    record = store.get_json(layout.RUN_JSON)
    on = BroadcastConfig(tls="on")
    with pytest.raises(BadRelayCertificate, match=f"set {RELAY_TLS_ENV}"):
        relay_tls(on, record, "a0")
    monkeypatch.setenv(RELAY_TLS_ENV, "not a bundle")
    with pytest.raises(BadRelayCertificate, match="not an echo2 relay certificate bundle"):
        relay_tls(on, record, "a0")
    monkeypatch.setenv(RELAY_TLS_ENV, _bundle(key, "a0"))
    with pytest.raises(BadRelayCertificate, match="carries no relay CA"):
        relay_tls(on, {k: v for k, v in record.items() if k != "relay_ca"}, "a0")
    assert relay_tls(on, record, "a0").actor_id == "a0"
    assert relay_tls(BroadcastConfig(), record, "a0") is None  # auto on loopback: plain HTTP


@pytest.mark.parametrize("host, tls, expected", [
    ("127.0.0.1", "auto", False), ("::1", "auto", False), ("localhost", "auto", False), ("0.0.0.0", "auto", True),
    ("10.0.0.5", "auto", True), ("relay.example", "auto", True), ("0.0.0.0", "off", False), ("127.0.0.1", "on", True)])
def test_broadcast_tls_auto_is_on_whenever_the_relay_binds_beyond_loopback(host, tls, expected):
    assert tls_enabled(BroadcastConfig(host=host, tls=tls)) is expected


def test_the_skypilot_backend_refuses_a_relay_without_tls(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("store: {url: 's3://b/runs'}\nfleet: {backend: skypilot}\nbroadcast: {tls: 'off'}\n")
    with pytest.raises(ConfigError, match="broadcast.tls off is refused with fleet.backend skypilot"):
        load_config(path)
