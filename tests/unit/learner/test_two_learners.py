"""Two learner incarnations never write one run (``learner/run.py`` and ``data/lease.py``): a second learner run
object on the same run (a Prefect retry in the same process, here) takes the run over, and the first one, still
alive, can no longer publish, checkpoint or write the ledger; every manifest names the incarnation that signed it."""

from __future__ import annotations

import pytest
from helpers import rollout_bytes

from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.rollouts import decode_rollouts
from echo2.data.store import open_store
from echo2.learner.collector import Selection
from echo2.learner.run import LearnerRun

RUN = "two-learners"


def _config(tmp_path, tiny_model):
    return config_from_dict({
        "run": {"id": RUN}, "store": {"url": str(tmp_path / "store")}, "model": {"name": str(tiny_model)},
        "rollout": {"group_size": 2, "groups_per_batch": 2, "max_new_tokens": 4},
        "train": {"max_steps": 10, "checkpoint_every": 1, "groups_per_step": 2}, "publish": {"every": 1},
        "trust": {"spot_check_fraction": 0}, "learner": {"num_threads": 1},
        "eval": {"before": False, "after": False}, "fleet": {"actors": 1},
    })


def _selection(run: LearnerRun) -> Selection:
    step = run.step + 1
    data = rollout_bytes(run.step, run_id=RUN, salt=f"-{step}")
    return Selection(step=step, learner_version=run.step, tables=[decode_rollouts(data)],
                     used=[{"key": layout.rollout_key(run.step, "a", step), "sha256": f"{step:064d}", "groups": 2}])


def test_a_learner_another_incarnation_replaced_writes_nothing(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    runs = open_store(str(tmp_path / "store")).child(layout.RUNS)
    first = LearnerRun(_config(tmp_path, tiny_model), runs, resume=False)
    first.update(_selection(first))
    second = LearnerRun(_config(tmp_path, tiny_model), runs, resume=True)
    store = second.store
    latest, entries = store.get(layout.LATEST), sorted(store.list(layout.LEDGER_CONSUMED))
    with pytest.raises(Exception, match="took this run"):
        first.update(_selection(first))  # its step 2: the publish (or the checkpoint) is refused
    with pytest.raises(Exception, match="took this run"):
        first.interrupted()
    assert store.get(layout.LATEST) == latest and sorted(store.list(layout.LEDGER_CONSUMED)) == entries
    assert not store.exists(layout.manifest_key(layout.policy_dir(2)))
    second.update(_selection(second))
    manifests = [store.get_json(layout.manifest_key(layout.policy_dir(v))) for v in (1, 2)]
    assert [m.get("incarnation") for m in manifests] == [1, 2]
