"""An actor runs on a machine we do not own (issue 9, section 4): with everything it holds (the
actor's own relay token, the run's public key, store access) it cannot publish a version the others
accept, nor speak to a peer as another actor or after it is revoked; and no manifest, even one the
learner signed, makes a path outside its version's folder.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time

import aiohttp
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from relay_helpers import env_of_a_launched_actor
from relay_helpers import poll_until as _poll_until

from echo2.broadcast.receiver import PolicyReceiver
from echo2.config import BroadcastConfig, Config
from echo2.data import layout
from echo2.data.manifest import ManifestRejected, check_manifest, chunk_hashes, sign
from echo2.data.relay_tokens import RELAY_TOKEN_ENV, RelayAuth, TokenRefused, mint
from echo2.data.run_folder import create_run
from echo2.data.run_key import KEY_ENV, public_key_of, run_key
from echo2.data.store import open_store
from echo2.data.weights import publish_version, sha256, write_weights


def _seed(key: Ed25519PrivateKey) -> str:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()).hex()


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run as the learner creates it: its key in the secrets folder, run.json, version 0."""
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv(KEY_ENV, raising=False)
    store = open_store(str(tmp_path / "store" / "runs" / "r1"))
    key = run_key("r1", create=True)
    assert (tmp_path / "secrets" / "r1.key").stat().st_mode & 0o777 == 0o600
    create_run(store, "r1", Config.model_validate({"run": {"id": "r1"}}).model_dump(mode="json"), key=key,
               echo2_version="test")
    publish_version(store, 0, {"w": torch.zeros(8)}, extra_files={}, shard_mb=1, key=key)
    return store, key


def _token(key, actor_id: str, *, run_id: str = "r1", hours: float = 1.0) -> str:
    """What the learner's fleet gives an actor: its own relay token."""
    return mint(key, run_id, actor_id, time.time() + hours * 3600)


def _receiver(store, actor_id: str, token: str) -> PolicyReceiver:
    """A receiver with exactly what an actor holds: run.json's public key and its own relay token."""
    config = BroadcastConfig(mode="relay", pipeline_wait_s=0.5, heartbeat_s=0.2)
    return PolicyReceiver(store, actor_id, public_key_of(store.get_json(layout.RUN_JSON)), token, config, staleness=2,
                          run_id="r1")


def _relay(a: PolicyReceiver, b: PolicyReceiver) -> dict:
    """A relay plan in which b (a1) pulls from a (a0)."""
    return {"fanout": 1, "roots": 1, "peers": [{"id": "a0", "url": a.url}, {"id": "a1", "url": b.url}]}


def _chunk_status(url: str, token: str, version: int) -> int:
    async def get():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/v1/versions/{version}/chunks/0",
                             headers={"Authorization": f"Bearer {token}"}) as r:
                return r.status

    return asyncio.run(get())


def _canonical(manifest: dict) -> bytes:
    return json.dumps({k: v for k, v in manifest.items() if k != "signature"}, sort_keys=True,
                      separators=(",", ":")).encode()


@pytest.mark.e2e
def test_an_actor_cannot_publish_a_version_the_others_accept(run):
    store, learner_key = run
    record = store.get_json(layout.RUN_JSON)
    assert _seed(learner_key) not in json.dumps(record)  # run.json is public: no private key in it
    secret = _token(learner_key, "a0")  # all that actor a0 holds besides the public key
    a, b = _receiver(store, "a0", secret), _receiver(store, "a1", _token(learner_key, "a1"))
    try:
        assert _poll_until(a, 0) and _poll_until(b, 0)
        genuine = store.get_json(layout.manifest_key(layout.policy_dir(0)))
        attacker_key = Ed25519PrivateKey.generate()  # the attacker's own

        def forge(version: int, signer) -> None:
            """What a malicious actor can do with its store access: its own weights, a manifest, LATEST."""
            data = b"\x00" * 64  # poisoned weights
            store.put(f"{layout.policy_dir(version)}/shard-0000.safetensors", data)
            body = {"format": "echo2-weights/1", "created_at": time.time(), "chunk_size": 1 << 20, "version": version,
                    "relay": _relay(a, b),
                    "files": [{"name": "shard-0000.safetensors", "kind": "shard", "size": len(data),
                               "sha256": sha256(data), "chunks": chunk_hashes(data, 1 << 20)}]}
            store.put_json(layout.manifest_key(layout.policy_dir(version)), signer(body))
            store.put_pointer(layout.LATEST, json.dumps({"version": version}).encode())

        forgeries = {
            # an HMAC under the token the actor holds (the old scheme signed with a secret actors shared)
            1: lambda m: {**m, "signature": hmac.new(secret.encode(), _canonical(m), hashlib.sha256).hexdigest()},
            2: lambda m: sign(m, attacker_key),  # an Ed25519 key of its own
            3: lambda m: {**m, "signature": genuine["signature"]},  # a genuine signature, lifted
            4: lambda m: m,  # unsigned
            5: lambda m: {**genuine, "version": m["version"], "files": m["files"]},  # the learner's manifest, altered
        }
        for version, signer in forgeries.items():
            forge(version, signer)
            for _ in range(5):
                assert a.poll() is None and b.poll() is None
                time.sleep(0.02)
            assert version in a.rejected and version in b.rejected, version
            assert a.current == b.current == 0
            # never relayed: a peer with a valid relay token gets nothing of it from either node
            for node in (a, b):
                assert version not in node.node.server.buffers
                assert _chunk_status(node.node.url, secret, version) == 404
        # the learner's next version still goes through, relayed from a to b
        publish_version(store, 6, {"w": torch.ones(8)}, extra_files={}, shard_mb=1, key=learner_key,
                        meta={"relay": _relay(a, b)})
        got_a, got_b = _poll_until(a, 6), _poll_until(b, 6)
        assert got_a.files() == got_b.files()
    finally:
        a.close()
        b.close()


def test_an_actor_is_started_with_its_own_relay_token_and_never_the_signing_key(run, tmp_path, monkeypatch):
    store, key = run
    monkeypatch.setenv(KEY_ENV, _seed(key))  # a learner that got its key from the environment
    actor_id, env, log_text = env_of_a_launched_actor(store, key, tmp_path, (KEY_ENV, RELAY_TOKEN_ENV))
    assert env[KEY_ENV] is None and RelayAuth(key.public_key(), "r1").actor_of(env[RELAY_TOKEN_ENV]) == actor_id
    assert _seed(key) not in log_text


def test_a_relay_token_speaks_for_one_actor_of_one_run_until_it_expires():
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    auth = RelayAuth(key.public_key(), "r1")
    token = _token(key, "a0")
    assert auth.actor_of(token) == "a0"
    prefix, claim, signature = token.split(".")
    swapped = mint(other, "r1", "a1", time.time() + 3600).split(".")[1]  # another actor's claim, a0's signature
    refused = {
        "signed by another key": mint(other, "r1", "a0", time.time() + 3600),
        "of another run": _token(key, "a0", run_id="r2"),
        "expired": _token(key, "a0", hours=-1),
        "claim swapped": f"{prefix}.{swapped}.{signature}",
        "truncated": token[:-4],
        "no prefix": f"x.{claim}.{signature}",
        "garbage": "not a token at all",
        "huge": "e2rt1." + "A" * 100_000 + ".x",
    }
    for what, bad in refused.items():
        with pytest.raises(TokenRefused) as caught:
            auth.actor_of(bad)
        assert bad not in str(caught.value) and token not in str(caught.value), what  # reasons never echo a token


def test_a_revoked_actor_is_refused_by_peers_from_the_version_that_revokes_it(run, caplog):
    store, key = run
    tokens = {a: _token(key, a) for a in ("a0", "a1")}
    a = _receiver(store, "a0", tokens["a0"])
    try:
        _poll_until(a, 0)
        assert _chunk_status(a.node.url, tokens["a1"], 0) == 200
        # the learner revokes a1 (reclaimed, or found dishonest) in its next signed manifest
        publish_version(store, 1, {"w": torch.ones(8)}, extra_files={}, shard_mb=1, key=key, meta={"revoked": ["a1"]})
        _poll_until(a, 1)
        assert _chunk_status(a.node.url, tokens["a1"], 1) == 401 and _chunk_status(a.node.url, tokens["a0"], 1) == 200
        # a forged manifest cannot un-revoke it: it is rejected, and the signed list stays in force
        store.put_json(layout.manifest_key(layout.policy_dir(2)), {**store.get_json(layout.manifest_key(
            layout.policy_dir(1))), "version": 2, "revoked": []})
        store.put_pointer(layout.LATEST, json.dumps({"version": 2}).encode())
        for _ in range(5):
            a.poll()
        assert 2 in a.rejected and _chunk_status(a.node.url, tokens["a1"], 1) == 401
        assert a.node.server.refusals == 2
        assert "a1 is revoked" in caplog.text and tokens["a1"] not in caplog.text
    finally:
        a.close()


def test_a_resumed_learners_lower_numbered_version_revokes_at_once(run):
    """After a resume the new timeline publishes numbers below the newest an adopted actor saw: its revocations (an
    actor the resume could not adopt) must hold from its first version, not once it passes the dead learner's."""
    from echo2.data.run_folder import orphan_after

    store, key = run
    tokens = {a: _token(key, a) for a in ("a0", "a1")}
    a = _receiver(store, "a0", tokens["a0"])
    try:
        for version in (1, 2):  # the dead learner's versions, nobody revoked
            publish_version(store, version, {"w": torch.full((8,), float(version))}, extra_files={}, shard_mb=1,
                            key=key)
            _poll_until(a, version)
        assert _chunk_status(a.node.url, tokens["a1"], 2) == 200
        orphan_after(store, 0)  # the resume from step 0 moves v1 and v2 aside; the new v1 revokes a1
        publish_version(store, 1, {"w": torch.full((8,), -1.0)}, extra_files={}, shard_mb=1, key=key,
                        meta={"revoked": ["a1"]})
        store.put_pointer(layout.LATEST, json.dumps({"version": 1}).encode())
        _poll_until(a, 1)
        assert _chunk_status(a.node.url, tokens["a1"], 1) == 401 and _chunk_status(a.node.url, tokens["a0"], 1) == 200
    finally:
        a.close()


def test_the_fleet_revokes_every_actor_that_ended_or_was_retired(tmp_path):
    from fleet_shared import FakeCloud, manager

    from echo2.fleet.backends.base import ActorState, ActorStatus

    cloud = FakeCloud()
    fleet, _ = manager(tmp_path, cloud, actors=2)
    fleet.start()
    first, second = (s.actor_id for s in fleet.slots)
    cloud.states[first] = ActorStatus(ActorState.RECLAIMED, "spot")
    fleet.reconcile()
    assert fleet.revoked == {first}
    kept, retired = (s.actor_id for s in fleet.slots)
    fleet.resize(1, "test")  # the newest goes
    assert fleet.revoked == {first, retired} and [s.actor_id for s in fleet.slots] == [kept]
    fleet.stop()
    assert fleet.revoked == {spec.actor_id for spec in cloud.launched} == {first, second, retired}


# -- Task B: what a manifest may name --------------------------------------------------------------

BAD_NAMES = ["../x", "/etc/x", "a/b", "a\\b", "..", ".", ".hidden", "", "x" * 129, "a..b", "ok\n", "tab\t", "é", 7,
             None]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_manifest_naming_anything_but_a_plain_file_is_refused(name):
    entry = {"name": name, "kind": "aux", "size": 0, "chunks": []}
    with pytest.raises(ManifestRejected, match="outside its folder"):
        check_manifest({"files": [entry]})


def test_file_names_are_unique_of_a_known_kind_in_a_file_list():
    ok = {"name": "model.safetensors.index.json", "kind": "aux"}
    assert check_manifest({"files": [ok, {"name": "shard-0000.safetensors", "kind": "shard"}]})
    for manifest, reason in (({"files": [ok, ok]}, "twice"), ({"files": [{**ok, "kind": "exec"}]}, "unknown kind"),
                             ({"files": "x"}, "no file list"), ({}, "no file list"), ({"files": [3]}, "not an object"),
                             ([], "not an object")):
        with pytest.raises(ManifestRejected, match=reason):
            check_manifest(manifest)


def test_the_learner_never_writes_a_file_outside_its_folder(tmp_path):
    store = open_store(str(tmp_path / "store"))
    with pytest.raises(ValueError, match="not a plain file name"):
        write_weights(store, layout.policy_dir(1), {"w": torch.zeros(2)}, extra_files={"../x": b"x"}, shard_mb=1,
                      meta={})
    assert store.list() == []


@pytest.mark.parametrize("escape", ["../x", "ABS"])
def test_a_signed_manifest_naming_a_path_outside_is_refused_by_receiver_export_and_checkpoints(run, tmp_path, escape):
    """The learner's own key signs it (defense in depth: the learner is not the attacker here)."""
    from typer.testing import CliRunner

    from echo2.cli import app
    from echo2.learner.checkpoint import load_checkpoint

    store, key = run
    name = str(tmp_path / "escaped") if escape == "ABS" else escape
    data = b'{"evil": true}'
    manifest = sign({"format": "echo2-weights/1", "created_at": time.time(), "chunk_size": 1 << 20, "version": 1,
                     "files": [{"name": name, "kind": "aux", "size": len(data), "sha256": sha256(data),
                                "chunks": chunk_hashes(data, 1 << 20)}]}, key)
    receiver = _receiver(store, "a0", _token(key, "a0"))
    try:
        _poll_until(receiver, 0)
        if escape == "ABS":
            store.put(f"{layout.policy_dir(1)}/escaped", data)  # where a careless reader might look
        store.put_json(layout.manifest_key(layout.policy_dir(1)), manifest)
        store.put_json(layout.manifest_key(layout.checkpoint_dir(1)), {**manifest, "step": 1})
        store.put_pointer(layout.LATEST, json.dumps({"version": 1}).encode())
        for _ in range(5):
            assert receiver.poll() is None
        assert 1 in receiver.rejected and 1 not in receiver.node.server.buffers
    finally:
        receiver.close()

    out = tmp_path / "out" / "model"
    for args in ([], ["--step", "1"]):  # LATEST (the policy version) and the checkpoint of step 1
        result = CliRunner().invoke(app, ["export", store.url, str(out), *args])
        assert result.exit_code == 2, result.output
        assert result.output.count("\n") == 1 and "outside its folder" in result.output
    assert not out.exists() and not (tmp_path / "out" / "x").exists() and not (tmp_path / "escaped").exists()

    with pytest.raises(ManifestRejected, match="outside its folder"):
        load_checkpoint(store, 1, key.public_key())
