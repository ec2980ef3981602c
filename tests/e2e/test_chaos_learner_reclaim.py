"""The chaos scenario ``learner-reclaim`` in its small form (``make chaos`` runs it at full size): a spot learner
reclaimed with a notice and without one, each time relaunched on a fresh folder with only the store and the key;
it adopts the running actors (no actor relaunched), loses at most one step with a notice and at most
``train.checkpoint_every`` without, LATEST moves back only by the resume rule, every rollout file is in the ledger
once and the cost report bills the learner's spot sessions and the gaps (echo2/chaos/scenarios/learner_reclaim.py)."""

from __future__ import annotations

import json

import pytest

from echo2.chaos.runner import failed
from echo2.chaos.scenarios.learner_reclaim import learner_reclaim


@pytest.mark.e2e
def test_a_reclaimed_spot_learner_is_relaunched_adopts_its_actors_and_finishes(tiny_model, tmp_path):
    (tmp_path / "tiny-model").symlink_to(tiny_model)
    row = learner_reclaim(tmp_path, quick=True, notices=NOTICES)
    print("chaos:", json.dumps({k: v for k, v in row.items() if k != "audit"}))
    assert not failed(row), row
    assert len(row["reclaims"]) == len(NOTICES)
    for r in row["reclaims"]:
        print(f"measured: notice={r['notice']} notice->checkpoint {r.get('notice_to_checkpoint_s')}s, "
              f"kill->first new step {r['kill_to_first_step_s']}s, steps lost {r['steps_lost']}")


NOTICES = (True, False)
"""Reclaims in order: with a notice (True) or not."""
