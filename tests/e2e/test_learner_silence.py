"""An actor outlives a dead learner no longer than ``fleet.learner_silence_s`` (issue 18, item 7): the
learner's marks in the store (LATEST, the ledger) on a controlled clock, then a real actor process whose
learner never comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.config import Config, ConfigError, load_config
from echo2.data import layout
from echo2.data.relay_tokens import RELAY_TOKEN_ENV
from echo2.data.run_folder import create_run
from echo2.data.store import StoreError, open_store
from echo2.data.store.fsspec_store import FsspecStore
from echo2.data.weights import publish_version
from echo2.rollout.learner_watch import LearnerWatch

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_silence_is_counted_from_the_learners_last_mark(tmp_path):
    store = FsspecStore(str(tmp_path / "run"), {})
    store.put_pointer(layout.LATEST, json.dumps({"version": 0}).encode())
    clock = Clock()
    watch = LearnerWatch(store, 100.0, clock=clock)
    assert not watch.silent()
    clock.now += 99
    assert not watch.silent()
    clock.now += 1
    assert watch.silent()  # 100 s without a new mark
    marks = [lambda: store.put_pointer(layout.LATEST, json.dumps({"version": 1}).encode()),  # a publish
             lambda: store.put_json(f"{layout.LEDGER_CONSUMED}step-000001.json", {"used": []}),  # a step
             lambda: store.put_pointer(layout.COLLECTING, b'{"step": 2}')]  # a collection under way
    for mark in marks:
        mark()
        assert not watch.silent()  # seen at once: the check after a silence is never throttled away
        clock.now += 99
        assert not watch.silent()
        clock.now += 1
        assert watch.silent()


def test_a_store_that_fails_is_not_the_learners_silence(tmp_path):
    class Down(FsspecStore):
        down = False

        def list(self, prefix=""):
            if self.down:
                raise StoreError("the store does not answer")
            return super().list(prefix)

    store = Down(str(tmp_path / "run"), {})
    clock = Clock()
    watch = LearnerWatch(store, 100.0, clock=clock)
    assert not watch.silent()
    store.down = True
    clock.now += 1000
    assert not watch.silent()


def test_the_silence_is_a_documented_fleet_setting():
    assert load_config(None, []).fleet.learner_silence_s == 1800
    with pytest.raises(ConfigError, match="learner_silence_s"):
        load_config(None, ["fleet.learner_silence_s=0"])


@pytest.mark.e2e
def test_an_actor_whose_learner_is_gone_stops_by_itself(tmp_path, tiny_model):
    """No learner ever writes after version 0: the actor (the real loop, timing workload) exits 0 on its own."""
    store = open_store(str(tmp_path / "store" / "runs" / "r1"))
    key = Ed25519PrivateKey.generate()
    config = Config.model_validate({
        "run": {"id": "r1"}, "fleet": {"learner_silence_s": 3},
        "rollout": {"group_size": 2, "groups_per_batch": 1, "max_new_tokens": 4, "poll_seconds": 0.05},
        "broadcast": {"mode": "store"},
    })
    create_run(store, "r1", config.model_dump(mode="json"), key=key, echo2_version="test")
    aux = {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.is_file() and p.suffix != ".safetensors"}
    publish_version(store, 0, {"w": torch.zeros(4)}, extra_files=aux, shard_mb=1, key=key)
    env = {**os.environ, RELAY_TOKEN_ENV: "e2rt1.not.checked-here", "PYTHONPATH": str(REPO)}
    log_path = tmp_path / "actor.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "echo2.bench.overlap_actor", "--batch-seconds", "0.1",
                                 "--run", store.url, "--actor-id", "a0"], cwd=REPO, env=env,
                                stdout=log_file, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=300)  # a bound on a hang, not a measurement
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = log_path.read_text()
    assert rc == 0, log
    assert "the learner is gone; stopping" in log, log
    assert any(k.endswith(".arrow") for k in store.list(layout.ROLLOUTS)), log  # it worked until then
