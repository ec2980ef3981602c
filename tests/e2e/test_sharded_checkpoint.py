"""Sharded checkpoints (issue 19, item 6): every rank writes its own shard of the weights and AdamW state with
torch.distributed.checkpoint, the signed manifest commits it, and it resumes on another rank count; a missing,
altered or added file is refused and resume falls back to the checkpoint before.

Real parts: the learner on the tiny model (one process, or 2 gloo ranks of torchrun running
tests/support/sharded_checkpoint_run.py), a local store and moto's S3, the project's own writer and reader."""

from __future__ import annotations

import copy
import json
import logging
import math
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load_file
from sharded_checkpoint_run import tables
from typer.testing import CliRunner

from echo2.cli import app
from echo2.config import TrainConfig
from echo2.data import layout
from echo2.data.manifest import sign
from echo2.data.run_folder import create_run
from echo2.data.store import open_store
from echo2.data.weights import CorruptWeights, publish_version, read_manifest
from echo2.learner.checkpoint import (
    checkpoint_steps,
    load_checkpoint,
    newest_checkpoint,
    save_checkpoint,
    verified_steps,
)
from echo2.learner.checkpoint_files import load_full, store_name
from echo2.learner.learner import Learner

SCRIPT = str(REPO / "tests" / "support" / "sharded_checkpoint_run.py")
ATOL = 1e-5
"""Weights after a step on 2 ranks and in one process agree to this (the ranks sum gradients in another order)."""
STATE = {"history": [], "evals": {}, "wall_seconds": 0.0}


def _hex(key: Ed25519PrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption()).hex()


def _launch(spec: dict, out, nproc: int) -> dict:
    out.mkdir(parents=True)
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps({**spec, "out": str(out)}))
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    proc = subprocess.run([*prefix, SCRIPT, str(spec_file)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def _flat(state, prefix="") -> dict:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    if isinstance(state, list):
        return {k: v for i, value in enumerate(state) for k, v in _flat(value, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): state}


def _everything(store, step: int, key) -> dict:
    """Weights and optimizer state of checkpoint ``step``, whole, read in this process (every file verified)."""
    ckpt = load_checkpoint(store, step, key.public_key())
    return _flat(load_full(store, ckpt.prefix, ckpt.entries, {"model", "optim"}))


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        assert same, k


def _close(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.e2e
def test_a_checkpoint_of_2_ranks_resumes_in_one_process_and_one_of_one_process_on_2_ranks(
        tiny_model, tmp_path, s3_store, monkeypatch):
    """The 2 ranks write to moto's S3 (each rank its own files), the others to local stores."""
    key = Ed25519PrivateKey.generate()
    s1 = s3_store
    s2, s3 = (open_store(str(tmp_path / name)) for name in ("s2", "s3"))
    create_run(s1, "r1", {}, key=key, echo2_version="test")  # run.json: export checks weights with its key
    spec = {"model": str(tiny_model), "key": _hex(key), "options": s1.options}

    # 2 ranks train 2 steps, checkpoint, take step 3
    two = _launch({**spec, "store": s1.url, "save_at": 2}, tmp_path / "two", 2)
    names = {e["name"] for e in read_manifest(s1, layout.checkpoint_dir(2))["files"]}
    assert {"dcp-0_0.distcp", "dcp-1_0.distcp", "dcp-metadata", "trainer_state.json", "rng.pt"} <= names
    # what each rank handed to DCP: its own shard of every weight and AdamW moment, never the whole
    handed = [json.loads((tmp_path / "two" / f"handed-{r}.json").read_text()) for r in (0, 1)]
    moments = [[h for h in rank if ".exp_avg" in h["key"]] for rank in handed]
    assert moments[0] and [h["key"] for h in moments[0]] == [h["key"] for h in moments[1]]
    for h0, h1 in zip(*moments):
        assert h0["dtensor"] and h0["global"] == h1["global"]
        whole = math.prod(h0["global"])
        assert math.prod(h0["local"]) + math.prod(h1["local"]) == whole  # a split, not two copies
        assert math.prod(h0["local"]) <= -(-h0["global"][0] // 2) * whole // h0["global"][0]

    # one process (this one) resumes it, writes the state it restored as a checkpoint of its own, takes step 3
    learner = _learner(tiny_model)
    resumed = newest_checkpoint(s1, key.public_key(), _restore(s1, learner))
    learner.version = resumed.step
    save_checkpoint(s2, resumed.step, learner.save_sharded, STATE, key=key, extra_files={})
    at_one = _weights(learner)
    one = {"world": 1, "resumed_from": resumed.step, "loss": learner.train_step(tables(3))["loss"]}
    after_one = _weights(learner)
    # a newer checkpoint of the run's own, signed, with one shard altered after signing: refused on 2 ranks
    forged = read_manifest(s2, layout.checkpoint_dir(2))
    forged["step"] = 4
    for entry in forged["files"]:
        s2.put(f"{layout.checkpoint_dir(4)}/{entry['name']}", s2.get(f"{layout.checkpoint_dir(2)}/{entry['name']}"))
    s2.put_json(layout.manifest_key(layout.checkpoint_dir(4)), sign(forged, key))
    shard = f"{layout.checkpoint_dir(4)}/{store_name('__0_1.distcp')}"
    data = bytearray(s2.get(shard))
    data[len(data) // 2] ^= 1
    s2.put(shard, bytes(data), if_absent=False)
    # 2 ranks resume the one-process checkpoint (step 4 refused), write theirs again, take step 3
    again = _launch({**spec, "store": s2.url, "options": {}, "resume": True, "resave": s3.url}, tmp_path / "again", 2)

    assert (two["world"], one["world"], again["world"]) == (2, 1, 2)
    assert one["resumed_from"] == again["resumed_from"] == 2
    saved = _everything(s1, 2, key)
    assert any(".exp_avg_sq" in k for k in saved) and any(k.endswith(".step") for k in saved)
    _assert_same(saved, _everything(s2, 2, key))  # restored on 1 process exactly as 2 ranks saved it
    _assert_same(saved, _everything(s3, 2, key))  # and on 2 ranks as 1 process saved it
    at = {run: load_file(tmp_path / run / "at_checkpoint.safetensors") for run in ("two", "again")}
    after = {run: load_file(tmp_path / run / "after.safetensors") for run in ("two", "again")}
    at["one"], after["one"] = at_one, after_one
    assert _close(at["two"], at["one"]) == 0.0 and _close(at["two"], at["again"]) == 0.0
    assert _close(after["two"], at["two"]) > 1e-4  # step 3 moved the weights
    worst = max(_close(after["two"], after["one"]), _close(after["two"], after["again"]))
    print(f"step 3 after resume, largest weight difference from the uninterrupted 2-rank run: {worst:.2e}")
    assert worst < ATOL and abs(two["loss"] - one["loss"]) < 1e-6 and abs(two["loss"] - again["loss"]) < 1e-6

    # echo2 export puts the 2 ranks' shards together: the weights at the checkpoint, loadable by transformers
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("ECHO2_STORE_OPTIONS", json.dumps(s1.options))
    result = CliRunner().invoke(app, ["export", s1.url, str(tmp_path / "export"), "--step", "2",
                                      "--trust-run-json-key"])  # this machine holds no key of the test's run
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert all(torch.equal(exported[k], v) for k, v in at["two"].items())
    assert not any(p.name.startswith(("dcp-", "rng", "trainer_state")) for p in (tmp_path / "export").iterdir())


def _learner(tiny_model, **train) -> Learner:
    torch.manual_seed(0)
    return Learner(tiny_model, TrainConfig(lr=1e-2, **train), temperature=1.0, shard_mb=1)


def _save(store, learner: Learner, key) -> None:
    save_checkpoint(store, learner.version, learner.save_sharded, STATE, key=key, extra_files=learner.extra_files)


def _restore(store, learner: Learner):
    return lambda ckpt: learner.load_sharded(store, ckpt.prefix, ckpt.entries)


def _weights(learner: Learner) -> dict:
    return {k: v.clone() for k, v in learner.full_tensors().items()}


def _missing(store, prefix: str) -> None:
    store.delete(f"{prefix}/{store_name('__0_0.distcp')}")


def _altered(store, prefix: str) -> None:
    key = f"{prefix}/{store_name('__0_1.distcp')}"  # the optimizer's file: the weights' would load first
    data = bytearray(store.get(key))
    data[-100] ^= 1
    store.put(key, bytes(data), if_absent=False)


def _added(store, prefix: str) -> None:
    store.put(f"{prefix}/{store_name('__1_0.distcp')}", store.get(f"{prefix}/{store_name('__0_0.distcp')}"))


@pytest.mark.parametrize("damage", [_missing, _altered, _added])
def test_a_missing_altered_or_added_shard_is_refused_and_resume_uses_the_checkpoint_before(
        tiny_model, tmp_path, damage, caplog):
    store, key = open_store(str(tmp_path / "store")), Ed25519PrivateKey.generate()
    learner = _learner(tiny_model)
    learner.train_step(tables(1))
    _save(store, learner, key)
    at_1, optim_1 = _weights(learner), copy.deepcopy(learner.optimizer.state_dict())  # (it holds live tensors)
    learner.train_step(tables(2))
    _save(store, learner, key)
    damage(store, layout.checkpoint_dir(2))

    fresh = _learner(tiny_model)
    initial = _weights(fresh)
    with pytest.raises(CorruptWeights) as err:  # refused before a single weight changed
        load_checkpoint(store, 2, key.public_key(), _restore(store, fresh))
    assert "\n" not in str(err.value) and "step-000002" in str(err.value)
    _assert_same(_weights(fresh), initial)
    assert not fresh.optimizer.state  # as fresh as it was: a resume that found nothing would start over cleanly
    with caplog.at_level(logging.ERROR, logger="echo2.learner"):
        ckpt = newest_checkpoint(store, key.public_key(), _restore(store, fresh))
    assert ckpt.step == 1 and any("checkpoint step 2 is not loaded" in r.getMessage() for r in caplog.records)
    _assert_same(_weights(fresh), at_1)
    _assert_same(_flat(fresh.optimizer.state_dict()), _flat(optim_1))
    assert verified_steps(store, key.public_key()) == [1, 2]  # its manifest is the run's: only its files are bad


def test_the_manifest_is_written_last_a_crash_before_it_leaves_no_checkpoint(tiny_model, tmp_path, monkeypatch):
    import echo2.learner.checkpoint as checkpoint

    store, key = open_store(str(tmp_path / "store")), Ed25519PrivateKey.generate()
    learner = _learner(tiny_model)
    learner.train_step(tables(1))
    _save(store, learner, key)
    learner.train_step(tables(2))

    def crash(name: str) -> None:
        raise KeyboardInterrupt(f"killed at failpoint {name}")

    monkeypatch.setattr(checkpoint, "failpoint", crash)  # where a SIGKILL of the failpoint tests lands
    with pytest.raises(KeyboardInterrupt):
        _save(store, learner, key)
    leftovers = store.list(layout.checkpoint_dir(2) + "/")
    assert (any(k.endswith(".distcp") for k in leftovers)
            and layout.manifest_key(layout.checkpoint_dir(2)) not in leftovers)
    assert checkpoint_steps(store) == [1]
    assert newest_checkpoint(store, key.public_key(), _restore(store, _learner(tiny_model))).step == 1
    monkeypatch.undo()
    _save(store, learner, key)  # the next attempt clears what the killed one left
    assert checkpoint_steps(store) == [1, 2]


class _Signal(BaseException):
    """What Prefect's SIGTERM handler raises (TerminationSignal): a BaseException, like KeyboardInterrupt."""


@pytest.mark.parametrize("raised", [_Signal("SIGTERM"), KeyboardInterrupt("Ctrl-C"), OSError("disk full")],
                         ids=["sigterm", "ctrl-c", "store-error"])
def test_what_interrupts_a_checkpoint_inside_dcp_comes_out_as_itself(tiny_model, tmp_path, monkeypatch, raised):
    """DCP wraps whatever a rank raises while it writes in its CheckpointException (itself a BaseException): a
    SIGTERM landing in a checkpoint used to reach the flow as a crash, not an interruption, so the run
    stopped without its final checkpoint (test_e2e's sigterm case, when the signal hit a periodic checkpoint)."""
    from echo2.learner.checkpoint_files import _StoreFiles

    store, key = open_store(str(tmp_path / "store")), Ed25519PrivateKey.generate()
    learner = _learner(tiny_model)
    learner.train_step(tables(1))

    def interrupted(self, key_, data):
        raise raised

    monkeypatch.setattr(_StoreFiles, "_put", interrupted)
    with pytest.raises(type(raised)) as caught:
        _save(store, learner, key)
    assert caught.value is raised
    monkeypatch.undo()
    _save(store, learner, key)  # and the next save commits
    assert checkpoint_steps(store) == [1]


def test_a_signal_under_a_clean_up_error_inside_dcp_still_comes_out_as_itself(tiny_model, tmp_path, monkeypatch):
    """A SIGTERM that lands inside ``torch.save``'s zip writer leaves the file half written, and the writer's
    ``__exit__`` raises over it ("unexpected pos 219 vs 0"), the signal only that error's context: the learner
    exited 1 (a crashed task) instead of 143 (test_e2e's sigterm case, 2026-12-03)."""
    from echo2.learner.checkpoint_files import _StoreFiles

    store, key = open_store(str(tmp_path / "store")), Ed25519PrivateKey.generate()
    learner = _learner(tiny_model)
    learner.train_step(tables(1))
    signal = _Signal("SIGTERM")

    def interrupted(self, key_, data):
        try:
            raise signal
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 219 vs 0")

    monkeypatch.setattr(_StoreFiles, "_put", interrupted)
    with pytest.raises(_Signal) as caught:
        _save(store, learner, key)
    assert caught.value is signal


def test_one_process_on_s3_and_lora(tiny_model, s3_store, tmp_path):
    """A one-process checkpoint on S3 (moto) resumes the weights and AdamW state exactly; a LoRA run keeps
    its adapter (the frozen base is not in the checkpoint) and exports the adapter merged into its base."""
    key = Ed25519PrivateKey.generate()
    learner = _learner(tiny_model)
    learner.train_step(tables(1))
    _save(s3_store, learner, key)
    fresh = _learner(tiny_model)
    assert newest_checkpoint(s3_store, key.public_key(), _restore(s3_store, fresh)).step == 1
    _assert_same(_weights(fresh), _weights(learner))
    _assert_same(_flat(fresh.optimizer.state_dict()), _flat(learner.optimizer.state_dict()))

    store = open_store(str(tmp_path / "run"))
    create_run(store, "r1", {}, key=key, echo2_version="test")
    lora = _learner(tiny_model, lora_rank=4)
    base, _ = lora.policy_version_tensors()  # version 0 of a LoRA run: the full base
    publish_version(store, 0, base, extra_files=lora.extra_files, shard_mb=64, key=key)
    lora.train_step(tables(1))
    save_checkpoint(store, 1, lora.save_sharded, STATE, key=key, extra_files=lora.extra_files,
                    meta={"weights": "lora", "base_version": 0, "lora_rank": 4, "lora_alpha": 32.0})
    saved = load_full(store, layout.checkpoint_dir(1), {e["name"]: e for e in read_manifest(
        store, layout.checkpoint_dir(1))["files"]}, {"model"})["model"]
    assert saved and all("lora_" in k for k in saved)  # the adapter alone: the frozen base is version 0
    fresh = _learner(tiny_model, lora_rank=4)
    assert newest_checkpoint(store, key.public_key(), _restore(store, fresh)).step == 1
    _assert_same(fresh.adapter_tensors(), lora.adapter_tensors())
    _assert_same(_flat(fresh.optimizer.state_dict()), _flat(lora.optimizer.state_dict()))
    result = CliRunner().invoke(app, ["export", store.url, str(tmp_path / "export"), "--step", "1",
                                      "--trust-run-json-key"])  # this machine holds no key of the test's run
    assert result.exit_code == 0, result.output
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    merged = lora.full_tensors()
    assert _close({k: exported[k] for k in merged}, merged) < 1e-6


def test_a_checkpoint_of_the_format_before_sharding_is_refused_in_one_line(tmp_path):
    from echo2.data.weights import write_weights

    store, key = open_store(str(tmp_path / "store")), Ed25519PrivateKey.generate()
    write_weights(store, layout.checkpoint_dir(3), {"w": torch.ones(2)}, shard_mb=1, meta={"step": 3}, key=key,
                  extra_files={"optimizer.pt": b"", "trainer_state.json": b'{"step": 3}'})
    with pytest.raises(Exception, match="format before sharded checkpoints") as err:
        load_checkpoint(store, 3, key.public_key())
    assert "\n" not in str(err.value)
    assert newest_checkpoint(store, key.public_key()) is None
    assert checkpoint_steps(store) == [3]


def test_a_one_process_checkpoint_prints_no_warning_of_torchs(tmp_path):
    """DCP warns at every call without a process group; a one-process learner means exactly that, and the warning
    was printed into the run's output at every checkpoint."""
    import warnings

    from echo2.data.store import open_store
    from echo2.learner.checkpoint_files import load_sharded, save_sharded

    store = open_store(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = save_sharded(store, "ck", {"model": {"w": torch.arange(3.0)}}, file_mb=1)
        back = {"model": {"w": torch.zeros(3)}}
        load_sharded(store, "ck", {e["name"]: e for e in written}, back)
    assert back["model"]["w"].tolist() == [0.0, 1.0, 2.0]
