"""Checkpoints and run.json are the learner's own (issue 18, item 3): anyone else who can write to the
store (an actor whose credentials are wider than infra/iam/ allows) cannot make a learner resume from,
or ``echo2 export`` hand out, weights the run's learner did not write, nor stop an honest resume.

A real learner (LearnerRun, the tiny model, a local store) writes its checkpoints; the folders an
attacker plants are written with the project's own writer, signed with another key or not at all."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from signed_checkpoints_shared import RUN, export, learner_run, train_to

from echo2.data import layout
from echo2.data.run_folder import RunRecordRejected, create_run
from echo2.data.run_key import KEY_ENV, MissingRunKey
from echo2.data.store import open_store
from echo2.data.weights import read_manifest, write_weights
from echo2.launch import resume_config
from echo2.learner.checkpoint import checkpoint_steps, save_checkpoint
from echo2.learner.checkpoint_files import save_sharded


@pytest.fixture
def key_here(tmp_path, monkeypatch):
    """The learner's key in a secrets folder of this test (the run's key file, as on the learner's machine)."""
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv(KEY_ENV, raising=False)


def plant(store, step: int, *, key: Ed25519PrivateKey | None) -> None:
    """A complete checkpoint folder with other weights: signed with ``key`` (not the run's), or unsigned."""
    tensors = {"model.embed_tokens.weight": torch.full((4, 4), 7.0)}
    if key is not None:
        save_checkpoint(store, step, lambda s, prefix: save_sharded(s, prefix, {"model": tensors}, file_mb=1),
                        {"history": [], "evals": {}, "wall_seconds": 0.0}, key=key, extra_files={})
    else:
        write_weights(store, layout.checkpoint_dir(step), tensors, shard_mb=1, meta={"step": step},
                      extra_files={"trainer_state.json": b'{"step": %d}' % step})


def replay(store, src: int, dst: int) -> None:
    """The run's own signed checkpoint ``src``, copied file by file into folder ``dst``."""
    for key in store.list(layout.checkpoint_dir(src) + "/"):
        store.put(key.replace(layout.checkpoint_dir(src), layout.checkpoint_dir(dst)), store.get(key))


def test_planted_checkpoints_are_never_loaded_nor_exported_and_do_not_stop_the_run(tiny_model, tmp_path, key_here,
                                                                                     caplog):
    run = learner_run(tiny_model, tmp_path, resume=False, keep_checkpoints=1)
    store = run.store
    train_to(run, 2)
    # planted while the run goes on: a folder at the step it will checkpoint next (its write would fail
    # with AlreadyExists), and far ahead (with keep_checkpoints=1 it would push out the real one)
    plant(store, 4, key=None)
    plant(store, 999_999, key=Ed25519PrivateKey.generate())
    train_to(run, 4)
    honest = {k: v.clone() for k, v in run.learner.full_tensors().items()}
    assert checkpoint_steps(store) == [4, 999_999]  # the run's step 4 took the planted one's place; 2 was pruned
    assert any(k.startswith(layout.ORPHANED) and "step-000004/manifest.json" in k for k in store.list(layout.ORPHANED))
    run.sink.close()
    plant(store, 500_000, key=None)
    replay(store, 4, 700_000)  # the run's own signature, in a folder of another step

    out = tmp_path / "out"
    for step, reason in ((999_999, "not signed with the run's key"), (500_000, "not signed with the run's key"),
                         (700_000, "copied from another folder")):
        result = export(store, out, "--step", str(step))
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert f"step-{step:06d}" in result.output and reason in result.output
        assert not out.exists()
    assert export(store, out, "--step", "4").exit_code == 0  # the run's own exports

    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="echo2.learner"):
        resumed = learner_run(tiny_model, tmp_path, resume=True, keep_checkpoints=1)
    assert resumed.step == 4
    weights = resumed.learner.full_tensors()
    assert all(torch.equal(weights[k], honest[k]) for k in honest)
    skipped = [r.getMessage() for r in caplog.records if "is not loaded" in r.getMessage()]
    assert all("\n" not in m for m in skipped)  # one line per folder passed over
    assert sorted(int(m.split()[2]) for m in skipped) == [500_000, 700_000, 999_999]
    assert checkpoint_steps(store) == [4]  # the planted folders went to orphaned/ with the lost timeline
    assert sum(k.endswith("/manifest.json") for k in store.list(layout.ORPHANED)) == 4
    resumed.sink.close()


def test_a_tampered_checkpoint_file_is_refused_and_resume_uses_the_one_before(tiny_model, tmp_path, key_here, caplog):
    run = learner_run(tiny_model, tmp_path, resume=False, keep_checkpoints=2)
    train_to(run, 2)
    at_2 = {k: v.clone() for k, v in run.learner.full_tensors().items()}  # (views of the live weights)
    train_to(run, 4)
    run.sink.close()
    store = run.store
    manifest = read_manifest(store, layout.checkpoint_dir(4))
    shard = next(e["name"] for e in manifest["files"] if e["kind"] == "shard")
    key = f"{layout.checkpoint_dir(4)}/{shard}"
    data = bytearray(store.get(key))
    data[-1] ^= 1  # one bit of a weight, same size
    store.put(key, bytes(data), if_absent=False)

    result = export(store, tmp_path / "out", "--step", "4")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "does not match its manifest" in result.output
    assert not (tmp_path / "out").exists()  # not a folder of the files that did verify either

    with caplog.at_level(logging.ERROR, logger="echo2.learner"):
        resumed = learner_run(tiny_model, tmp_path, resume=True, keep_checkpoints=2)
    assert resumed.step == 2
    assert all(torch.equal(resumed.learner.full_tensors()[k], at_2[k]) for k in at_2)
    assert any("checkpoint step 4 is not loaded" in r.getMessage() and "does not match" in r.getMessage()
               for r in caplog.records)
    resumed.sink.close()


def test_a_run_json_swapped_or_altered_in_the_store_stops_the_resume(tiny_model, tmp_path, key_here):
    run = learner_run(tiny_model, tmp_path, resume=False)
    train_to(run, 2)
    run.sink.close()
    store, runs = run.store, open_store(str(tmp_path / "store")).child(layout.RUNS)
    original = store.get_json(layout.RUN_JSON)
    assert resume_config(runs, RUN, []).run.id == RUN  # the record the learner wrote resumes

    # another key's run.json (its public key and relay CA are what the run's actors would trust next)
    scratch = open_store(str(tmp_path / "scratch"))
    create_run(scratch, RUN, original["config"], key=Ed25519PrivateKey.generate(), echo2_version="test")
    store.put(layout.RUN_JSON, scratch.get(layout.RUN_JSON), if_absent=False)
    for attempt in (lambda: resume_config(runs, RUN, []), lambda: learner_run(tiny_model, tmp_path, resume=True)):
        with pytest.raises(MissingRunKey, match="run.json was replaced in the store") as err:
            attempt()
        assert "\n" not in str(err.value)
    result = export(store, tmp_path / "out", "--step", "2")
    assert result.exit_code == 2 and "run.json was replaced" in result.output and result.output.count("\n") == 1

    # the run's own public key kept, something else changed (a config the actors read, here)
    altered = json.loads(json.dumps(original))
    altered["config"]["rollout"]["temperature"] = 5.0
    store.put_json(layout.RUN_JSON, altered, if_absent=False)
    for attempt in (lambda: resume_config(runs, RUN, []), lambda: learner_run(tiny_model, tmp_path, resume=True)):
        with pytest.raises(RunRecordRejected, match="not the record its learner wrote") as err:
            attempt()
        assert "\n" not in str(err.value)
    # unsigned (an echo2 before signed run records wrote it, or someone stripped it)
    store.put_json(layout.RUN_JSON, {k: v for k, v in original.items() if k != "signature"}, if_absent=False)
    with pytest.raises(RunRecordRejected):
        resume_config(runs, RUN, [])

    store.put_json(layout.RUN_JSON, original, if_absent=False)
    resumed = learner_run(tiny_model, tmp_path, resume=True)
    assert resumed.step == 2
    resumed.sink.close()


def test_export_without_the_run_key_checks_weights_with_run_jsons_key(tiny_model, tmp_path, key_here, monkeypatch):
    """On a machine that does not hold the run key (an operator's laptop), what the run's actors trust."""
    run = learner_run(tiny_model, tmp_path, resume=False)
    train_to(run, 2)
    run.sink.close()
    plant(run.store, 999_999, key=Ed25519PrivateKey.generate())
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "elsewhere"))
    # a checkpoint only run.json's own key verifies is refused in one line unless the user says to trust it
    refused = export(run.store, tmp_path / "refused", "--step", "2")
    assert refused.exit_code == 2 and "--trust-run-json-key" in refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "refused").exists()
    assert export(run.store, tmp_path / "ok", "--step", "2", "--trust-run-json-key").exit_code == 0
    assert export(run.store, tmp_path / "ok2").exit_code == 0  # the latest policy version, signed too
    result = export(run.store, tmp_path / "bad", "--step", "999999", "--trust-run-json-key")
    assert result.exit_code == 2 and "not signed with the run's key" in result.output
    # a copy of the policy folder without run.json is no run: nothing to check its signatures with
    bare = open_store(str(tmp_path / "bare"))
    for key in run.store.list(layout.POLICY):
        bare.put(key, run.store.get(key))
    result = export(bare, tmp_path / "bare-out")
    assert result.exit_code == 2 and "no readable run.json" in result.output
