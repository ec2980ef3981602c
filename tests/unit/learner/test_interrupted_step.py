"""An interrupt (Ctrl-C, SIGTERM, a cancelled Prefect flow) that lands after the optimizer step but before the
step settled its files must not let a file be used twice: the interrupt checkpoint at step N records the files
step N trained on as settled, so the resumed run does not use (or drop) them again.

Found in a fresh-clone CI run (test_multinode's SIGTERM-and-resume): step 3 trained on a file, the interrupt
checkpoint step-000003 lacked it in ``settled``, and the resumed run's step 4 dropped it as stale, so the
ledger showed it twice."""

from __future__ import annotations

import json

import pytest
from helpers import rollout_bytes

from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.rollouts import decode_rollouts
from echo2.data.store import open_store
from echo2.learner.collector import Selection
from echo2.learner.run import LearnerRun

RUN = "interrupted-step"


def test_an_interrupt_after_the_optimizer_step_checkpoints_its_files_as_settled(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))  # the run's key stays this test's own
    config = config_from_dict({
        "run": {"id": RUN}, "store": {"url": str(tmp_path / "store")}, "model": {"name": str(tiny_model)},
        "rollout": {"group_size": 2, "groups_per_batch": 2, "max_new_tokens": 4},
        "train": {"max_steps": 10, "checkpoint_every": 5, "groups_per_step": 2},
        "trust": {"spot_check_fraction": 0}, "learner": {"num_threads": 1},
        "eval": {"before": False, "after": False}, "fleet": {"actors": 1},
    })
    run = LearnerRun(config, open_store(str(tmp_path / "store")).child(layout.RUNS), resume=False)
    # what ``run.collect()`` hands ``update`` (built here: the collection itself is test_collector.py's subject)
    key = layout.rollout_key(0, "a", 0)
    selection = Selection(step=1, learner_version=0, tables=[decode_rollouts(rollout_bytes(0, run_id=RUN))],
                          used=[{"key": key, "sha256": "0" * 64, "groups": 2}])

    real_step = run.learner.train_step

    def step_then_interrupted(tables):  # the signal arrives just after the optimizer step returned
        real_step(tables)
        raise KeyboardInterrupt

    monkeypatch.setattr(run.learner, "train_step", step_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        run.update(selection)
    assert run.step == 1
    run.interrupted()

    state = json.loads(run.store.get(layout.checkpoint_dir(1) + "/trainer_state.json"))
    assert key in state["settled"]
