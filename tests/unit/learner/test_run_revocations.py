"""Revocations are run-wide (``learner/run.py``): an actor a version revoked stays revoked in every version the run
signs after it, a resumed learner's new timeline included, even once that timeline's numbers pass the old ones (a
relay keeps the newest signed list it verified, so a list without the old revocations would take them back)."""

from __future__ import annotations

from helpers import rollout_bytes

from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.rollouts import decode_rollouts
from echo2.data.store import open_store
from echo2.learner.collector import Selection
from echo2.learner.run import LearnerRun

RUN = "revocations"


def _config(tmp_path, tiny_model):
    return config_from_dict({
        "run": {"id": RUN}, "store": {"url": str(tmp_path / "store")}, "model": {"name": str(tiny_model)},
        "rollout": {"group_size": 2, "groups_per_batch": 2, "max_new_tokens": 4},
        "train": {"max_steps": 10, "checkpoint_every": 1, "keep_checkpoints": 5, "groups_per_step": 2},
        "publish": {"every": 1}, "trust": {"spot_check_fraction": 0}, "learner": {"num_threads": 1},
        "eval": {"before": False, "after": False}, "fleet": {"actors": 1},
    })


def _step(run: LearnerRun, salt: str) -> None:
    step = run.step + 1
    data = rollout_bytes(run.step, run_id=RUN, salt=f"-{salt}-{step}")
    run.update(Selection(step=step, learner_version=run.step, tables=[decode_rollouts(data)],
                         used=[{"key": layout.rollout_key(run.step, salt, step), "sha256": f"{step:064d}",
                                "groups": 2}]))


def test_a_revocation_outlives_the_timeline_that_made_it(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    runs = open_store(str(tmp_path / "store")).child(layout.RUNS)
    first = LearnerRun(_config(tmp_path, tiny_model), runs, resume=False)
    _step(first, "a")
    first.revoke(["intruder-1"])  # e.g. a relay token the fleet retired without a ledger event of its end
    _step(first, "a")
    _step(first, "a")  # versions 2 and 3 revoke it
    first.sink.close()
    # a resume from checkpoint 1: the new timeline publishes 2, 3 again, then 4, past every old number
    for step in (2, 3):
        first.store.delete_prefix(layout.checkpoint_dir(step) + "/")
    resumed = LearnerRun(_config(tmp_path, tiny_model), runs, resume=True)
    assert resumed.step == 1
    for _ in range(3):
        _step(resumed, "b")
    manifest = resumed.store.get_json(layout.manifest_key(layout.policy_dir(4)))
    assert "intruder-1" in manifest["revoked"], manifest["revoked"]
