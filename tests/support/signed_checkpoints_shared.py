"""Shared by the tests: moved out of test_signed_checkpoints.py (which imports them back) so other test modules import
them from here, not from a test module."""

from __future__ import annotations

from helpers import rollout_bytes
from typer.testing import CliRunner

from echo2.cli import app
from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.rollouts import decode_rollouts
from echo2.data.store import open_store
from echo2.learner.run import LearnerRun

RUN = "r1"


def learner_run(tiny_model, tmp_path, *, resume: bool, **train) -> LearnerRun:
    config = config_from_dict({
        "run": {"id": RUN}, "store": {"url": str(tmp_path / "store")}, "model": {"name": str(tiny_model)},
        "rollout": {"group_size": 2, "groups_per_batch": 1, "max_new_tokens": 4},
        "train": {"max_steps": 10, "checkpoint_every": 2, "groups_per_step": 1, **train},
        "trust": {"spot_check_fraction": 0}, "learner": {"num_threads": 1},
        "eval": {"before": False, "after": False}, "fleet": {"actors": 1},
    })
    return LearnerRun(config, open_store(str(tmp_path / "store")).child(layout.RUNS), resume=resume)


def train_to(run: LearnerRun, step: int) -> None:
    """Optimizer steps on a fixed file up to ``step``, then publish and checkpoint it, as ``update`` does."""
    while run.step < step:
        run.learner.train_step([decode_rollouts(rollout_bytes(0, salt=str(run.step)))])
    run.publish()
    run.checkpoint()


def export(store, dest, *args):
    return CliRunner().invoke(app, ["export", store.url, str(dest), *args])
