"""A checkpoint's pickled DCP metadata never runs code (``learner/checkpoint_files.py``, ``_MetadataUnpickler``), and
``echo2 export`` / ``echo2 eval`` refuse a checkpoint only the store's own ``run.json`` key verifies unless told
(``cli/export.py``).

The attack: whoever can write ``run.json`` and ``checkpoints/`` signs a checkpoint with a key of their own, whose
``dcp-metadata`` is a pickle that names ``os.system`` through a dotted name under an allowed module (pickle protocol 4
resolves ``torch.distributed.checkpoint.filesystem`` + ``os.system`` attribute by attribute). Its payload would create
a marker file; the marker must never appear."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from echo2.cli import app
from echo2.data import layout
from echo2.data.manifest import sign
from echo2.data.run_folder import create_run
from echo2.data.run_key import KEY_ENV
from echo2.data.store import open_store
from echo2.data.weights import CorruptWeights, read_manifest
from echo2.learner.checkpoint import export_checkpoint, save_checkpoint
from echo2.learner.checkpoint_files import METADATA, load_full, save_sharded, store_name


def _text(value: str) -> bytes:
    data = value.encode()
    return (b"\x8c" + bytes([len(data)]) + data) if len(data) < 256 else (b"X" + struct.pack("<I", len(data)) + data)


def payload(command: str) -> bytes:
    """Protocol 4: STACK_GLOBAL of (an allowed module, a dotted name reaching ``os.system``), called on ``command``."""
    return (b"\x80\x04" + _text("torch.distributed.checkpoint.filesystem") + _text("os.system") + b"\x93"
            + _text(command) + b"\x85R.")


def _planted(tmp_path, key: Ed25519PrivateKey):
    """A run whose ``run.json`` and checkpoint 3 are signed with ``key`` (the attacker's), the checkpoint's
    metadata replaced by the payload and its manifest signed again to match."""
    store = open_store(str(tmp_path / "store" / "runs" / "planted"))
    create_run(store, "planted", {}, key=key, echo2_version="test")
    tensors = {"model.embed_tokens.weight": torch.full((4, 4), 7.0)}
    save_checkpoint(store, 3, lambda s, prefix: save_sharded(s, prefix, {"model": tensors}, file_mb=1),
                    {"history": [], "evals": {}, "wall_seconds": 0.0}, key=key, extra_files={})
    prefix = layout.checkpoint_dir(3)
    marker = tmp_path / "marker"
    evil = payload(f"touch {marker}")
    store.put(f"{prefix}/{store_name(METADATA)}", evil, if_absent=False)
    manifest = read_manifest(store, prefix, key.public_key())
    for entry in manifest["files"]:
        if entry["name"] == store_name(METADATA):
            entry.update(size=len(evil), sha256=hashlib.sha256(evil).hexdigest())
    manifest = sign({k: v for k, v in manifest.items() if k != "signature"}, key)
    store.put_json(layout.manifest_key(prefix), manifest, if_absent=False)
    return store, marker


def test_the_payload_is_refused_and_never_run(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv(KEY_ENV, raising=False)
    attacker = Ed25519PrivateKey.generate()
    store, marker = _planted(tmp_path, attacker)
    with pytest.raises(CorruptWeights) as refused:  # what export and eval run for a checkpoint
        export_checkpoint(store, 3, tmp_path / "out", attacker.public_key())
    assert not marker.exists(), "the checkpoint's metadata ran code"
    assert "may not name torch.distributed.checkpoint.filesystem.os.system" in str(refused.value)
    entries = {e["name"]: e for e in read_manifest(store, layout.checkpoint_dir(3), attacker.public_key())["files"]}
    with pytest.raises(CorruptWeights):
        load_full(store, layout.checkpoint_dir(3), entries, {"model"})
    assert not marker.exists(), "the checkpoint's metadata ran code"


def test_export_and_eval_refuse_a_checkpoint_only_run_json_vouches_for(tmp_path, monkeypatch):
    """No key of the run here: one line naming the flag, exit 2, no folder; with the flag the metadata is still
    refused by the unpickler, in one line, and nothing runs."""
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv(KEY_ENV, raising=False)
    store, marker = _planted(tmp_path, Ed25519PrivateKey.generate())
    runner = CliRunner()
    refused = runner.invoke(app, ["export", store.url, str(tmp_path / "out"), "--step", "3"])
    assert refused.exit_code == 2 and "--trust-run-json-key" in refused.output, refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    told = runner.invoke(app, ["export", store.url, str(tmp_path / "out"), "--step", "3", "--trust-run-json-key"])
    assert told.exit_code == 2 and "may not name" in told.output and not (tmp_path / "out").exists()
    evaluated = runner.invoke(app, ["eval", f"{store.url}/{layout.checkpoint_dir(3)}", "--task", "arithmetic"])
    assert evaluated.exit_code == 2 and "--trust-run-json-key" in evaluated.output, evaluated.output
    assert not marker.exists()
