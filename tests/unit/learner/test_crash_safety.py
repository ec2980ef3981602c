"""What the learner writes survives being killed at any moment (issue: the foundation holds)."""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import commit_rollouts, put_glacier

from echo2.data import layout
from echo2.data.rollouts import RolloutLimits
from echo2.data.store import AlreadyExists, open_store
from echo2.data.weights import download, publish_version, write_weights
from echo2.learner.checkpoint import load_checkpoint, save_checkpoint
from echo2.learner.collector import RolloutCollector

LIMITS = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                       reward_range=(0.0, 1.0))


def test_a_folder_a_killed_writer_left_without_manifest_is_rewritten(tmp_path):
    store = open_store(str(tmp_path))
    # what a learner killed mid-publish leaves: a shard (maybe truncated), no manifest
    store.put(f"{layout.policy_dir(3)}/shard-0000.safetensors", b"half a shard")
    store.put(f"{layout.policy_dir(3)}/shard-0007.safetensors", b"a shard of another layout")
    manifest = publish_version(store, 3, {"w": torch.arange(4.0)}, extra_files={"config.json": b"{}"}, shard_mb=1)
    assert store.get_json(layout.LATEST) == {"version": 3}
    names = {f["name"] for f in manifest["files"]}
    assert store.list(layout.policy_dir(3) + "/") == sorted(f"{layout.policy_dir(3)}/{n}"
                                                            for n in names | {"manifest.json"})
    download(store, layout.policy_dir(3), tmp_path / "out")  # every byte verifies against the manifest
    # a committed folder is immutable
    with pytest.raises(AlreadyExists):
        write_weights(store, layout.policy_dir(3), {"w": torch.zeros(4)}, extra_files={}, shard_mb=1, meta={})


class _Payload:
    """A pickle that runs code when loaded (what an attacker with store access would write)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_checkpoint_never_unpickles_code(tmp_path):
    """Even one the run's key signed (defense in depth: an unsigned one is refused before any file is read):
    neither its RNG file nor DCP's pickled metadata may run code when loaded."""
    from echo2.data.manifest import sign
    from echo2.data.weights import CorruptWeights, read_manifest, sha256
    from echo2.learner.checkpoint import checkpoint_weights
    from echo2.learner.checkpoint_files import save_sharded, store_name

    store = open_store(str(tmp_path / "store"))
    key = Ed25519PrivateKey.generate()
    save_checkpoint(store, 5, lambda s, prefix: save_sharded(s, prefix, {"model": {"w": torch.ones(2)}}, file_mb=1),
                    {"settled": []}, extra_files={}, key=key)
    loaded = load_checkpoint(store, 5, key.public_key(), lambda c: checkpoint_weights(store, c))
    assert loaded.rng["torch_rng"].dtype == torch.uint8  # a real one loads

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"torch_rng": _Payload(marker)}, buf, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    for step, name, data, refusal in ((6, "rng.pt", buf.getvalue(), pickle.UnpicklingError),
                                      (7, store_name(".metadata"), pickle.dumps(_Payload(marker)), CorruptWeights)):
        # a consistent folder (sizes and hashes match, signed): only the loaders stand in the way
        manifest = read_manifest(store, layout.checkpoint_dir(5))
        for entry in manifest["files"]:
            content = data if entry["name"] == name else store.get(f"{layout.checkpoint_dir(5)}/{entry['name']}")
            entry.update(size=len(content), sha256=sha256(content))
            store.put(f"{layout.checkpoint_dir(step)}/{entry['name']}", content)
        store.put_json(layout.manifest_key(layout.checkpoint_dir(step)), sign({**manifest, "step": step}, key))
        with pytest.raises(refusal):
            load_checkpoint(store, step, key.public_key(), lambda c: checkpoint_weights(store, c))
    assert not marker.exists()


def test_files_chosen_by_an_unfinished_step_are_used_again_after_resume(tmp_path):
    store = open_store(str(tmp_path))
    keys = [commit_rollouts(store, 0, i) for i in range(3)]
    col = RolloutCollector(store, run_id="run", staleness=2, groups_per_step=2, limits=LIMITS)
    first = col.collect(step=1, learner_version=0, timeout_s=5)
    col.settle(first)
    second = col.collect(step=2, learner_version=1, timeout_s=5)
    assert [u["key"] for u in first.used] == keys[:1] and [u["key"] for u in second.used] == keys[1:2]
    # killed before step 2 trained: the checkpoint holds what completed steps settled
    assert col.settled == {keys[0]}
    resumed = RolloutCollector(store, run_id="run", staleness=2, groups_per_step=2, limits=LIMITS,
                               settled=col.settled, used_hashes=col.used_hashes)
    store.move(layout.consumed_key(2), "orphaned/1/" + layout.consumed_key(2))  # what resume does
    again = resumed.collect(step=2, learner_version=1, timeout_s=5)
    assert [u["key"] for u in again.used] == keys[1:2]


def test_a_quarantine_of_an_unfinished_step_is_recorded_again_after_resume(tmp_path):
    store = open_store(str(tmp_path))
    bad = commit_rollouts(store, 0, 0, data=b"garbage")
    good = commit_rollouts(store, 0, 1)
    col = RolloutCollector(store, run_id="run", staleness=2, groups_per_step=2, limits=LIMITS)
    sel = col.collect(step=1, learner_version=0, timeout_s=5)
    assert [q["key"] for q in sel.quarantined] == [bad]
    store.move(layout.consumed_key(1), "orphaned/1/" + layout.consumed_key(1))  # killed; resume moved it aside
    resumed = RolloutCollector(store, run_id="run", staleness=2, groups_per_step=2, limits=LIMITS)
    again = resumed.collect(step=1, learner_version=0, timeout_s=5)
    assert [q["key"] for q in again.quarantined] == [bad] and "Arrow" in again.quarantined[0]["reason"]
    assert [u["key"] for u in again.used] == [good]


def test_resume_sets_an_unreadable_file_of_the_lost_timeline_aside_unread(s3_store):
    """Resume's orphan move copies server-side; a rollout file the store can neither read nor copy (an
    actor wrote it as GLACIER) is quarantined by reference and recorded once by the next learner."""
    from echo2.data.run_folder import orphan_after

    kept = commit_rollouts(s3_store, 1, 0)
    lost = commit_rollouts(s3_store, 2, 0, actor="b")
    glacier = layout.rollout_key(2, "a", 1)
    put_glacier(s3_store, glacier, b"rows of a lost timeline")
    manifest = layout.manifest_key(layout.policy_dir(2))
    s3_store.put(manifest, b"{}")
    moved = orphan_after(s3_store, 1)  # the checkpoint is step 1: version 2 belongs to the lost timeline
    assert sorted(moved) == sorted([lost, manifest])
    assert [k.split("/", 2)[2] for k in s3_store.list(layout.ORPHANED)] == sorted([manifest, lost])
    assert s3_store.exists(glacier) and not s3_store.exists(lost)
    record = s3_store.get_json(layout.quarantine_reason_key(glacier))
    assert record["by_reference"] is True and "resume from step 1" in record["reason"]
    col = RolloutCollector(s3_store, run_id="run", staleness=2, groups_per_step=2, limits=LIMITS)
    sel = col.collect(step=2, learner_version=1, timeout_s=30)
    assert [q["key"] for q in sel.quarantined] == [glacier] and [u["key"] for u in sel.used] == [kept]


def test_no_rollouts_is_not_retried_as_a_store_hiccup():
    """The flow retried TimeoutError as transient (it is an OSError): 4x the configured timeout. The collect
    task now retries nothing (the store layer owns store retries: tests/e2e/test_flow_retries.py)."""
    from echo2.flows.train import collect_rollouts

    assert collect_rollouts.retries == 0 and collect_rollouts.retry_condition_fn is None


def test_resume_refuses_a_missing_or_different_key_and_actor_visible_overrides(tmp_path, monkeypatch):
    from echo2.config import Config
    from echo2.data.run_folder import create_run
    from echo2.data.run_key import run_key
    from echo2.errors import Echo2InputError
    from echo2.launch import resume_config

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv("ECHO2_RUN_KEY", raising=False)
    runs = open_store(str(tmp_path / "store")).child("runs")
    config = Config.model_validate({"run": {"id": "r1"}}).model_dump(mode="json")
    create_run(runs.child("r1"), "r1", config, key=run_key("r1", create=True), echo2_version="test")

    assert resume_config(runs, "r1", ["train.max_steps=40"]).train.max_steps == 40
    with pytest.raises(Echo2InputError, match="rollout.temperature") as err:
        resume_config(runs, "r1", ["rollout.temperature=0.5"])
    assert "\n" not in str(err.value)
    key_file = tmp_path / "secrets" / "r1.key"
    key_file.rename(tmp_path / "elsewhere.key")
    with pytest.raises(Echo2InputError, match=str(key_file)):
        resume_config(runs, "r1", [])
    key_file.write_text("not the run's key")
    with pytest.raises(Echo2InputError, match="restore the secrets file"):
        resume_config(runs, "r1", [])
    key_file.write_text("ab" * 32)  # a well-formed Ed25519 seed, but another key
    with pytest.raises(Echo2InputError, match="restore the secrets file") as err:
        resume_config(runs, "r1", [])
    assert str(key_file) in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "elsewhere.key").rename(key_file)
    assert resume_config(runs, "r1", []).run.id == "r1"
    record = json.loads(runs.child("r1").get("run.json"))
    assert record["key_fingerprint"] and record["public_key"].startswith("ed25519:")
    assert key_file.read_text() not in json.dumps(record)  # run.json carries the public key only
    # a run from before Ed25519-signed versions: its actors could not check what a resumed learner signs
    from echo2.data.run_folder import check_run_key

    with pytest.raises(Echo2InputError, match="HMAC key.*start a new run"):
        check_run_key({k: v for k, v in record.items() if k != "public_key"}, run_key("r1"))
