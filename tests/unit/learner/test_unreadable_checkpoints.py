"""An object under a prefix only the learner writes (``checkpoints/``, ``policy/``, ``ledger/consumed/``)
that the store refuses to return or copy (S3's GLACIER storage class: HEAD answers, GET and CopyObject
are refused with 403) must not stop a resume or a checkpoint save (issue 18, item 1): whoever can write
there (IAM should deny it; the learner does not rely on that) could otherwise deny every resume of the
run. On moto's S3 server, the objects planted as an actor's own credentials can: a PutObject with
``StorageClass=GLACIER``. The checkpoints are the project's own (``save_checkpoint``, the run's key)."""

from __future__ import annotations

import errno
import logging

import torch
from botocore.exceptions import ClientError
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import put_glacier

from echo2.data import layout
from echo2.data.run_folder import orphan_after
from echo2.data.store import is_unreadable_object
from echo2.learner.checkpoint import checkpoint_weights, newest_checkpoint, save_checkpoint, verified_steps
from echo2.learner.checkpoint_files import save_sharded, store_name


def save(store, step: int, key: Ed25519PrivateKey, fill: float = 1.0) -> None:
    state = {"model": {"model.embed_tokens.weight": torch.full((4, 4), fill)}}
    save_checkpoint(store, step, lambda s, prefix: save_sharded(s, prefix, state, file_mb=1),
                    {"history": [], "evals": {}, "wall_seconds": 0.0}, key=key, extra_files={})


def newest(store, key: Ed25519PrivateKey):
    """The newest checkpoint whose weights load (every file read verified), and its weights."""
    loaded = {}
    ckpt = newest_checkpoint(store, key.public_key(), lambda c: loaded.update(checkpoint_weights(store, c)))
    return ckpt, loaded


def test_resume_goes_on_past_unreadable_planted_objects_and_deletes_them(s3_store, caplog):
    key = Ed25519PrivateKey.generate()
    save(s3_store, 1, key)
    save(s3_store, 3, key)
    # step 3 is the learner's, but one of its files was replaced by one the store will not return
    shard = layout.checkpoint_dir(3) + "/" + store_name("__0_0.distcp")
    put_glacier(s3_store, shard, b"not the shard")
    planted = [layout.manifest_key(layout.checkpoint_dir(999999)), layout.checkpoint_dir(999999) + "/model.safetensors",
               layout.manifest_key(layout.policy_dir(999999)), layout.consumed_key(999999)]
    for k in planted:
        put_glacier(s3_store, k, b"{}")

    ckpt, _ = newest(s3_store, key)  # raised PermissionError before the fix
    assert ckpt is not None and ckpt.step == 1
    assert verified_steps(s3_store, key.public_key()) == [1, 3]  # a manifest that does not answer is not verified

    with caplog.at_level(logging.ERROR, logger="echo2.data"):
        moved = orphan_after(s3_store, 1)  # raised OSError (ObjectNotInActiveTierError) before the fix
    unmovable = planted + [shard]
    for k in unmovable:
        assert not s3_store.exists(k), k
        assert k not in moved
        record = s3_store.get_json(next(r for r in s3_store.list(layout.ORPHANED) if r.endswith(k + ".deleted.json")))
        assert record["key"] == k and "Glacier" in record["error"]  # CopyObject's ObjectNotInActiveTierError
        assert sum(f"deleted {k} " in r.getMessage() for r in caplog.records) == 1, k
    # step 3's other files were the learner's: moved aside, kept for inspection
    assert layout.manifest_key(layout.checkpoint_dir(3)) in moved
    assert s3_store.list(layout.CHECKPOINTS) == s3_store.list(layout.checkpoint_dir(1) + "/")
    # the new timeline can write the keys the planted objects held
    save(s3_store, 3, key, fill=2.0)
    assert newest(s3_store, key)[0].step == 3


def test_saving_a_step_deletes_an_unreadable_planted_folder_of_that_step(s3_store, caplog):
    key = Ed25519PrivateKey.generate()
    save(s3_store, 1, key)
    planted = [layout.manifest_key(layout.checkpoint_dir(2)), layout.checkpoint_dir(2) + "/model.safetensors"]
    for k in planted:
        put_glacier(s3_store, k, b"{}")
    with caplog.at_level(logging.ERROR):
        save(s3_store, 2, key, fill=5.0)  # raised PermissionError (reading the planted manifest) before the fix
    ckpt, weights = newest(s3_store, key)
    assert ckpt.step == 2 and torch.equal(weights["model.embed_tokens.weight"], torch.full((4, 4), 5.0))
    for k in planted:
        assert sum(f"deleted {k} " in r.getMessage() for r in caplog.records) == 1, k


def test_a_refusal_of_the_credentials_is_not_an_unreadable_object():
    """Only an answer about the object deletes it (``set_aside`` lets anything else propagate): AccessDenied
    (a learner role that lost a permission) would refuse the learner's own checkpoints too, and a local
    file's PermissionError is about the process's rights."""

    def translated(status: int, code: str, cls=OSError) -> OSError:
        exc = cls(errno.EIO, code) if cls is OSError else cls(code)
        exc.__cause__ = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")
        return exc

    assert is_unreadable_object(translated(403, "InvalidObjectState", PermissionError))
    assert is_unreadable_object(translated(403, "ObjectNotInActiveTierError"))
    assert is_unreadable_object(translated(400, "InvalidRequest"))  # encrypted with a customer key (SSE-C)
    assert not is_unreadable_object(translated(403, "AccessDenied", PermissionError))
    assert not is_unreadable_object(translated(403, "ExpiredToken", PermissionError))
    assert not is_unreadable_object(translated(404, "NoSuchKey", FileNotFoundError))
    assert not is_unreadable_object(translated(503, "SlowDown"))
    assert not is_unreadable_object(PermissionError(errno.EACCES, "Permission denied"))
